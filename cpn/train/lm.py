"""CPN's built-in language model, trained through :mod:`cpn.train` like any user's code.

A job without ``spec.code`` runs this module (``python -m cpn.runtime.train`` calls :func:`main`):
the byte-level transformer of :mod:`cpn.runtime.model` on the built-in corpus. Its size, sequence
length, corpus and validation cadence come from the job's runtime config (where a user's module reads
``job.config``); everything else — the strategy around the optimiser, the budget, metrics,
checkpoints, resume, fault injection and the final weights — goes through :func:`cpn.train.init`,
:meth:`~cpn.train.Job.wrap` and :class:`~cpn.train.Trainer`. There is one training path: what the
benchmarks and the demo measure is what a user's module gets.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from cpn.runtime.config import TrainConfig
from cpn.runtime.data import ShardSampler, load_data, model_config, split_corpus, val_batches
from cpn.runtime.device import autocast
from cpn.runtime.model import build_model
from cpn.train.api import Job, Trainer, init

__all__ = ["evaluate", "main", "train"]


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list, precision: str = "fp32") -> float:
    """The mean loss over ``batches`` (NaN without any)."""
    if not batches:
        return float("nan")
    device = batches[0][0].device
    with autocast(device, precision):
        return sum(model.loss(x, y).item() for x, y in batches) / len(batches)


def step_loss(model: torch.nn.Module, sampler: ShardSampler, trainer: Trainer, device: torch.device) -> Tensor | None:
    """This rank's loss for the trainer's current step over its ``trainer.units`` tokens: whole
    sequences and, in a trimmed last step, maybe the front of one more; the mean over those tokens.
    None when the rank has none. The windows are the step's canonical ones (what ddp's equal shares
    read), dealt out by the ranks' shares, so balanced shares learn from the same data as ddp."""
    cfg: TrainConfig = trainer.ctx.cfg
    units = trainer.units
    full, tail = divmod(units, cfg.seq_len)
    if not full and not tail:
        return None
    x, y = (t.to(device, non_blocking=True) for t in sampler.windows(trainer.steps, *trainer.ctx.window_picks()))
    with autocast(device, cfg.device.precision):
        if not tail:
            return model.loss(x, y)
        parts = [(x[:full], y[:full], full * cfg.seq_len)] if full else []
        parts.append((x[full:, :tail], y[full:, :tail], tail))
        return sum(model.loss(a, b) * (n / units) for a, b, n in parts)  # type: ignore[return-value]


def train(job: Job) -> Trainer:
    """Build the model and data for this rank, train the job's budget, evaluate; returns the trainer."""
    cfg: TrainConfig = job._cfg  # noqa: SLF001 - the built-in model's settings (a user's come from job.config)
    device = job.device
    split = split_corpus(load_data(cfg))  # the byte corpus, or the job's token file
    sampler = ShardSampler(split.train, shard=job.rank, num_shards=job.world_size, seq_len=cfg.seq_len,
                           seed=cfg.seed, sampling=cfg.strategy.data_sampling)
    sharded = cfg.shard == "site"
    if sharded:  # FSDP2 over the site's ranks (cpn.runtime.sharding): site 0's ranks evaluate together
        from cpn.runtime.sharding import build_sharded

        model = build_sharded(cfg, job._groups)  # noqa: SLF001 - the built-in model's own runtime
    else:
        model = build_model(model_config(cfg), seed=cfg.seed, device=device)  # the same start on every rank: no broadcast
        if cfg.activation_checkpointing == "full":
            from cpn.runtime.sharding import apply_activation_checkpointing

            apply_activation_checkpointing(model)
    evaluates = job.rank == 0 or (sharded and job.site == 0)
    val = val_batches(split.val, seq_len=cfg.seq_len, batches=cfg.val_batches) if evaluates else []
    val = [(x.to(device), y.to(device)) for x, y in val]
    trainer = job.wrap(model, broadcast=False)

    def validate() -> None:
        if trainer.pipelined:  # through the stages, on every rank: no site holds the whole model
            with trainer.evaluating():
                loss = trainer.strategy.evaluate(val)
        elif evaluates:
            with trainer.evaluating():
                loss = evaluate(model, val, cfg.device.precision)
        if job.rank == 0:
            trainer.report(val_loss=loss)

    validate()
    while not trainer.done:
        if trainer.pipelined:  # the pipeline strategy feeds its stages itself
            trainer.step(tokens=trainer.units)
        else:
            loss = step_loss(model, sampler, trainer, device)
            if loss is None and sharded:  # no tokens this step: the site's backward still needs this rank (weight 0)
                loss = model.loss(*(torch.zeros((1, cfg.seq_len), dtype=torch.long, device=device),) * 2)
            trainer.step(loss, tokens=trainer.units)
        if trainer.steps % cfg.val_every == 0 and not trainer.done:
            validate()
    validate()  # the final (consensus) model
    return trainer


def main() -> dict[str, Any] | None:
    """One rank's whole life; rank 0 returns the run summary (also written to the run directory)."""
    job = init()
    train(job)
    return job.close()
