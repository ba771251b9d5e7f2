"""The compute model against hand-computed cases."""

from __future__ import annotations

from decimal import Decimal

import pytest

from layers.orchestration.planning import perf
from layers.orchestration.planning.types import Assignment, ClusterOffer, JobRequirements, ModelShape, WanLink

P = 7_000_000_000
BATCH = 4_000_000
TOKENS = 40_000_000_000  # 10,000 steps


def offer(name: str, site: str, gpus: int = 8, model: str = "H100", tflops: float = 989.0,
          price: str = "2.00") -> ClusterOffer:
    return ClusterOffer(name=name, site=site, region="eu", provider="p", gpu_model=model, tflops=tflops,
                        memory_gb=80, free_gpus=gpus, price_per_gpu_hour=Decimal(price),
                        intra_node_gbps=900.0, inter_node_gbps=400.0, gpus_per_node=8)


def job(**kw) -> JobRequirements:
    return JobRequirements(model=ModelShape(P, 32, 4096, 4096), tokens=TOKENS, global_batch_tokens=BATCH, **kw)


def two_sites(gbps: float = 1.0, rtt_ms: float = 20.0):
    offers = {"a": offer("a", "s1"), "b": offer("b", "s2")}
    links = [WanLink("s1", "s2", gbps, rtt_ms, Decimal("0.05"))]
    placement = [Assignment("a", "s1", 8, "H100"), Assignment("b", "s2", 8, "H100")]
    return offers, links, placement


def test_compute_bound_single_site_matches_hand_computation():
    offers = {"a": offer("a", "s1")}
    p = perf.predict(job(), [Assignment("a", "s1", 8, "H100")], "ddp", offers, [])
    compute = 6 * P * BATCH / (8 * 989e12 * 0.40)
    comm = 2 * 7 / 8 * (4 * P) * 8 / 900e9 + 2 * 7 * 10e-6  # ring over NVLink, fp32 gradients
    # 7 B parameters x 16 B do not fit one 80 GB GPU: sharded over the site's 8, whose forward and backward
    # each all-gather the bf16 parameters, (N-1)/N x 2P over NVLink
    assert (p.shard, p.activation_checkpointing) == ("site", "none")
    comm += 2 * (7 / 8 * (2 * P) * 8 / 900e9 + 7 * 10e-6)
    assert p.steps == 10_000
    assert p.compute_seconds_per_step == pytest.approx(compute)
    assert p.comm_seconds_per_step == pytest.approx(comm)
    total = 10_000 * (compute + comm) + perf.STARTUP_SECONDS
    assert p.total_seconds == pytest.approx(total)
    assert p.wan_bytes == 0 and p.egress_bytes_by_link == {}
    assert p.gpu_seconds_by_cluster == {"a": pytest.approx(8 * total)}
    assert p.est_cost == pytest.approx(8 * total / 3600 * 2.0)


def test_wan_bound_ddp_against_diloco():
    offers, links, placement = two_sites(gbps=1.0, rtt_ms=20.0)
    ddp = perf.predict(job(), placement, "ddp", offers, links)
    diloco = perf.predict(job(inner_steps=100, overlap=False), placement, "diloco", offers, links)
    k_ddp = 4 * P  # fp32 gradients, as the runtime sends them
    gathers = 2 * (7 / 8 * (2 * P) * 8 / 900e9 + 7 * 10e-6)  # sharded over each site's 8 GPUs (as above)
    assert ddp.shard == diloco.shard == "site"
    assert ddp.comm_seconds_per_step == pytest.approx(2 * 15 / 16 * k_ddp * 8 / 1e9 + 2 * 15 * 0.010 + gathers)
    intra = 2 * 7 / 8 * (4 * P) * 8 / 900e9 + 2 * 7 * 10e-6
    outer = intra + 2 * 1 / 2 * (4 * P) * 8 / 1e9 + 2 * 0.010
    assert diloco.comm_seconds_per_step == pytest.approx(intra + outer / 100 + gathers)
    # WAN bytes per hop per step: 2(N-1)/N * 4P every step against 2(S-1)/S * 4P every 100 steps
    assert ddp.wan_bytes / diloco.wan_bytes == pytest.approx((2 * 15 / 16 * 4) / (4 / 100))
    assert ddp.total_seconds > 5 * diloco.total_seconds
    assert set(ddp.egress_bytes_by_link) == {("s1", "s2"), ("s2", "s1")}


def test_diloco_overlap_hides_the_outer_all_reduce():
    offers, links, placement = two_sites(gbps=10.0)
    hidden = perf.predict(job(inner_steps=100, overlap=True), placement, "diloco", offers, links)
    shown = perf.predict(job(inner_steps=100, overlap=False), placement, "diloco", offers, links)
    assert hidden.comm_seconds_per_step < shown.comm_seconds_per_step
    assert hidden.wan_bytes == shown.wan_bytes


@pytest.mark.parametrize(("compression", "ratio"), [("bf16", 0.5), ("fp16", 0.5), ("int8", (1 + 4 / 256) / 4)])
def test_compression_shrinks_the_wan_leg(compression, ratio):
    offers, links, placement = two_sites()
    plain = perf.predict(job(), placement, "diloco", offers, links)
    packed = perf.predict(job(compression=compression), placement, "diloco", offers, links)
    assert packed.wan_bytes == pytest.approx(plain.wan_bytes * ratio)
    # every strategy sends fp32 values: the codec shrinks hierarchical's WAN leg by the same ratio
    hier = perf.predict(job(compression=compression), placement, "hierarchical", offers, links)
    assert hier.wan_bytes == pytest.approx(perf.predict(job(), placement, "hierarchical", offers, links).wan_bytes
                                           * ratio)


def test_cost_adds_gpu_hours_and_egress():
    offers, links, placement = two_sites()
    p = perf.predict(job(), placement, "hierarchical", offers, links)
    gpu_cost = 16 * p.total_seconds / 3600 * 2.0
    assert p.est_cost == pytest.approx(gpu_cost + p.wan_bytes / 1e9 * 0.05)
    assert p.egress_bytes_by_link[("s1", "s2")] == pytest.approx(p.steps * 2 * 1 / 2 * 4 * P)


def test_heterogeneous_gpus_share_the_batch_by_throughput():
    offers = {"a": offer("a", "s1"), "b": offer("b", "s1", model="A100", tflops=312.0)}
    placement = [Assignment("a", "s1", 4, "H100"), Assignment("b", "s1", 4, "A100")]
    p = perf.predict(job(), placement, "ddp", offers, [])
    assert p.compute_seconds_per_step == pytest.approx(6 * P * BATCH / (4 * 989e12 * 0.40 + 4 * 312e12 * 0.45))


def test_every_strategy_is_priced_for_exactly_the_budget():
    """The runtime trains exactly the token budget whatever the strategy: a quote prices those steps;
    TOKEN_EFFICIENCY only weighs strategies against each other (steps to ddp's loss)."""
    offers, links, placement = two_sites()
    for strategy in ("ddp", "diloco", "gossip", "async_ps"):
        assert perf.predict(job(), placement, strategy, offers, links).steps == 10_000
    assert perf.steps_for(job(), "gossip") == 10_800 and perf.steps_for(job(), "async_ps") == 11_000


def test_diloco_token_efficiency_is_the_runtimes():
    from cpn.runtime.autotune import DILOCO_TOKEN_EFFICIENCY

    assert perf.TOKEN_EFFICIENCY["diloco"] == DILOCO_TOKEN_EFFICIENCY


def test_slots_sharing_a_host_stretch_only_the_compute_phase():
    """Four slots on two cores: the compute phase takes twice as long, the WAN all-reduce does not."""
    offers, links, placement = two_sites()
    alone = perf.predict(job(), placement, "ddp", offers, links)
    shared = perf.predict(job(), placement, "ddp", offers, links, host_cores=8)  # 16 slots on 8 cores
    assert shared.compute_seconds_per_step == pytest.approx(2 * alone.compute_seconds_per_step)
    assert shared.comm_seconds_per_step == pytest.approx(alone.comm_seconds_per_step)
    roomy = perf.predict(job(), placement, "ddp", offers, links, host_cores=32)
    assert roomy.step_seconds == pytest.approx(alone.step_seconds)


def test_sites_without_a_link_are_unreachable():
    offers, _, placement = two_sites()
    with pytest.raises(ValueError, match="no link between sites s1 and s2"):
        perf.predict(job(), placement, "hierarchical", offers, [])


def test_every_strategy_predicts():
    offers, links, placement = two_sites(gbps=10.0)
    for strategy in ("ddp", "hierarchical", "local_sgd", "diloco", "gossip", "ssp", "async_ps"):
        p = perf.predict(job(), placement, strategy, offers, links)
        assert p.total_seconds > 0 and p.wan_bytes > 0 and p.strategy == strategy


def two_regions(region_of: dict[str, str], metro_gbps: float = 10.0, long_haul_gbps: float = 1.0):
    """Sites e1, e2 (region eu) and u1, u2 (region us), one GPU each: metro links inside a region,
    long-haul links between, no RTT (the runtime's cost model and this one then agree to the byte)."""
    sites = ["e1", "e2", "u1", "u2"]
    offers = {s: ClusterOffer(name=s, site=s, region=region_of[s], provider="p", gpu_model="H100", tflops=989.0,
                              memory_gb=80, free_gpus=1, price_per_gpu_hour=Decimal("2.00")) for s in sites}
    links = [WanLink(a, b, metro_gbps if a[0] == b[0] else long_haul_gbps, 0.0, Decimal("0.05"))
             for i, a in enumerate(sites) for b in sites[i + 1:]]
    return offers, links, [Assignment(s, s, 1, "H100") for s in sites]


def test_hierarchical_across_regions_is_priced_as_the_multilevel_all_reduce():
    from cpn.runtime import costmodel

    regional = two_regions({"e1": "eu", "e2": "eu", "u1": "us", "u2": "us"})
    one_region = two_regions(dict.fromkeys(["e1", "e2", "u1", "u2"], "eu"))
    multi = perf.predict(job(), regional[2], "hierarchical", regional[0], regional[1])
    two = perf.predict(job(), one_region[2], "hierarchical", one_region[0], one_region[1])
    k = 4 * P  # one GPU per site: no intra term, all of comm is cross-site
    ratio = (costmodel.predict_multilevel_seconds(k, 1, 2, 2, 10_000, 1_000, params=costmodel.CostParams())
             / costmodel.predict_seconds("hierarchical", k, 4, 1, 1_000, params=costmodel.CostParams()))
    assert ratio < 0.5  # long-haul carries K/R instead of 2(S-1)/S K: the metro level hides behind it
    assert multi.comm_seconds_per_step / two.comm_seconds_per_step == pytest.approx(ratio, rel=1e-9)
    assert multi.total_seconds < two.total_seconds
    long_haul = sum(b for (a, c), b in multi.egress_bytes_by_link.items() if a[0] != c[0]) / multi.steps
    assert long_haul == pytest.approx(4 * 2 * 1 / 2 * k / 2)  # each site sends 2(G-1)/G * K/R to the other region
    metro = sum(b for (a, c), b in multi.egress_bytes_by_link.items() if a[0] == c[0]) / multi.steps
    assert metro == pytest.approx(4 * (k / 2 + k / 2))  # reduce-scatter K/R + all-gather (R-1)/R * K per site
    assert two.wan_bytes / two.steps == pytest.approx(4 * 2 * 3 / 4 * k)  # the two-level ring, every hop


def test_the_pipeline_slice_is_the_runtimes():
    from cpn.runtime.collectives import DEFAULT_CHUNK_BYTES

    assert perf.PIPELINE_SLICE_BYTES == DEFAULT_CHUNK_BYTES
