"""The public training API: bring your own model, optimiser and data; CPN brings the sites.

    import cpn.train

    def main() -> None:
        job = cpn.train.init()                       # the attempt contract: ranks, sites, budget, args
        model = MyModel(**job.config).to(job.device)
        trainer = job.wrap(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        for x, y in batches(job.shard(my_dataset)):
            loss = loss_fn(model(x.to(job.device)), y.to(job.device))
            trainer.step(loss, tokens=x.numel())     # backward + the job's strategy + optimiser step
            if trainer.done:                         # the job's budget is spent (same step on every rank)
                break
        trainer.report(val_loss=evaluate(model))     # your own metrics, shown as valLoss

Everything here is stable and typed; everything in :mod:`cpn.runtime` stays internal. The job's
strategy (ddp, hierarchical, local_sgd, diloco, gossip, ssp, async_ps, ps_sync, ps_backup, with their knobs and WAN
compression) is the one the job was quoted and accepted with: :meth:`Job.wrap` applies it to any
``torch.nn.Module`` through the same strategy classes the built-in LM trains with.
"""

from __future__ import annotations

from cpn.train.api import Budget, Job, Trainer, init

__all__ = ["Budget", "Job", "Trainer", "init"]
