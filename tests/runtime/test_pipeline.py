"""The pipeline strategy: the cut, equivalence with one process, loss, bubble and WAN bytes (real Gloo processes)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cpn.runtime import checkpoint
from cpn.runtime.config import FaultConfig, StrategyConfig, TrainConfig, trim_shares
from cpn.runtime.data import ShardSampler, load_corpus, split_corpus, val_batches
from cpn.runtime.model import build_model, count_parameters
from cpn.runtime.stages import Stage, cut_model, partition, unit_sizes
from cpn.runtime.strategies.base import lr_at, make_optimizer
from cpn.runtime.strategies.pipeline import ideal_bubble, micro_sizes
from cpn.runtime.topology import Topology
from cpn.runtime.train import FINAL_MODEL, preflight, run_local
from cpn.train.lm import evaluate


def pipe(*, steps: int, extra_tokens: int = 0, **knobs: object) -> TrainConfig:
    top = {k: knobs.pop(k) for k in ("optimizer", "lr", "model") if k in knobs}
    return TrainConfig(
        seq_len=64, global_batch_tokens=1024, tokens=1024 * steps + extra_tokens, val_every=10, val_batches=2,
        strategy=StrategyConfig(**{"name": "pipeline", "micro_batches": 4, "wan_timeout_seconds": 8.0, **knobs}),
        **{"model": "tiny", **top},
    )


def run(cfg: TrainConfig, run_dir: Path, sites: int, workers: int, start_method: str = "forkserver") -> dict:
    return run_local(cfg, Topology.uniform(sites, workers), run_dir=run_dir, timeout=120, start_method=start_method)


def test_the_cut_minimises_the_largest_stage_and_covers_every_parameter() -> None:
    assert partition([5, 1, 1, 1, 5], 3) == [(0, 1), (1, 4), (4, 5)]
    assert partition([1, 2, 3], 1) == [(0, 3)]
    with pytest.raises(ValueError, match="between 1 and 3 stages"):
        partition([1, 2, 3], 4)
    model = build_model("small")
    sizes = unit_sizes(model)
    tied = model.tok.weight.numel()
    assert sum(sizes) == count_parameters(model) + tied  # the head counts its copy of the token table
    stages = [Stage(model, c) for c in cut_model(model, 3)]
    owned = [p for s in stages for p in s.owned_params()]
    assert len(owned) == len({id(p) for p in owned}) == len(list(model.parameters()))
    assert stages[0].ties_embedding and stages[2].ties_embedding and not stages[1].ties_embedding
    x = torch.randint(0, 256, (2, 16))
    h = x
    for s in stages:
        h = s(h)
    torch.testing.assert_close(h, model(x))


def test_micro_batches_split_whole_sequences_then_the_partial_one() -> None:
    assert micro_sizes(8 * 64, 64, 4) == [(2, 64)] * 4
    assert micro_sizes(3 * 64 + 10, 64, 4) == [(1, 64)] * 3 + [(1, 10)]
    assert micro_sizes(0, 64, 4) == []
    assert ideal_bubble(3, 8) == pytest.approx(0.2)


def reference(cfg: TrainConfig, shards: int, ranks: list[int], steps: int | None = None) -> torch.nn.Module:
    """One process training the whole model on the pipeline's batches: stage 0's ranks' shares, each
    rank's from its shard of the whole corpus."""
    train = split_corpus(load_corpus(cfg.corpus_bytes)).train
    samplers = [ShardSampler(train, shard=r, num_shards=shards, seq_len=cfg.seq_len, seed=cfg.seed) for r in ranks]
    model = build_model(cfg.model, seed=cfg.seed)
    opt = make_optimizer(cfg, list(model.parameters()))
    shares = cfg.shares(len(ranks))
    for step in range(cfg.total_steps if steps is None else steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(cfg, cfg.tokens_through(step) / cfg.tokens)
        tokens = cfg.step_tokens(step)
        per_rank = trim_shares(tokens, shares, cfg.seq_len)
        loss = 0.0
        for sampler, mine in zip(samplers, per_rank, strict=True):
            full, tail = divmod(mine, cfg.seq_len)
            x, y = sampler.batch(step, full + (1 if tail else 0))
            parts = [(x[:full], y[:full])] if full else []
            parts += [(x[full:, :tail], y[full:, :tail])] if tail else []
            for a, b in parts:
                loss = loss + model.loss(a, b) * (a.numel() / tokens)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return model


@pytest.mark.parametrize(("sites", "workers"), [(2, 1), (2, 2)])
def test_two_stages_train_the_same_parameters_as_one_process(sites: int, workers: int, tmp_path: Path) -> None:
    cfg = pipe(steps=6, extra_tokens=100, compression="none")  # the 7th step is trimmed mid-sequence
    summary = run(cfg, tmp_path, sites, workers)
    assert summary["tokens"] == cfg.tokens  # every token once, not once per stage
    got = torch.load(tmp_path / FINAL_MODEL, weights_only=True)
    want = reference(cfg, workers, list(range(workers))).state_dict()
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4, msg=name)


def test_a_resumed_pipeline_ends_where_an_uninterrupted_one_does(tmp_path: Path) -> None:
    cfg = pipe(steps=6, extra_tokens=100, compression="none")
    ckpt = str(tmp_path / "ckpt")
    first = cfg.model_copy(update={"checkpoint_every": 2, "checkpoint_dir": ckpt, "stop_at_step": 3})
    run(first, tmp_path / "first", 2, 1)
    resumed = run(cfg.model_copy(update={"resume": ckpt}), tmp_path / "resumed", 2, 1)
    val = val_batches(split_corpus(load_corpus(cfg.corpus_bytes)).val, seq_len=cfg.seq_len, batches=cfg.val_batches)
    at_checkpoint = evaluate(reference(cfg, 1, [0], steps=2), val)
    assert resumed["initial_val_loss"] == pytest.approx(at_checkpoint, abs=1e-4)  # every stage's, not stale copies
    got = torch.load(tmp_path / "resumed" / FINAL_MODEL, weights_only=True)
    want = reference(cfg, 1, [0]).state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4, msg=name)


def test_validation_runs_through_the_stages_and_moves_activations_not_parameters(tmp_path: Path) -> None:
    """Each validation feeds rank 0's windows through the stages (the same losses as the whole model
    in one process); only the final weights bring a stage's parameters to rank 0."""
    cfg = pipe(steps=6, extra_tokens=100, compression="none")
    summary = run(cfg, tmp_path, 2, 1)
    val = val_batches(split_corpus(load_corpus(cfg.corpus_bytes)).val, seq_len=cfg.seq_len, batches=cfg.val_batches)
    assert summary["initial_val_loss"] == pytest.approx(evaluate(build_model(cfg.model, seed=cfg.seed), val), abs=1e-5)
    assert summary["final_val_loss"] == pytest.approx(evaluate(reference(cfg, 1, [0]), val), abs=1e-4)
    model = build_model(cfg.model)
    rows, length = val[0][0].shape
    per_batch = 16 + rows * length * model.cfg.d_model * 4 + rows * length  # shape, activations, byte targets
    per_validation = 8 + cfg.val_batches * per_batch + 8  # the count, the batches, the loss back
    final_weights = 4 * sum(p.numel() for p in Stage(model, cut_model(model, 2)[1]).owned_params())
    assert summary["wan_eval_bytes"] == 2 * per_validation + final_weights  # the first and the last validation


@pytest.mark.parametrize("compression", ["none", "int8"])
def test_three_stages_lower_the_loss_and_report_bubble_and_wan_bytes(compression: str, tmp_path: Path) -> None:
    cfg = pipe(steps=40, compression=compression)
    summary = run(cfg, tmp_path, 3, 1)
    assert summary["stages"] == [["embed"], ["block0"], ["block1", "head"]]  # by parameter count
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.5, summary
    assert 0 < summary["bubble_fraction"] < 1
    assert summary["bubble_ideal"] == pytest.approx(ideal_bubble(3, 4), abs=1e-4)
    split = summary["wan_activation_bytes"] + summary["wan_gradient_bytes"] + summary["wan_eval_bytes"]
    assert split == summary["wan_bytes"]
    fp32 = cfg.tokens * build_model("tiny").cfg.d_model * 4 * 2  # two cuts' activations in float32
    targets = cfg.tokens  # one byte per target token, stage 0 to the last stage
    if compression == "none":
        assert summary["wan_activation_bytes"] == fp32 + targets
    else:
        assert summary["wan_activation_bytes"] < 0.3 * fp32


@pytest.mark.parametrize("workers", [1, 2])
def test_two_replicas_averaging_gradients_every_step_train_what_one_process_does(workers: int, tmp_path: Path) -> None:
    """4 sites = 2 replicas of a 2-stage pipeline with H = 1: each stage's gradients are averaged over
    its two copies every step, so the run is one process training the whole batch (2·W shards); only
    the sites' leaders cross the WAN for it."""
    cfg = pipe(steps=6, extra_tokens=100, compression="none", stages=2, inner_steps=1)
    summary = run(cfg, tmp_path, 4, workers)
    assert summary["tokens"] == cfg.tokens and summary["replicas"] == 2
    got = torch.load(tmp_path / FINAL_MODEL, weights_only=True)
    want = reference(cfg, 2 * workers, list(range(2 * workers))).state_dict()
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=2e-5, rtol=1e-4, msg=name)
    stage_params = count_parameters(build_model("tiny")) + build_model("tiny").tok.weight.numel()
    # every step, each of the 4 site leaders sends (D-1)/D x 2 of its stage's gradients: 2 replicas x every stage
    assert summary["wan_replica_bytes"] == cfg.total_steps * 2 * stage_params * 4


def test_replicas_that_lost_a_site_go_on_as_one_pipeline_from_their_checkpoint(tmp_path: Path) -> None:
    """What the orchestrator does when the live sites no longer hold D x P (layers/orchestration/lifecycle/
    replan.py): 2 replicas x 2 stages checkpoint, then one pipeline on 2 sites resumes from the first
    sites' files — the model the replicas held — and trains the rest of the budget."""
    cfg = pipe(steps=6, extra_tokens=100, compression="none", stages=2, inner_steps=1)
    ckpt = str(tmp_path / "ckpt")
    run(cfg.model_copy(update={"checkpoint_every": 2, "checkpoint_dir": ckpt, "stop_at_step": 3}), tmp_path / "two", 4, 1)
    resumed = run(cfg.model_copy(update={"resume": ckpt}), tmp_path / "one", 2, 1)
    val = val_batches(split_corpus(load_corpus(cfg.corpus_bytes)).val, seq_len=cfg.seq_len, batches=cfg.val_batches)
    at_checkpoint = evaluate(reference(cfg, 2, [0, 1], steps=2), val)  # H = 1: the replicas held one model
    assert resumed["initial_val_loss"] == pytest.approx(at_checkpoint, abs=1e-4)
    assert resumed["replicas"] == 1 and resumed["tokens"] == cfg.tokens - 2 * cfg.global_batch_tokens
    assert resumed["final_val_loss"] < resumed["initial_val_loss"]


def test_replicas_of_the_pipeline_average_as_local_sgd_and_lower_the_loss(tmp_path: Path) -> None:
    cfg = pipe(steps=40, compression="none", stages=2, inner_steps=4)
    summary = run(cfg, tmp_path, 4, 1)
    assert summary["replicas"] == 2 and summary["inner_steps"] == 4
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.5, summary
    stage_params = count_parameters(build_model("tiny")) + build_model("tiny").tok.weight.numel()
    averages = 40 // 4  # every 4th step, the last one included (validations in between see replica 0)
    assert summary["wan_replica_bytes"] == averages * 2 * stage_params * 4
    split = (summary["wan_activation_bytes"] + summary["wan_gradient_bytes"] + summary["wan_eval_bytes"]
             + summary["wan_replica_bytes"])
    assert split == summary["wan_bytes"]


@pytest.mark.parametrize("lost", [3, 2])
def test_with_two_replicas_the_other_goes_on_when_a_site_is_lost(lost: int, tmp_path: Path) -> None:
    """Issue 14, item 3: 2 replicas x 2 stages averaged every 4 steps; a site of replica 1 (its stage 1,
    site 3, or its stage 0, site 2) dies at step 10. Replica 1's live site leaves cleanly, the next
    averaging drops it, and replica 0 trains the rest of the budget (every whole step from that averaging
    on: 64 % of the tokens were trained before it took the lost replica's share) — no restart."""
    cfg = pipe(steps=40, compression="none", stages=2, inner_steps=4).model_copy(
        update={"faults": FaultConfig(kill_site=lost, kill_at_step=10)})
    summary = run(cfg, tmp_path, 4, 1)
    assert summary["live_sites"] == [0, 1] and summary["live_replicas"] == [0], summary
    assert 0 in summary["finished_ranks"] and 1 in summary["finished_ranks"], summary
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 1.0, summary
    # replica 1's share of the steps between its loss and the next averaging is all that is not trained;
    # a dead stage 0 (site 2) reports nothing: its 10 steps' tokens are trained but not in the summary
    uncounted = 10 * 512 if lost == 2 else 0
    assert cfg.tokens - 4 * 512 - uncounted <= summary["tokens"] <= cfg.tokens - uncounted, summary
    survivor = 5 - lost  # replica 1's other site
    log = (tmp_path / "logs" / f"rank{survivor}.log")
    text = log.read_text() if log.exists() else "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*"))
    assert "pipeline replica 1 lost a site" in text, text[-2000:]


def test_a_restart_after_a_replica_left_resumes_its_sites_from_a_live_replicas_copy(tmp_path: Path) -> None:
    """Review: the replica that left writes no more checkpoints, so a later restart of all D replicas found no
    file for its sites and started them from untrained weights (val 2.998 -> 3.373 after the first averaging).
    A site without its own file now loads its stage from another replica's site."""
    ckpt = tmp_path / "ckpt"
    cfg = pipe(steps=40, compression="none", stages=2, inner_steps=4)
    first = cfg.model_copy(update={"faults": FaultConfig(kill_site=3, kill_at_step=10), "checkpoint_every": 8,
                                   "checkpoint_dir": str(ckpt), "stop_at_step": 20})
    run(first, tmp_path / "a", 4, 1)
    assert checkpoint.latest(ckpt)["sites"] == [0, 1]
    step, state, _ = checkpoint.load(ckpt, 3, lambda site: site % 2 == 1)
    assert state is not None and checkpoint.load(ckpt, 3)[1] is None
    resumed = run(cfg.model_copy(update={"resume": str(ckpt)}), tmp_path / "b", 4, 1)
    vals = [p["val"] for p in resumed["val_curve"] if p["val"] is not None]
    assert max(vals[1:]) < vals[0], vals  # no jump when the restored replicas first average


def test_a_checkpoint_due_after_a_replica_broke_does_not_wait_for_its_sites(tmp_path: Path) -> None:
    """Review: site 3 killed at step 13, a checkpoint at step 14, the run's end at 16 — before any averaging
    dropped replica 1, rank 0's commit waited COMMIT_TIMEOUT_SECONDS (120 s) for sites 2 and 3 at the end.
    The broken replica's leader now tells the commits it has left."""
    ckpt = tmp_path / "ckpt"
    cfg = pipe(steps=16, compression="none", stages=2, inner_steps=4).model_copy(
        update={"faults": FaultConfig(kill_site=3, kill_at_step=13), "checkpoint_every": 14, "checkpoint_dir": str(ckpt)})
    summary = run(cfg, tmp_path, 4, 1)
    assert summary["wall_seconds"] < checkpoint.COMMIT_TIMEOUT_SECONDS / 2, summary["wall_seconds"]
    assert checkpoint.latest(ckpt) == {"step": 14, "sites": [0, 1]}


def test_an_error_of_the_computation_in_replica_1_fails_the_run(tmp_path: Path, monkeypatch) -> None:
    """Review: any exception in replica 1 made it 'leave cleanly' and the job succeed without it. Only a
    failed exchange with a peer is a lost site; an out-of-memory error (or a user's bug) fails the run."""
    from cpn.runtime.strategies.pipeline import Pipeline

    schedule = Pipeline._schedule

    def oom(self: Pipeline, step: int) -> float | None:
        if self.ctx.site == 2 and step == 5:
            raise RuntimeError("CUDA out of memory (injected)")
        return schedule(self, step)

    monkeypatch.setattr(Pipeline, "_schedule", oom)  # the workers are forked: they inherit it
    cfg = pipe(steps=12, compression="none", stages=2, inner_steps=4)
    with pytest.raises(RuntimeError, match="out of memory"):
        run(cfg, tmp_path, 4, 1, start_method="fork")  # plain fork: the workers must inherit the patch


def test_preflight_refuses_a_pipeline_it_cannot_run() -> None:
    with pytest.raises(ValueError, match="must divide the job's 2 sites"):
        preflight(pipe(steps=4, stages=3), Topology.uniform(2, 1))
    with pytest.raises(ValueError, match="must divide the job's 4 sites"):
        preflight(pipe(steps=4, stages=3), Topology.uniform(4, 1))
    uneven = Topology.model_validate({"sites": [{"name": "a", "ranks": 1}, {"name": "b", "ranks": 2}]})
    with pytest.raises(ValueError, match="same number of workers at every site"):
        preflight(pipe(steps=4), uneven)
    with pytest.raises(ValueError, match="too few for 5 stages"):
        preflight(pipe(steps=4), Topology.uniform(5, 1))
    with pytest.raises(ValueError, match="stages is only for the pipeline"):
        StrategyConfig(name="ddp", stages=2)


def test_preflight_leaves_a_users_model_to_be_checked_when_it_is_wrapped() -> None:
    """A spec.code job's config names the tiny preset (4 units) for its budget only: 5 stages of the user's
    model are not refused for tiny's units (the runtime checks the user's nn.Sequential when it is wrapped)."""
    with pytest.raises(ValueError, match="too few for 5 stages"):
        preflight(pipe(steps=4), Topology.uniform(5, 1))
    preflight(pipe(steps=4), Topology.uniform(5, 1), builtin_model=False)


def test_the_benchmark_checks_the_issues_targets_against_ddp(tmp_path: Path) -> None:
    from cpn.runtime.bench_pipeline import PipelineBenchOptions, targets, write_markdown

    with pytest.raises(ValueError, match="pipeline\\+CODEC"):
        PipelineBenchOptions(strategies=["ddp", "diloco+int8"])
    row = {"wan_activation_bytes": 0, "wan_gradient_bytes": 0, "wan_eval_bytes": 0, "bubble_ideal": None,
           "bubble_fraction": None}
    ddp = {**row, "strategy": "ddp", "wall_seconds": 100.0, "final_val_loss": 2.0, "wan_bytes": 1000,
           "time_to_ddp_loss_seconds": 90.0}
    fast = {**row, "strategy": "pipeline", "wall_seconds": 50.0, "final_val_loss": 2.01, "wan_bytes": 90,
            "bubble_fraction": 0.25, "bubble_ideal": 0.2, "time_to_ddp_loss_seconds": 40.0}
    slow = {**fast, "strategy": "pipeline+int8", "wan_bytes": 200, "bubble_fraction": 0.35,
            "time_to_ddp_loss_seconds": None}
    got = targets([ddp, fast, slow])
    assert got["pipeline"] == {"wan_ratio": 0.09, "wan_met": True, "loss_gap": 0.005, "sooner_met": True,
                               "bubble_bound": 0.3, "bubble_met": True}
    assert got["pipeline+int8"]["wan_met"] is False and got["pipeline+int8"]["sooner_met"] is False
    assert got["pipeline+int8"]["bubble_met"] is False
    report = {"command": "cpn bench pipeline --json", "options": {**vars(PipelineBenchOptions()), "wan_mbps": 20.0},
              "results": [ddp, fast, slow], "targets": got, "machine": {"cpus": 2, "when": "now"}}
    md = write_markdown(report, tmp_path).read_text()
    assert "| pipeline | 0.090 (met) | +0.50 % | met | 0.300 | met |" in md
    assert "| pipeline+int8 | 0.200 (not met) |" in md


def test_the_benchmark_runs_replicas_of_the_pipeline_beside_one_pipeline(tmp_path: Path) -> None:
    """`cpn bench pipeline --sites 4 --strategies pipeline,pipeline*2`: 4 stages, and 2 replicas of 2."""
    from cpn.runtime.bench_pipeline import PipelineBenchOptions, run_benchmark, train_config

    with pytest.raises(ValueError, match="3 replicas do not divide the 4 sites"):
        PipelineBenchOptions(sites=4, strategies=["pipeline*3"])
    with pytest.raises(ValueError, match="pipeline\\*D"):
        PipelineBenchOptions(sites=4, strategies=["ddp*2"])
    opts = PipelineBenchOptions(sites=4, model="tiny", tokens=12_288, seq_len=64, global_batch=1024, micro_batches=2,
                                strategies=["pipeline", "pipeline*2+int8"])
    assert train_config("pipeline*2+int8", opts).strategy.stages == 2
    assert train_config("pipeline", opts).strategy.stages is None
    one, two = run_benchmark(opts, tmp_path)["results"]
    assert (len(one["stages"]), one["replicas"], one["wan_replica_bytes"]) == (4, 1, 0), one
    assert (len(two["stages"]), two["replicas"]) == (2, 2) and two["wan_replica_bytes"] > 0, two
    assert two["final_val_loss"] < two["initial_val_loss"], two
    md = (tmp_path / "pipeline.md").read_text()
    assert "| pipeline*2+int8 |" in md and "replicas MB" in md


def test_auto_picks_how_often_replicas_average_and_says_so() -> None:
    from cpn.runtime.autotune import explain, resolve

    four = Topology.uniform(4, 1)
    replicas = resolve(pipe(steps=60, stages=2), four)
    assert replicas.strategy.inner_steps > 1  # averaged as local SGD, not every step
    assert explain(replicas, four) == f"pipeline, 2 stages x 2 replicas averaged every {replicas.strategy.inner_steps} steps"
    assert resolve(pipe(steps=60), four).strategy.inner_steps == 1  # one pipeline: nothing to average
    assert explain(resolve(pipe(steps=60), four), four) == "pipeline, 4 stages"
    exact = resolve(pipe(steps=60, stages=2, inner_steps=1), four)
    assert explain(exact, four) == "pipeline, 2 stages x 2 replicas averaged every step (gradients)"
