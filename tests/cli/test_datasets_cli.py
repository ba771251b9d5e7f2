"""cpnctl and Datasets: applied from a file with the TrainingJob that reads it, listed by kind or short
name with their printer columns, a job without its size refused naming the field, deleted by name."""

from __future__ import annotations

import yaml

from tests.api.test_datasets import dataset
from tests.api.test_resource import WORLD_A


def test_cpnctl_applies_lists_and_deletes_datasets(live_server) -> None:  # type: ignore[no-untyped-def]
    prov, user = live_server.token("prov-a", "provider"), live_server.token("alice", "user")
    live_server.cpnctl("config", "set-context", "p", "--server", live_server.url, "--token", prov)
    live_server.cpnctl("config", "set-context", "u", "--server", live_server.url, "--token", user)
    assert live_server.cpnctl("--context", "p", "apply", "-f", "-", input=yaml.safe_dump_all(WORLD_A)).returncode == 0
    out = live_server.cpnctl("--context", "u", "apply", "-f", "-",
                             input=yaml.safe_dump_all([dataset("crawl", 12.5, {"fra-1": "s3://fra/crawl/"},
                                                               regions=["eu-central"])]))
    assert out.returncode == 0 and "dataset/crawl created" in out.stdout, out.stderr
    for name in ("datasets", "dataset", "ds"):
        table = live_server.cpnctl("--context", "u", "get", name).stdout.splitlines()
        assert table[0].split()[:6] == ["NAME", "SIZE", "GB", "FORMAT", "REPLICAS", "REGIONS"], table
        assert table[1].split()[:5] == ["crawl", "12.5", "jsonl", "1", "eu-central"], table
    job = {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "sizeless"},
           "spec": {"tokens": 1000, "code": {"entrypoint": "train:main", "digest": "sha256:" + "ab" * 32}}}
    out = live_server.cpnctl("--context", "u", "apply", "-f", "-", input=yaml.safe_dump(job))
    assert out.returncode == 1 and "spec.model.parameters" in out.stderr, out.stderr
    assert "CPN cannot price your code without knowing its size" in out.stderr
    out = live_server.cpnctl("--context", "u", "delete", "ds", "crawl")
    assert out.returncode == 0 and 'dataset "crawl" deleted' in out.stdout, out.stderr
    assert "crawl" not in live_server.cpnctl("--context", "u", "get", "datasets").stdout
