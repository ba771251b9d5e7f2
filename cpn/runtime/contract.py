"""The attempt contract: everything one sub-task of one job attempt needs, in one typed, versioned
document. The orchestration layer builds it once (at accept time it is validated, so a spec the
runtime would refuse is a 422, not a failed worker), the API ships it to the site agent that claims
the sub-task, the agent hands it to the site's driver, and the runtime reads it.

It never travels on a command line: the agent fetches it over the API and writes it to a file only
the agent's user can read (it carries the per-attempt worker token).

One function, :func:`worker_env`, turns it into a worker's torchrun-compatible environment; the
local job runner, the Kubernetes driver and ``cpn train``'s launcher all use it.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Annotated, Any, Literal
from urllib.parse import quote

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from cpn.runtime.config import ENV_CHECKPOINT_DIR, ENV_METRICS_TOKEN, ENV_RUN_DIR, TrainConfig
from cpn.runtime.topology import Topology

__all__ = ["CONTRACT_VERSION", "ENV", "AttemptSpec", "CodeRef", "DataRef", "Devices", "Endpoint", "torchrun_env",
           "worker_env"]

CONTRACT_VERSION = "cpn.attempt/v1"


class ENV:
    """Environment variable names the runtime reads, besides torchrun's own (one source)."""

    SITE_INDEX = "CPN_SITE_INDEX"
    JOB = "CPN_JOB"
    ATTEMPT = "CPN_ATTEMPT"
    METRICS_TOKEN = ENV_METRICS_TOKEN
    RUN_DIR = ENV_RUN_DIR
    CHECKPOINT_DIR = ENV_CHECKPOINT_DIR
    CODE_DIR = "CPN_CODE_DIR"  # the extracted bundle (workers import the entrypoint from it)
    CODE_ENTRYPOINT = "CPN_CODE_ENTRYPOINT"
    CODE_ARGS = "CPN_CODE_ARGS"  # spec.code.args as JSON: cpn.train's job.config
    DATA_URI = "CPN_DATA_URI"  # this site's replica of spec.dataset: cpn.train's job.data_uri
    DEVICES = "CPN_DEVICES"  # the kind of the devices the agent assigned: cuda (must be used) or slot (CPU)


def _not_bool(v: Any) -> Any:
    if isinstance(v, bool):
        raise ValueError(f"must be a whole number, got {str(v).lower()}")
    return v


# An integer of the agent protocol: `true` is refused (pydantic's lax mode reads it as 1), a whole
# float such as 6724.0 is taken (JSON Schema's `integer` allows it).
Integer = Annotated[int, BeforeValidator(_not_bool)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Endpoint(_Model):
    """Where the workers of one attempt meet (the TCP store of global rank 0)."""

    host: str = Field(min_length=1, max_length=253)
    port: Integer = Field(gt=0, lt=65536)


class CodeRef(_Model):
    """A user's code bundle in the server's blob store (fetched by the agent, verified by digest)."""

    digest: str = Field(pattern=r"^sha256:[0-9a-f]{64}$")
    entrypoint: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
    args: dict[str, Any] = Field(default_factory=dict)


class DataRef(_Model):
    """The job's dataset and where this site reads it (None: the site holds no replica)."""

    dataset: str
    uri: str | None = None
    format: str | None = Field(default=None, description="the Dataset's spec.format; 'tokens': the built-in model "
                                                           "trains on the token file at uri")
    vocab: int | None = Field(default=None, ge=2, description="format tokens: the number of token ids")


class Devices(_Model):
    """The devices the site's agent gave this sub-task, one per worker, disjoint from every other
    sub-task's it runs: ``cuda`` GPUs it enumerated (workers must use them), or declared ``slot``s."""

    kind: Literal["cuda", "slot"]
    ids: list[str] = Field(min_length=1)


class AttemptSpec(_Model):
    """One sub-task of one attempt. Ranks ``first_rank .. first_rank + workers - 1`` run here."""

    version: Literal["cpn.attempt/v1"] = CONTRACT_VERSION
    job: str
    job_uid: str | None = Field(default=None, description="the job's uid: a deleted job's name may be reused")
    attempt: int = Field(ge=0, description="1, 2, …; 0 is the job's profile run before quoting (spec.profile)")
    subtask: str
    cluster: str
    site_index: int = Field(ge=0)
    first_rank: int = Field(ge=0)
    workers: int = Field(ge=1)
    topology: Topology
    train: TrainConfig
    elastic: bool
    rendezvous: Endpoint | None = None
    server: str | None = Field(default=None, description="API base URL; the agent sets the one it dials")
    worker_token: str | None = Field(default=None, repr=False)
    code: CodeRef | None = None
    data: DataRef | None = None
    image: str | None = None
    devices: Devices | None = Field(default=None, description="set by a local agent at launch")
    env: dict[str, str] = Field(default_factory=dict,
                                description="the site's communication environment (NCCL_*, GLOO_*): its fabric")

    @model_validator(mode="after")
    def _check(self) -> AttemptSpec:
        if self.site_index >= self.topology.num_sites:
            raise ValueError(f"site_index {self.site_index} is outside the topology's {self.topology.num_sites} sites")
        if self.first_rank + self.workers > self.topology.world_size:
            raise ValueError(f"ranks {self.first_rank}..{self.first_rank + self.workers - 1} exceed world size "
                             f"{self.topology.world_size}")
        for rank in (self.first_rank, self.first_rank + self.workers - 1):
            if self.topology.site_of(rank) != self.site_index:
                raise ValueError(f"rank {rank} is not at site {self.site_index}")
        if self.devices is not None and len(self.devices.ids) != self.workers:
            raise ValueError(f"{len(self.devices.ids)} devices for {self.workers} workers")
        return self

    @property
    def ranks(self) -> range:
        return range(self.first_rank, self.first_rank + self.workers)

    @property
    def metrics_url(self) -> str | None:
        return f"{self.server.rstrip('/')}{self.job_path}/metrics" if self.server else None

    @property
    def job_path(self) -> str:
        """The job's API path; its name ("owner/name") is one quoted segment."""
        return f"/api/v1/jobs/{quote(self.job, safe='')}"

    @property
    def leads_rendezvous(self) -> bool:
        """The sub-task that holds global rank 0 serves the rendezvous; its agent advertises it."""
        return self.first_rank == 0


def torchrun_env(topology: Topology, rank: int, local_rank: int, local_world: int, master: str,
                 port: int) -> dict[str, str]:
    """The variables torchrun sets, plus the topology; what every CPN worker reads."""
    return {"RANK": str(rank), "WORLD_SIZE": str(topology.world_size), "LOCAL_RANK": str(local_rank),
            "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(topology.site_of(rank)),
            "MASTER_ADDR": master, "MASTER_PORT": str(port), **topology.to_env()}


def train_config(spec: AttemptSpec) -> TrainConfig:
    """The attempt's runtime config; a job without code on a ``format: tokens`` Dataset trains the built-in
    model on the site's replica of it, with the dataset's vocabulary."""
    data = spec.data
    if spec.code is not None or data is None or data.format != "tokens":
        return spec.train
    return TrainConfig.model_validate({**spec.train.model_dump(), "data": {"format": "tokens", "vocab": data.vocab,
                                                                          "path": data.uri}})


def worker_env(spec: AttemptSpec, rank: int, *, run_dir: str, checkpoint_dir: str,
               base: Mapping[str, str] | None = None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A worker's whole environment. The worker token is not in it: the runner relays metrics."""
    if spec.rendezvous is None:
        raise ValueError(f"attempt {spec.attempt} of {spec.job} has no rendezvous endpoint yet")
    if rank not in spec.ranks:
        raise ValueError(f"rank {rank} does not run in sub-task {spec.subtask} (ranks {spec.ranks})")
    env = {"OMP_NUM_THREADS": "1", **(os.environ if base is None else base), **spec.env, **(extra or {})}
    for secret in (ENV.METRICS_TOKEN, "CPN_TOKEN", "CPN_METRICS_URL"):
        env.pop(secret, None)
    env.update(torchrun_env(spec.topology, rank, rank - spec.first_rank, spec.workers, spec.rendezvous.host,
                            spec.rendezvous.port))
    env.update(train_config(spec).to_env())
    env.update({ENV.SITE_INDEX: str(spec.site_index), ENV.JOB: spec.job,
                ENV.ATTEMPT: str(spec.attempt), ENV.RUN_DIR: run_dir, ENV.CHECKPOINT_DIR: checkpoint_dir,
                "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
    if spec.code is not None:
        env.update({ENV.CODE_ENTRYPOINT: spec.code.entrypoint, ENV.CODE_ARGS: json.dumps(spec.code.args)})
    if spec.data is not None and spec.data.uri:
        env[ENV.DATA_URI] = spec.data.uri
    if spec.devices is not None:  # each worker binds cuda:LOCAL_RANK inside the sub-task's own set
        env.update({"CUDA_VISIBLE_DEVICES": ",".join(spec.devices.ids), ENV.DEVICES: spec.devices.kind})
    return env
