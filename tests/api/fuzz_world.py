"""A seeded world for tests/api/test_fuzz.py: before schemathesis starts, the fuzzing principal (and, for a
plain user, a provider who owns the infrastructure users cannot create) populates a live `cpn serve`
through the public API, as real users would: under each of NAMES and SPARE a site, a heartbeating
cluster, a link, a Dataset and a TrainingJob (priced; NAMES[1]'s accepted, with its sub-tasks), and a
code bundle.

Schemathesis then draws path parameters from these names (`[dictionaries]` bound to `path.name`,
`path.sha256`, `path.uid` in a copy of schemathesis.toml: see `fuzz_config`), so operations on an
object reach the stored-object code, not only its 404. A spare object per kind is what DELETE draws,
so deleting does not empty the world the other operations read."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from cpn.runtime.bundle import pack
from layers.service.quotes import LABELS
from tests.api.test_datasets import dataset
from tests.api.test_jobs import job
from tests.api.test_resource import cluster, link, site
from tests.conftest import LiveServer

NAMES = ("fuzz", "fuzz-b")  # one object of every kind under each name (a site, cluster, link, dataset, job)
SPARE = "fuzz-spare"  # what DELETE operations draw (the kinds' spare objects), besides unknown names
HUB = "fuzz-hub"  # a site that is never drawn: it carries the spare cluster and links
PROBABILITY = 0.75  # how often a path parameter is a seeded value rather than a generated one
CLUSTER_GPUS = 8
# body fields that name an existing site or cluster (a create refers to the world): drawn from its objects
BODY_REFERENCES = ("body.spec.site", "body.spec.a", "body.spec.b", "body.spec.locations[*].site",
                   "body.items[*].cluster")


@dataclass
class World:
    names: list[str]  # path.name: the objects and the fuzzing account's own name
    spares: list[str]
    digests: list[str] = field(default_factory=list)  # path.sha256: the uploaded bundle
    uids: list[str] = field(default_factory=list)  # path.uid: the accepted job's sub-tasks


def _ok(resp: httpx.Response) -> dict:
    assert resp.is_success, f"seeding {resp.request.method} {resp.request.url}: {resp.status_code} {resp.text}"
    return resp.json() if resp.content else {}


def _infrastructure(http: httpx.Client) -> None:
    """Sites, clusters (with a heartbeat saying they are ready) and links. The spare site holds nothing
    (a site with clusters or links cannot be deleted): the spare cluster and link live at HUB."""
    items = [site(n, "eu-central") for n in (*NAMES, SPARE, HUB)]
    hosts = {NAMES[0]: NAMES[0], NAMES[1]: NAMES[1], SPARE: HUB}
    items += [cluster(n, at, gpus_per_node=CLUSTER_GPUS, nodes=1, price="1.50") for n, at in hosts.items()]
    items += [link(NAMES[0], NAMES[0], NAMES[1]), link(NAMES[1], NAMES[1], HUB), link(SPARE, HUB, NAMES[0])]
    _ok(http.post("/api/v1/apply", json={"items": items}))
    for name in hosts:
        _ok(http.post(f"/api/v1/clusters/{name}/heartbeat", json={
            "allocatableGpus": CLUSTER_GPUS, "conditions": [{"type": "Ready", "status": "True"}]}))


def _tenant_objects(http: httpx.Client, tmp: Path) -> tuple[str, list[str]]:
    """The fuzzing principal's own: datasets, a bundle, jobs (NAMES[0] priced, NAMES[1] accepted, SPARE
    priced). Returns the bundle's digest and the accepted job's sub-task uids."""
    for name in (*NAMES, SPARE):
        _ok(http.post("/api/v1/datasets", json=dataset(name, 1, {NAMES[0]: f"s3://{name}/data/"})))
    (tmp / "fuzz-code").mkdir(exist_ok=True)
    (tmp / "fuzz-code" / "train.py").write_text("def main():\n    pass\n")
    data, digest = pack(tmp / "fuzz-code", 1 << 20)
    hex_digest = digest.removeprefix("sha256:")
    _ok(http.put(f"/api/v1/bundles/{hex_digest}", content=data, headers={"Content-Type": "application/octet-stream"}))
    for name in (*NAMES, SPARE):
        _ok(http.post("/api/v1/jobs", json=job(name, gpus={"min": 4, "max": CLUSTER_GPUS}, strategy="ddp",
                                                     sites={"min": 1, "max": 1})))
    _ok(http.post(f"/api/v1/jobs/{NAMES[1]}/accept", json={"quote": "cheapest"}))
    return hex_digest, _subtasks(http, NAMES[1])


def _subtasks(http: httpx.Client, name: str, wait: float = 10) -> list[str]:
    """The job's sub-tasks once the server's reconciler has created them (none within `wait`: none)."""
    deadline = time.monotonic() + wait
    while True:
        items = _ok(http.get(f"/api/v1/jobs/{name}/subtasks"))["items"]
        if items or time.monotonic() > deadline:
            return [s["metadata"]["uid"] for s in items]
        time.sleep(0.5)


def seed(server: LiveServer, token: str, account: str, role: str, tmp: Path) -> World:
    """Populate the server for `account` (whose token is `token`); infrastructure is the account's own
    when its role may create it (admin), else a provider's."""
    owner = token if role in ("admin", "provider") else server.token(f"{account}-provider", "provider")
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {owner}"}) as http:
        _infrastructure(http)
    with httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": f"Bearer {token}"}) as http:
        digest, uids = _tenant_objects(http, tmp)
    return World(names=[*NAMES, account], spares=[SPARE], digests=[digest], uids=uids)


def fuzz_config(base: Path, world: World, out: Path) -> Path:
    """schemathesis.toml plus the world's names as dictionaries bound to the path parameters: every
    operation draws NAMES (or the account's name) for {name}, DELETE draws the spares; bodies that refer to
    a site or cluster draw the world's, an accept draws a quote label."""
    dictionaries = {"seeded-names": world.names, "seeded-spares": world.spares, "seeded-objects": [*NAMES, SPARE],
                    "seeded-first": [NAMES[0]],
                    "seeded-digests": world.digests, "seeded-uids": world.uids, "quote-labels": list(LABELS)}
    lines = [base.read_text(), "", "# appended by tests/api/fuzz_world.py: the seeded world's names"]
    lines += [f"[dictionaries.{key}]\nvalues = {json.dumps(values)}" for key, values in dictionaries.items() if values]
    bound = {"path.name": "seeded-names", "path.sha256": "seeded-digests", "path.uid": "seeded-uids",
             **dict.fromkeys(BODY_REFERENCES, "seeded-objects"), "body.quote": "quote-labels"}
    lines.append("[parameters]")
    lines += [_binding(param, key) for param, key in bound.items() if dictionaries[key]]
    lines += [_per_method("DELETE", {"path.name": "seeded-spares"}),
              # a PUT's metadata.name must be its URL's: both drawn from one name
              _per_method("PUT", {"path.name": "seeded-first", "body.metadata.name": "seeded-first"})]
    path = out / "schemathesis-seeded.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def _binding(param: str, dictionary: str) -> str:
    return f'"{param}" = {{ dictionary = "{dictionary}", probability = {PROBABILITY} }}'


def _per_method(method: str, bound: dict[str, str]) -> str:
    pairs = ", ".join(_binding(param, key) for param, key in bound.items())
    return f'[[operations]]\ninclude-method = "{method}"\nparameters = {{ {pairs} }}'
