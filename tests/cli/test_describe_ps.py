"""`cpnctl describe job` of a parameter-server run shows what it runs with (issue 15): shards, copies
of each, and ps_backup's backup workers, from the attempt's TrainConfig (defaults applied); other
strategies show nothing of the kind."""

from __future__ import annotations

from cpn.cli.ctl import output
from layers.orchestration.lifecycle.plan import train_config
from layers.service.schemas import TrainingJobSpec


def _view(strategy: str, **knobs: int) -> dict:
    spec = TrainingJobSpec.model_validate({"model": "tiny", "tokens": 60_000, "strategy": strategy, **knobs})
    train = train_config(spec, strategy, workers=3, resume=None, sites=3)
    job = {"kind": "TrainingJob", "metadata": {"name": "lm"}, "spec": spec.wire(),
           "status": {"phase": "Running", "strategy": strategy, "train": train}}
    return output.job_view(job)["status"]


def test_parameter_servers_are_described_with_their_knobs() -> None:
    assert _view("ps_backup")["parameterServers"] == {"shards": 3, "replicasPerShard": 0, "backupWorkers": 1}
    assert _view("ps_backup", backupWorkers=2, psReplicas=1)["parameterServers"] == {
        "shards": 3, "replicasPerShard": 1, "backupWorkers": 2}
    assert _view("ps_sync", psReplicas=2)["parameterServers"] == {"shards": 3, "replicasPerShard": 2}
    assert "parameterServers" not in _view("diloco")


def test_describe_prints_them() -> None:
    spec = TrainingJobSpec.model_validate({"model": "tiny", "tokens": 60_000, "strategy": "ps_backup"})
    job = {"kind": "TrainingJob", "metadata": {"name": "lm"}, "spec": spec.wire(),
           "status": {"phase": "Running", "strategy": "ps_backup",
                      "train": train_config(spec, "ps_backup", workers=3, resume=None, sites=3)}}
    text = output.describe(job)
    assert "parameterServers:" in text and "backupWorkers: 1" in text and "shards: 3" in text, text
