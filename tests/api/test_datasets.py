"""Datasets through the API: the kind's CRUD and tenancy, data-transfer lines in quotes, residency,
and the replica URI each site's workers receive in their contract."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from decimal import Decimal

from sqlalchemy import select

from layers.orchestration.lifecycle.models import SubtaskRow
from layers.orchestration.lifecycle.reconciler import Reconciler, ReconcilerConfig
from layers.orchestration.planning.data import DEFAULT_PRICE_PER_GB
from layers.service.models import JobRow, LedgerEntry, QuoteRow
from tests.api.test_jobs import job, quotes, register_world, submit
from tests.layers.orchestration.test_reconciler import _job, _world


def dataset(name: str = "corpus", size: float = 50, locations: dict[str, str] | None = None, **spec) -> dict:
    where = locations if locations is not None else {"ams-1": "s3://ams/corpus/"}
    return {"apiVersion": "cpn/v1", "kind": "Dataset", "metadata": {"name": name},
            "spec": {"sizeGB": size, "format": "jsonl",
                     "locations": [{"site": s, "uri": u} for s, u in where.items()], **spec}}


async def create(api, body: dict, who: str = "alice"):  # type: ignore[no-untyped-def]
    return await api.client.post("/api/v1/datasets", json=body, headers=api.auth(who))


def transfer_lines(quote: dict) -> list[dict]:
    return [x for x in quote["price"]["lines"] if x["item"] == "data-transfer"]


async def test_create_get_list_delete_and_other_users_never_see_it(api) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    resp = await create(api, dataset(regions=["eu-west"]))
    assert resp.status == 201, await resp.text()
    made = await resp.json()
    assert made["metadata"]["namespace"] == "alice" and made["spec"]["sizeGB"] == 50
    assert made["status"] == {"replicas": 1, "sites": "ams-1", "regions": "eu-west"}
    got = await (await api.client.get("/api/v1/datasets/corpus", headers=api.auth("alice"))).json()
    assert got["spec"]["locations"] == [{"site": "ams-1", "uri": "s3://ams/corpus/"}]
    listed = await (await api.client.get("/api/v1/datasets", headers=api.auth("alice"))).json()
    assert [d["metadata"]["name"] for d in listed["items"]] == ["corpus"]

    assert (await api.client.get("/api/v1/datasets/corpus", headers=api.auth("bob"))).status == 404
    assert (await api.client.get("/api/v1/datasets/alice%2Fcorpus", headers=api.auth("bob"))).status == 404
    assert (await api.client.delete("/api/v1/datasets/corpus", headers=api.auth("bob"))).status == 404
    assert (await (await api.client.get("/api/v1/datasets", headers=api.auth("bob"))).json())["items"] == []
    assert (await create(api, dataset(), who="bob")).status == 201  # bob's own `corpus`: names are per user
    resp = await submit(api, job("theirs", dataset="alice/corpus"), who="bob")
    assert resp.status == 422 and (await resp.json())["error"]["field"] == "spec.dataset"

    assert (await api.client.delete("/api/v1/datasets/corpus", headers=api.auth("alice"))).status == 200
    assert (await api.client.get("/api/v1/datasets/corpus", headers=api.auth("alice"))).status == 404
    assert (await api.client.get("/api/v1/datasets/corpus", headers=api.auth("bob"))).status == 200


async def test_bad_datasets_are_refused_naming_the_field(api) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    for body, field in ((dataset(size=0), "spec.sizeGB"),
                        (dataset(locations={"mars-1": "s3://x"}), "spec.locations[0].site"),
                        (dataset(locations={}), "spec.locations"),
                        (dataset(regions=["EU West"]), "spec.regions"),
                        (dataset(format="tokens"), "spec.vocab"),  # token ids need their vocabulary
                        (dataset(vocab=4096), "spec.vocab"),  # a vocabulary for a jsonl file means nothing
                        (dataset(format="tokens", vocab=1), "spec.vocab")):
        resp = await create(api, body)
        assert resp.status == 422, (field, await resp.text())
        assert (await resp.json())["error"]["field"].startswith(field), await resp.text()
    twice = dataset()
    twice["spec"]["locations"] *= 2
    resp = await create(api, twice)
    assert resp.status == 422 and (await resp.json())["error"]["field"] == "spec.locations[1].site"
    resp = await api.client.post("/api/v1/apply", json={"items": [{**dataset("via-apply"), "kind": "ds"}]},
                                 headers=api.auth("alice"))  # the short name, in a batch
    assert resp.status == 200 and (await resp.json())["items"][0]["kind"] == "Dataset"
    assert (await create(api, dataset(), who="prov-a")).status == 403  # users' data, not providers'


async def test_quotes_carry_a_data_transfer_line_only_for_sites_without_a_replica(api, db) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    assert (await create(api, dataset("at-ams", 50, {"ams-1": "s3://ams/"}))).status == 201
    assert (await create(api, dataset("at-fra", 50, {"fra-1": "s3://fra/"}))).status == 201
    one_site = {"gpus": {"min": 1, "max": 8}, "placement": {"sites": ["fra-1"]}}
    resp = await submit(api, job("moved", dataset="at-ams", **one_site))
    assert resp.status == 201, await resp.text()
    resp = await submit(api, job("local", dataset="at-fra", **one_site))
    assert resp.status == 201, await resp.text()
    resp = await submit(api, job("builtin", **one_site))  # dataset pystdlib: at every site
    assert resp.status == 201, await resp.text()
    for q in await quotes(api, "moved"):
        lines = transfer_lines(q)
        assert len(lines) == 1, q["price"]["lines"]
        # 50 GB from ams-1 over the fra-ams link (0.02 per GB), billed at the receiving cluster
        assert lines[0]["cluster"] == "fra-h100" and lines[0]["provider"] == "prov-a"
        assert Decimal(lines[0]["quantity"]) == 50 and Decimal(lines[0]["unitPrice"]) == Decimal("0.02")
        assert Decimal(lines[0]["amount"]) == Decimal("1.000000")
        assert Decimal(q["price"]["total"]) == sum(Decimal(x["amount"]) for x in q["price"]["lines"]).quantize(
            Decimal("0.01"), rounding="ROUND_HALF_UP")
    for name in ("local", "builtin"):
        assert all(not transfer_lines(q) for q in await quotes(api, name)), name
    async with db.session() as s:
        rows = {j.name: j for j in (await s.execute(select(JobRow))).scalars()}
        moved = (await s.execute(select(QuoteRow).where(QuoteRow.job_id == rows["alice/moved"].id,
                                                        QuoteRow.label == "balanced"))).scalar_one()
        local = (await s.execute(select(QuoteRow).where(QuoteRow.job_id == rows["alice/local"].id,
                                                        QuoteRow.label == "balanced"))).scalar_one()
    assert moved.placement == local.placement
    # 50 GB at the 10 Gbps link: 40 s more, and the GPUs held meanwhile
    assert moved.prediction["dataSeconds"] == 40.0 and local.prediction["dataSeconds"] == 0.0
    assert abs(moved.predicted_seconds - local.predicted_seconds - 40.0) < 1e-6
    assert moved.prediction["dataTransfer"] == {"fra-1": {"from": "ams-1", "gb": 50.0, "pricePerGB": "0.02",
                                                          "seconds": 40.0}}


async def test_copies_take_the_cheapest_path_or_the_stated_default(api) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    assert (await create(api, dataset("far", 10, {"ams-1": "s3://ams/"}))).status == 201
    resp = await submit(api, job("via-fra", dataset="far", gpus={"min": 1, "max": 8},
                                 placement={"sites": ["nyc-1"]}))
    assert resp.status == 201, await resp.text()
    for q in await quotes(api, "via-fra"):  # ams → fra → nyc: two hops of 0.02
        (line,) = transfer_lines(q)
        assert line["cluster"] == "nyc-h100" and Decimal(line["unitPrice"]) == Decimal("0.04")
    resp = await api.client.post("/api/v1/apply", headers=api.auth("admin"), json={"items": [
        {"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": "island"}, "spec": {"region": "eu-west"}}]})
    assert resp.status == 200, await resp.text()
    assert (await create(api, dataset("islanded", 10, {"island": "file:///srv/data"}))).status == 201
    resp = await submit(api, job("internet", dataset="islanded", gpus={"min": 1, "max": 8},
                                 placement={"sites": ["ams-1"]}))
    assert resp.status == 201, await resp.text()
    for q in await quotes(api, "internet"):  # no link from `island`: the stated default price
        (line,) = transfer_lines(q)
        assert Decimal(line["unitPrice"]) == DEFAULT_PRICE_PER_GB


async def test_residency_keeps_jobs_in_the_datasets_regions_or_refuses_naming_spec_dataset(api) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    assert (await create(api, dataset("us-only", 5, {"nyc-1": "s3://nyc/"}, regions=["us-east"]))).status == 201
    resp = await submit(api, job("resident", dataset="us-only", gpus={"min": 1, "max": 16}))
    assert resp.status == 201, await resp.text()
    for q in await quotes(api, "resident"):
        assert {p["site"] for p in q["placement"]} == {"nyc-1"}
        assert not transfer_lines(q)
    resp = await submit(api, job("eu-job", dataset="us-only", gpus={"min": 1}, placement={"regions": ["eu-west"]}))
    body = (await resp.json())["error"]  # the job asks for eu-west, its data may only be processed in us-east
    assert resp.status == 422 and body["field"] == "spec.dataset" and "us-east" in body["message"], body
    assert (await create(api, dataset("apac", 5, {"nyc-1": "s3://nyc/"}, regions=["ap-south"]))).status == 201
    resp = await submit(api, job("nowhere", dataset="apac", gpus={"min": 1}))
    body = (await resp.json())["error"]
    assert resp.status == 422 and body["field"] == "spec.dataset", body
    assert "ap-south" in body["message"] and "apac" in body["message"]
    resp = await submit(api, job("too-many", dataset="us-only", gpus={"min": 12}))  # nyc-1 has 8
    body = (await resp.json())["error"]
    assert resp.status == 422 and "us-only" in body["message"], body


async def test_an_unknown_dataset_is_refused_and_a_dry_run_resolves_it_too(api) -> None:  # type: ignore[no-untyped-def]
    await register_world(api)
    resp = await submit(api, job("typo", dataset="corpsu"))
    body = (await resp.json())["error"]
    assert resp.status == 422 and body["field"] == "spec.dataset" and "corpsu" in body["message"], body
    assert (await create(api, dataset("at-ams", 50, {"ams-1": "s3://ams/"}))).status == 201
    resp = await api.client.post("/api/v1/jobs?dryRun=true", headers=api.auth("alice"),
                                 json=job("dry", dataset="at-ams", gpus={"min": 1, "max": 8},
                                          placement={"sites": ["fra-1"]}))
    assert resp.status == 200, await resp.text()
    assert all(transfer_lines(q) for q in (await resp.json())["status"]["quotes"])


async def test_a_dataset_read_by_a_running_job_cannot_be_deleted(api) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    assert (await create(api, dataset("reads", 1, {"ams-1": "file:///data/ams"}))).status == 201
    resp = await api.client.post("/api/v1/jobs", json=_job("reader", dataset="reads"), headers=api.auth("alice"))
    assert resp.status == 201, await resp.text()
    # a draft (quoted, not accepted) does not hold it
    assert (await api.client.delete("/api/v1/datasets/reads", headers=api.auth("alice"))).status == 200
    assert (await create(api, dataset("reads", 1, {"ams-1": "file:///data/ams"}))).status == 201
    resp = await api.client.post("/api/v1/jobs/reader/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    resp = await api.client.delete("/api/v1/datasets/reads", headers=api.auth("alice"))
    assert resp.status == 409 and "reader" in (await resp.json())["error"]["message"], await resp.text()


async def _claim(api, db, name: str, provider: str) -> dict:  # type: ignore[no-untyped-def]
    resp = await api.client.post(f"/api/v1/jobs/{name}/accept", json={"quote": "cheapest"}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    reconciler = Reconciler(db, ReconcilerConfig(heartbeat_timeout=timedelta(seconds=60),
                                                 lease_ttl=timedelta(hours=1), claim_timeout=timedelta(hours=1)))
    await reconciler.reconcile_once()
    listed = await (await api.client.get("/api/v1/subtasks", headers=api.auth(provider))).json()
    (task,) = [t for t in listed["items"] if t["spec"]["job"] == f"alice/{name}"]
    resp = await api.client.post(f"/api/v1/subtasks/{task['metadata']['uid']}/claim", headers=api.auth(provider),
                                 json={"rendezvous": {"host": "127.0.0.1", "port": 29500}})
    assert resp.status == 200, await resp.text()
    return await resp.json()


async def test_the_contract_carries_the_sites_replica_or_the_nearest_ones_uri(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)  # the demo world: fra-1, ams-1 (alpha-cloud), nyc-1 (beta-dc); one CPU slot each
    assert (await create(api, dataset("here", 1, {"ams-1": "file:///data/ams", "nyc-1": "s3://nyc/"}))).status == 201
    assert (await create(api, dataset("there", 1, {"fra-1": "file:///data/fra"}))).status == 201
    for name, data, site in (("at-home", "here", "ams-1"), ("away", "there", "nyc-1")):
        resp = await api.client.post("/api/v1/jobs", headers=api.auth("alice"),
                                     json=_job(name, dataset=data, placement={"sites": [site]}))
        assert resp.status == 201, await resp.text()
    home = await _claim(api, db, "at-home", "prov-a")
    assert home["data"] == {"dataset": "here", "uri": "file:///data/ams", "format": "jsonl", "vocab": None}
    away = await _claim(api, db, "away", "prov-b")
    assert away["data"] == {"dataset": "there", "uri": "file:///data/fra", "format": "jsonl", "vocab": None}  # fra-1's
    resp = await api.client.post("/api/v1/jobs", headers=api.auth("alice"), json=_job("plain", placement={"sites": ["fra-1"]}))
    assert resp.status == 201, await resp.text()
    assert (await _claim(api, db, "plain", "prov-a"))["data"] is None  # the built-in corpus: nothing to point at


async def test_the_contract_tells_a_site_its_token_datasets_format_and_vocabulary(api, db) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    tokens = dataset("toks", 1, {"fra-1": "file:///data/toks.bin"}, format="tokens", vocab=4096)
    assert (await create(api, tokens)).status == 201
    resp = await api.client.post("/api/v1/jobs", headers=api.auth("alice"),
                                 json=_job("on-tokens", dataset="toks", placement={"sites": ["fra-1"]}))
    assert resp.status == 201, await resp.text()
    claimed = await _claim(api, db, "on-tokens", "prov-a")
    assert claimed["data"] == {"dataset": "toks", "uri": "file:///data/toks.bin", "format": "tokens", "vocab": 4096}


async def test_the_invoice_carries_the_data_transfer_line_once_when_the_sites_workers_run(api, db) -> None:  # type: ignore[no-untyped-def]
    from tests.api.test_money import _invoice, _report
    from tests.layers.orchestration.test_reconciler import _accept, _reconciler

    await _world(api)
    assert (await create(api, dataset("far", 3, {"ams-1": "file:///data/ams"}))).status == 201
    await _accept(api, "billed", strategy="ddp", dataset="far", placement={"sites": ["fra-1"]})
    await _reconciler(db, 3600).reconcile_once()
    async with db.session() as s:
        t = (await s.execute(select(SubtaskRow).where(SubtaskRow.job == "alice/billed"))).scalar_one()
        t.phase = t.reported = "Running"
        t.launched_at = datetime.now(UTC) - timedelta(seconds=60)  # the 14 s reported fit in what the server saw
        job_row = (await s.execute(select(JobRow).where(JobRow.name == "alice/billed"))).scalar_one()
        job_row.phase = "Running"
        (quoted,) = [x for x in job_row.status["quoteLines"] if x["item"] == "data-transfer"]
    assert not (await _invoice(api, "billed"))["lines"]  # nothing ran yet: nothing moved, nothing billed
    for seconds in (5.0, 9.0, 14.0):
        await _report(db, "billed", t, seconds)
    inv = await _invoice(api, "billed")
    (line,) = [x for x in inv["lines"] if x["item"] == "data-transfer"]
    assert line["cluster"] == "fra-1-cpu" and line["provider"] == "prov-a"
    # 3 GB over the demo's fra-ams link at 0.02 per GB, as quoted, once for all three reports
    money = [Decimal(line[k]) for k in ("quantity", "unitPrice", "amount")]
    assert money == [Decimal(3), Decimal("0.02"), Decimal("0.06")]
    assert [Decimal(quoted[k]) for k in ("quantity", "unitPrice", "amount")] == money
    gpu = [x for x in inv["lines"] if x["item"] == "gpu-hours"]
    assert len(gpu) == 1 and Decimal(gpu[0]["quantity"]) == (Decimal(14) / 3600).quantize(Decimal("0.000001"))
    async with db.session() as s:
        entries = list((await s.execute(select(LedgerEntry).where(LedgerEntry.job == "alice/billed",
                                                                  LedgerEntry.item == "data-transfer"))).scalars())
    assert len(entries) == 1


async def test_a_job_re_placed_after_a_site_failure_stays_inside_its_datasets_regions(api, db) -> None:  # type: ignore[no-untyped-def]
    import pytest

    from cpn.core.errors import Infeasible
    from layers.orchestration.lifecycle.replan import replace_placement
    from tests.layers.orchestration.test_reconciler import _accept

    await _world(api)  # nyc-1 (us-east) is the cheapest slot; fra-1 and ams-1 are in the EU
    eu = {"fra-1": "file:///data/fra"}
    assert (await create(api, dataset("eu-data", 1, eu, regions=["eu-central", "eu-west"]))).status == 201
    await _accept(api, "resident", dataset="eu-data", placement={"sites": ["fra-1"]})
    limits = {"heartbeat_timeout": timedelta(seconds=60), "lease_ttl": timedelta(hours=1)}
    async with db.session() as s:
        job_row = (await s.execute(select(JobRow).where(JobRow.name == "alice/resident"))).scalar_one()
        job_row.spec = {**job_row.spec, "placement": {}}  # the user's own pin aside: only residency holds it
        placed = await replace_placement(s, job_row, {"fra-1"}, **limits)
        assert [p["site"] for p in placed] == ["ams-1"]
        with pytest.raises(Infeasible) as err:
            await replace_placement(s, job_row, {"fra-1", "ams-1"}, **limits)
        assert err.value.field == "spec.dataset"


async def test_the_byo_text_dataset_example_applies_and_is_priced_in_its_regions(api) -> None:  # type: ignore[no-untyped-def]
    from pathlib import Path

    import yaml

    from cpn.core.manifest import ManifestLoader
    from cpn.runtime.bundle import pack
    from tests.api.test_bundles import put

    await _world(api)  # the demo world the example is written for
    root = Path(__file__).parents[2] / "examples" / "byo-text"
    docs = list(yaml.load_all((root / "with-dataset.yaml").read_text(), Loader=ManifestLoader))
    data, digest = pack(root, 1 << 26)
    assert (await put(api, data)).status in (200, 201)
    code = docs[1]["spec"]["code"]
    code.pop("path")
    code["digest"] = digest
    resp = await api.client.post("/api/v1/apply", json={"items": docs}, headers=api.auth("alice"))
    assert resp.status == 200, await resp.text()
    assert [(i["kind"], i["action"]) for i in (await resp.json())["items"]] == [("Dataset", "created"),
                                                                               ("TrainingJob", "created")]
    for q in await quotes(api, "byo-text-eu"):
        assert {p["site"] for p in q["placement"]} == {"fra-1", "ams-1"}  # nyc-1 is outside the regions
        (line,) = transfer_lines(q)  # ams-1's copy of the corpus, over the fra-ams link
        assert line["cluster"] == "ams-1-cpu" and Decimal(line["quantity"]) == Decimal("0.00012")
