"""`cpn.train`'s implementation: :func:`init` → :class:`Job` → :meth:`Job.wrap` → :class:`Trainer`.

A worker started by a site's job runner (or by ``cpn train``'s launcher, or any torchrun-compatible
launcher) finds its rank, the job's topology and its :class:`~cpn.runtime.config.TrainConfig` in its
environment (:func:`cpn.runtime.contract.worker_env`); the user's ``spec.code.args`` come as JSON in
``CPN_CODE_ARGS`` and the site's dataset URI in ``CPN_DATA_URI``.

The budget: the job trains exactly ``budget.units``: ``budget.steps`` optimiser steps of
``budget.per_step`` units over all ranks, the last one trimmed to ``budget.last_step`` (what is left).
``trainer.units`` is this rank's share of the current step: size the batch by it, so the job trains
what it was asked, never more. Every rank stops at the same step (the strategy decides it, so the
synchronous strategies never leave a rank waiting in a collective). ``trainer.step(loss, tokens=n)``
counts ``n`` units (tokens, samples, whatever the budget counts) in this rank's metrics.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from cpn.runtime import checkpoint, faults
from cpn.runtime.autotune import resolve
from cpn.runtime.config import ENV_CHECKPOINT_DIR, ENV_RUN_DIR, FINAL_MODEL, PS_STRATEGIES, TrainConfig
from cpn.runtime.contract import ENV
from cpn.runtime.device import select_device, synchronize
from cpn.runtime.groups import Groups, init_groups
from cpn.runtime.metrics import Recorder, default_sinks, gather_finals, summarize, write_summary
from cpn.runtime.strategies import Context, Strategy, build_strategy
from cpn.runtime.strategies.base import flat_params, load_flat
from cpn.runtime.strategies.pipeline import feeder_shard

__all__ = ["FINAL_MODEL", "Budget", "Job", "Trainer", "init"]

T = TypeVar("T")
_JOB: Job | None = None


@dataclass(frozen=True)
class Budget:
    """What the job may spend: ``units`` in all (tokens, samples …), ``per_step`` of them per global
    step over all ranks, so ``steps`` optimiser steps, the last of ``last_step`` units (the rest)."""

    units: int
    per_step: int
    steps: int
    last_step: int = 0


class Job:
    """This worker's view of the job. Made once per process by :func:`init`."""

    def __init__(self, cfg: TrainConfig, groups: Groups, *, config: dict[str, Any], bound_at: float,
                 checkpoint_dir: Path | None, run_dir: Path | None, data_uri: str | None):
        self._cfg, self._groups, self._bound_at = cfg, groups, bound_at
        self.config: dict[str, Any] = config
        """The user's own ``spec.code.args`` (a free JSON object)."""
        self.checkpoint_dir = checkpoint_dir
        self.run_dir = run_dir
        self.data_uri = data_uri
        """Where this site's replica of ``spec.dataset`` lives (None when the job names none)."""
        self.budget = Budget(units=cfg.tokens, per_step=cfg.global_batch_tokens, steps=cfg.total_steps,
                             last_step=cfg.step_tokens(cfg.total_steps - 1))
        self._trainer: Trainer | None = None

    @property
    def rank(self) -> int:
        return self._groups.rank

    @property
    def world_size(self) -> int:
        return self._groups.world_size

    @property
    def local_rank(self) -> int:
        return self._groups.local_rank

    @property
    def site(self) -> int:
        """This worker's site, 0 .. num_sites - 1 (sites in ring order)."""
        return self._groups.site

    @property
    def site_name(self) -> str:
        """This worker's site by name, as the job's placement and the catalogue call it (``fra-1``)."""
        return self._groups.topology.sites[self.site].name

    @property
    def num_sites(self) -> int:
        return self._groups.S

    @property
    def strategy(self) -> str:
        """The job's strategy: ddp, hierarchical, local_sgd, diloco, gossip, ssp, async_ps, ps_sync or ps_backup."""
        return self._cfg.strategy.name

    @property
    def device(self) -> torch.device:
        return self._groups.device

    @property
    def seed(self) -> int:
        return self._cfg.seed

    def shard(self, dataset: Sequence[T]) -> Sequence[T]:
        """This worker's contiguous part of any sized dataset (a list of files, a torch ``Dataset``,
        an array …): ranks take consecutive, disjoint slices that together cover it."""
        n = len(dataset)
        index, count = self._feeder()
        lo, hi = index * n // count, (index + 1) * n // count
        if hi <= lo:
            raise ValueError(f"a dataset of {n} items leaves rank {self.rank} of {self.world_size} without any: "
                             "use a larger dataset or fewer workers")
        if isinstance(dataset, list | tuple | range | str | bytes):
            return dataset[lo:hi]
        if isinstance(dataset, torch.utils.data.Dataset):
            return torch.utils.data.Subset(dataset, range(lo, hi))  # type: ignore[return-value]
        try:
            return dataset[lo:hi]  # type: ignore[index,return-value]  # numpy arrays, tensors
        except TypeError:
            return _Slice(dataset, lo, hi)

    def _feeder(self) -> tuple[int, int]:
        """Which of how many data shards this rank reads: its rank of the world, or under the pipeline
        its first-stage place (:func:`~cpn.runtime.strategies.pipeline.feeder_shard`)."""
        if self._cfg.strategy.name != "pipeline":
            return self.rank, self.world_size
        return feeder_shard(self._cfg, self._groups.topology, self.site, self.local_rank)

    def wrap(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
             lr_schedule: bool | None = None, broadcast: bool = True,
             loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
             stages: Sequence[int] | None = None) -> Trainer:
        """Apply the job's strategy to ``model`` (moved to :attr:`device`) and ``optimizer``.

        Every rank starts from rank 0's parameters (as torch DDP does; ``broadcast=False`` skips that
        when every rank builds the same model from :attr:`seed`). ``optimizer=None`` uses the
        runtime's (AdamW at ``spec`` lr); ``lr_schedule`` (default: only then) drives the
        optimiser's learning rate along CPN's warm-up + cosine schedule. The parameter-server strategies
        (``async_ps``, ``ps_sync``, ``ps_backup``) keep their own optimiser at the servers (AdamW at
        ``spec`` lr): there ``optimizer`` is not used.

        Under the ``pipeline`` strategy ``model`` is an ``nn.Sequential`` whose children are cut into
        the job's stages, one per site (by parameter count, or starting at the child indices
        ``stages``: e.g. ``[4]`` puts children 0-3 in stage 0 and the rest in stage 1); every rank
        builds the whole model and trains its stage. ``loss_fn(outputs, targets)`` (a mean over the
        rows) is computed at the last stage; the loop passes each step's rows with
        ``trainer.step(inputs=x, targets=y)`` on the ranks where :attr:`Trainer.feeds` is true."""
        if self._trainer is not None:
            raise RuntimeError("job.wrap() was called already: one model per job")
        self._trainer = Trainer(self, model, optimizer, broadcast=broadcast,
                                lr_schedule=optimizer is None if lr_schedule is None else lr_schedule,
                                loss_fn=loss_fn, stages=list(stages) if stages is not None else None)
        return self._trainer

    def close(self) -> dict[str, Any] | None:
        """End the job in this process: the job runner calls it after the entry point returns (call
        it yourself only under another launcher). Finishes a trainer the loop left early, closes the
        metrics stream and, on rank 0 with a run directory, writes the run summary (returned)."""
        return self._trainer._close() if self._trainer is not None else None


class _Slice(Sequence):  # type: ignore[type-arg]
    def __init__(self, data: Any, lo: int, hi: int):
        self.data, self.lo, self.hi = data, lo, hi

    def __len__(self) -> int:
        return self.hi - self.lo

    def __getitem__(self, i: int) -> Any:  # type: ignore[override]
        if not -len(self) <= i < len(self):
            raise IndexError(i)
        return self.data[self.lo + (i % len(self))]


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p[:1].upper() + p[1:] for p in rest)


_METRIC_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,62}$")
_RESERVED = {"rank", "site", "step", "tokens", "final", "jobTokens", "wallSeconds", "gpuSeconds", "wanBytes",
             "intraBytes", "computeSeconds", "commSeconds", "waitSeconds", "tokensPerSecond"}


class Trainer:
    """Runs the job's strategy around the user's model and optimiser. Made by :meth:`Job.wrap`."""

    def __init__(self, job: Job, model: nn.Module, optimizer: torch.optim.Optimizer | None, *, lr_schedule: bool,
                 broadcast: bool = True, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
                 stages: list[int] | None = None):
        cfg, groups = job._cfg, job._groups
        model.to(job.device)
        if broadcast and not cfg.resume:
            _broadcast_from_rank0(model, groups)
        shares = cfg.shares(groups.world_size)
        self.job, self.model = job, model
        self.ctx = Context(cfg=cfg, groups=groups, store=dist.distributed_c10d._get_default_store(), model=model,
                           sampler=None, micro_batch=shares[groups.rank], shares=shares,  # type: ignore[arg-type]
                           checkpoint_dir=job.checkpoint_dir, bound_at=job._bound_at, loss_fn=loss_fn, cuts=stages)
        self.strategy: Strategy = build_strategy(self.ctx)
        if optimizer is not None and self.strategy.name not in PS_STRATEGIES:
            self.strategy.opt = optimizer  # the strategy syncs; the user's optimiser steps
        self.optimizer = self.strategy.opt
        self.lr_schedule = lr_schedule
        if job.checkpoint_dir is not None and groups.rank == 0:  # what `cpn train --resume DIR` restarts from
            checkpoint.atomic_write_json(cfg.model_dump(), job.checkpoint_dir / "config.json")
            checkpoint.atomic_write_json(groups.topology.model_dump(), job.checkpoint_dir / "topology.json")
        if cfg.resume and self.strategy.sharded:  # a DCP checkpoint, resharded onto this run's ranks
            loaded = checkpoint.load_sharded(cfg.resume, self.strategy.sharded_template, group=groups.world)
            if loaded is None:
                raise FileNotFoundError(f"no checkpoint under {cfg.resume}: check --resume (it needs a latest.json)")
            self.strategy.load_sharded_state(loaded[1])
            self.strategy.start_step = loaded[0]
        elif cfg.resume:
            restored = checkpoint.load(cfg.resume, groups.site, self.strategy.shares_state_with)
            if restored is None:
                raise FileNotFoundError(f"no checkpoint under {cfg.resume}: check --resume (it needs a latest.json)")
            step, site_state, global_state = restored
            self.strategy.load_state(site_state, global_state)
            self.strategy.start_step = step
        self._step = self.strategy.start_step
        self._units = 0
        self.recorder = Recorder(rank=groups.rank, site=groups.site, device_since=job._bound_at,
                                 sinks=default_sinks(groups.rank, str(job.run_dir) if job.run_dir else None))
        self._done = False
        self._finished = False
        self._commits: list[checkpoint.PendingCommit] = []
        self._closed = False
        self._final: dict[str, Any] = {}
        self._begin_step()
        self._since = time.perf_counter()

    # ------------------------------------------------------------------ the loop
    @property
    def steps(self) -> int:
        """Optimiser steps taken (including those before a resume)."""
        return self._step

    @property
    def done(self) -> bool:
        """True once the job's budget is spent: stop calling :meth:`step`."""
        return self._done

    @property
    def units(self) -> int:
        """This rank's units (tokens, samples …) in the current step: its share of ``budget.per_step``,
        less in the trimmed last step. A rank's gradient counts by its units, so a rank with 0 units in
        that step still calls :meth:`step` (with no loss, or any loss: it gets weight 0)."""
        return self.ctx.step_tokens

    @property
    def progress(self) -> float:
        """The job-wide fraction of the budget spent, 0 .. 1."""
        return min(1.0, float(self.strategy.progress))

    @property
    def pipelined(self) -> bool:
        """True when the job's strategy runs the forward and backward passes itself (``pipeline``: the
        model is cut into stages at different sites): call :meth:`step` without a loss."""
        return self.strategy.owns_forward_backward

    @property
    def feeds(self) -> bool:
        """Whether this rank's loop must pass data to :meth:`step`: every rank, except under a pipeline
        of the user's model, where only the first stage's ranks do (``inputs=``, ``targets=``)."""
        return not self.pipelined or self.strategy.takes_inputs

    def step(self, loss: torch.Tensor | None = None, tokens: int = 0, *, inputs: torch.Tensor | None = None,
             targets: torch.Tensor | None = None) -> None:
        """Backward, the strategy's synchronisation, the optimiser step; count ``tokens`` units.

        ``loss=None``: this rank has no units in the step (or the strategy is :attr:`pipelined`).
        A pipeline of the user's model takes the step's rows instead of a loss: ``inputs`` (fed to the
        first stage) and ``targets`` (for ``loss_fn`` at the last), on the ranks that :attr:`feeds`
        (others may pass them too: they are not used)."""
        if self._done:
            raise RuntimeError(f"the job's budget is spent ({self._step} steps): stop when trainer.done")
        ctx = self.ctx
        if self.pipelined:
            if loss is not None:
                raise ValueError("the pipeline strategy runs the forward and backward passes itself: "
                                 "call trainer.step() without a loss (a model of yours: inputs=..., targets=...)")
            if self.strategy.takes_inputs:
                self.strategy.feed = (inputs, targets)
            value = self.strategy.forward_backward(self._step)
        elif loss is not None:
            weight = self.strategy.loss_weight()  # 1, but on a sharded model (its site averages in backward)
            (loss if weight == 1.0 else loss * weight).backward()
            value = float(loss.detach().item())
        else:
            value = None
        synchronize(ctx.device)
        compute = time.perf_counter() - self._since  # data + forward + backward since the last step
        busy = compute + faults.slow_down(ctx.cfg.faults, ctx.site, compute)
        ctx.timers.add("compute", busy)
        ctx.busy_seconds += busy
        ctx.sequences_done += ctx.micro_batch
        self.strategy.after_backward(self._step)
        if self.strategy.may_idle and ctx.cfg.strategy.balance:  # its balance windows time the steps (idle.py)
            ctx.step_walls.append(time.perf_counter() - self._since)
        self._step += 1
        self._units += int(tokens)
        self.strategy.rebalance(self._step)
        self._emit(train_loss=value)
        self._poll_commits()
        if self.strategy.checkpoint_due(self._step):
            self._checkpoint()
        if self.strategy.should_stop(self._step):
            self._finish()
        else:
            self._begin_step()
        self._since = time.perf_counter()

    def gather(self) -> None:
        """Under the pipeline, bring every stage's current parameters to rank 0, whose model is then the
        whole trained model (call it on every rank, e.g. before rank 0 evaluates; the run's end and the
        final weights do it themselves). Other strategies hold the whole model on every rank: no-op."""
        self.strategy.gather(self._step)

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """``with trainer.evaluating(): ...`` — time spent inside (an evaluation, a log) is not
        counted as this rank's training speed, which the balanced strategies split the batch by."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - t0
            self.ctx.timers.add("compute", spent)
            self._since += spent

    def report(self, **metrics: float | int | None) -> None:
        """Add your own metrics to the job's stream: ``trainer.report(val_loss=1.9, accuracy=0.7)``
        appears as ``valLoss`` and ``accuracy`` in ``GET /api/v1/jobs/{name}/metrics`` and the portal.
        Reported after the budget is spent, they also enter the run's final figures."""
        extra: dict[str, float | None] = {}
        val = None
        for name, value in metrics.items():
            if not _METRIC_RE.match(name):
                raise ValueError(f"metric name {name!r} is not valid: letters, digits and _ (start with a letter)")
            key = _camel(name)
            if key in _RESERVED or key == "trainLoss":
                raise ValueError(f"metric {name!r} is CPN's own: pick another name")
            number = None if value is None else float(value)
            if key == "valLoss":
                val = number
            else:
                extra[key] = number
        report = self._emit(train_loss=None, val_loss=val, **extra)
        if self._finished:  # part of the run's final figures (e.g. the final model's val_loss); the
            # stream keeps one `final` report per rank, this one follows it
            self._final = {**self._final, **{k: v for k, v in report.items() if v is not None}, "final": True}
            self.recorder.flush()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """This site's model, optimiser and strategy state plus the job-wide state (what resume loads)."""
        return {"step": self._step, "site": self.strategy.site_state(), "global": self.strategy.global_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.strategy.load_state(state.get("site"), state.get("global", {}))
        self.strategy.start_step = self._step = int(state.get("step", 0))
        self._done = self.strategy.should_stop(self._step)

    # ------------------------------------------------------------------ internals
    def _begin_step(self) -> None:
        if faults.should_kill(self.ctx.cfg.faults, self.ctx.site, self._step):
            faults.die([self.recorder.close])
        self.strategy.before_step(self._step)
        self.strategy.plan_step(self._step)
        saved = [g.get("lr") for g in self.strategy.opt.param_groups]
        self.strategy.set_lr(self._step)  # also moves the strategy's progress
        if not self.lr_schedule:
            for group, lr in zip(self.strategy.opt.param_groups, saved, strict=True):
                group["lr"] = lr

    def _job_units(self) -> int:
        return int(self.strategy.progress * self.ctx.cfg.tokens)

    def _emit(self, *, train_loss: float | None, val_loss: float | None = None, final: bool = False,
              **extra: Any) -> dict[str, Any]:
        return self.recorder.report(step=self._step, tokens=self._units, timers=self.ctx.timers, train_loss=train_loss,
                                    val_loss=val_loss, final=final, jobTokens=self._job_units(), **extra)

    def _checkpoint(self) -> None:
        ctx = self.ctx
        if self.strategy.sharded:
            checkpoint.save_sharded(ctx.checkpoint_dir, self._step, self.strategy.sharded_state(),  # type: ignore[arg-type]
                                    group=ctx.groups.world, is_rank0=ctx.rank == 0, sites=self.strategy.live_sites())
            return
        commit = checkpoint.save(ctx.checkpoint_dir, self._step, site=ctx.site, is_leader=ctx.is_leader,  # type: ignore[arg-type]
                                 is_rank0=ctx.rank == 0, site_state=self.strategy.site_state(),
                                 global_state=self.strategy.global_state() if ctx.rank == 0 else {},
                                 store=ctx.store, live_sites=self.strategy.live_sites())
        if commit is not None:
            self._commits.append(commit)
            self._poll_commits()

    def _poll_commits(self, *, wait: bool = False) -> None:
        """Rank 0: write the newest due checkpoint's ``latest.json`` (older pending ones are superseded)."""
        checkpoint.poll_commits(self._commits, self.ctx.store, wait=wait)

    def _finish(self) -> None:
        if self._finished:
            return
        self._finished = self._done = True
        cfg = self.ctx.cfg
        self.strategy.finish(self._step)
        self._poll_commits(wait=True)
        if not self.strategy.global_budget:
            self.strategy.progress = cfg.tokens_through(self._step) / cfg.tokens
        self._final = self._emit(train_loss=None, final=True)
        self.recorder.flush()  # kept open: the user may still report (e.g. a last val_loss)
        if self.strategy.sharded and self.ctx.site == 0 and self.job.run_dir is not None:
            weights = checkpoint.full_model_state(self.model)  # gathered over site 0, to rank 0
            if self.ctx.rank == 0:
                checkpoint.atomic_save(weights, self.job.run_dir / FINAL_MODEL)
        elif self.ctx.rank == 0 and self.job.run_dir is not None:
            checkpoint.atomic_save(self.model.state_dict(), self.job.run_dir / FINAL_MODEL)

    def _publish_final(self) -> None:
        """This rank's final figures on the job's store, where rank 0 sums the run up. Only at
        :meth:`_close`, which every rank reaches and rank 0 outlives (it waits for the others' figures):
        a rank that wrote after rank 0 left would find the store gone."""
        try:
            self.ctx.store.set(f"cpn/final/{self.ctx.rank}", json.dumps(self._final))
        except Exception as exc:  # noqa: BLE001 - the run's summary is not worth a failed rank
            print(f"cpn.train: could not publish rank {self.ctx.rank}'s final figures: {exc}", flush=True)

    def _close(self) -> dict[str, Any] | None:
        if self._closed:
            return None
        self._closed = True
        if not self._finished:  # the loop stopped before the budget: end here (the summary says how far)
            self._finish()
        self.strategy.publish()
        self._final["wanBytes"] = self.ctx.timers.wan_bytes  # with what the loop's last validation moved
        self._publish_final()
        self.recorder.close()
        if self.ctx.rank != 0:
            return None
        return self._summary()

    def _summary(self) -> dict[str, Any]:
        ctx, run_dir = self.ctx, self.job.run_dir
        topo = ctx.groups.topology
        expected = [r for s in self.strategy.live_sites() for r in topo.ranks_of(s)]
        finals = gather_finals(ctx.store, expected, list(range(topo.world_size)),
                               timeout=max(60.0, ctx.cfg.strategy.wan_timeout_seconds))
        summary = summarize(finals, self.recorder.curve, strategy=ctx.cfg.strategy.name, model=ctx.cfg.model,
                            sites=topo.num_sites, world_size=topo.world_size, live_sites=self.strategy.live_sites(),
                            config=ctx.cfg.model_dump(), **self.strategy.summary_extras())
        if run_dir is not None:
            write_summary(run_dir, summary)
        return summary


@torch.no_grad()
def _broadcast_from_rank0(model: nn.Module, groups: Groups) -> None:
    """Every rank starts from rank 0's parameters and buffers (the user's init need not be seeded)."""
    if groups.world_size == 1:
        return
    flat = flat_params(model)
    dist.broadcast(flat, src=0, group=groups.world)
    load_flat(model, flat)
    for buf in model.buffers():
        dist.broadcast(buf, src=0, group=groups.world)


def close_job() -> dict[str, Any] | None:
    """:meth:`Job.close` of this process's job, if :func:`init` made one (what the job runner calls)."""
    return _JOB.close() if _JOB is not None else None


def init() -> Job:
    """This worker's :class:`Job`: reads the attempt contract from the environment, forms the
    process groups and the topology. Call it once per process, before building the model."""
    global _JOB
    if _JOB is not None:
        return _JOB
    cfg = TrainConfig.from_env()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    bound_at = time.perf_counter()
    device = select_device(cfg.device.kind)
    groups = init_groups(timeout=timedelta(seconds=max(600.0, 4 * cfg.strategy.wan_timeout_seconds)),
                         device=device, wan_backend=cfg.device.wan_backend)
    cfg = resolve(cfg, groups.topology)
    raw = os.environ.get(ENV.CODE_ARGS) or "{}"
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{ENV.CODE_ARGS} is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{ENV.CODE_ARGS} must be a JSON object (spec.code.args)")
    ckpt = cfg.checkpoint_dir or os.environ.get(ENV_CHECKPOINT_DIR)
    run_dir = os.environ.get(ENV_RUN_DIR)
    _JOB = Job(cfg, groups, config=config, bound_at=bound_at, checkpoint_dir=Path(ckpt) if ckpt else None,
               run_dir=Path(run_dir) if run_dir else None, data_uri=os.environ.get(ENV.DATA_URI) or None)
    return _JOB
