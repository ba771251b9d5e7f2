"""ps_backup past the WAN patience (issue 36, item 7): a shard whose step was decided elsewhere waits for
the decided pushes, which are in flight to it, instead of applying the ones that happened to be there --
under load that updated one shard with another set than the others (a split step after a fail-over)."""

from __future__ import annotations

import threading

import torch

from .test_ps_backup_consistent import push, servers, settle

PATIENCE = 0.3  # seconds: the WAN timeout of these shards


def test_a_shard_past_its_patience_still_applies_the_decided_set() -> None:
    """Shard 0 has workers 0 and 1 and applies {0, 1}; shard 1 has only worker 0's push when its patience
    runs out (worker 1's is late on the wire). It keeps waiting, applies {0, 1} once the push lands, and
    drops worker 2's -- it applied {0} before, with worker 0's gradient alone."""
    a, b = servers(2)
    a.patience = b.patience = PATIENCE
    threads = [push(a, 0, 1.0), push(a, 1, 3.0)]
    settle(a, 2)
    assert a.rounds == {0: [0, 1]}
    threads.append(push(b, 0, 1.0))
    settle(b, 1)
    threading.Event().wait(3 * PATIENCE)  # past shard 1's patience, worker 1's push still on its way
    with b.cond:
        assert b.version == 0 and b.accepted == (0, 1) and list(b.arrived) == [0], (b.rounds, b.arrived)
    threads += [push(b, 1, 3.0), push(b, 2, 100.0), push(a, 2, 100.0)]
    for t in threads:
        t.join(timeout=5)
        assert not t.is_alive()
    assert b.rounds == a.rounds == {0: [0, 1]}
    assert torch.equal(a.param.detach(), b.param.detach()) and a.param.item() == -2.0
    assert a.short == b.short == 0


def test_a_silent_step_is_still_applied_with_what_came_after_the_patience() -> None:
    """Liveness kept: when no shard has a quorum (the others are silent), the step is decided with this
    shard's arrivals once the patience is over, and every shard applies that set."""
    a, b = servers(2)
    a.patience = b.patience = PATIENCE
    first = push(a, 0, 1.0)
    first.join(timeout=5)
    assert not first.is_alive() and a.rounds == {0: [0]}  # applied alone after the patience
    late = [push(b, 1, 3.0), push(b, 0, 1.0)]  # shard 1 must apply {0} too, dropping worker 1's push
    for t in late:
        t.join(timeout=5)
        assert not t.is_alive()
    assert b.rounds == a.rounds == {0: [0]}
    assert torch.equal(a.param.detach(), b.param.detach())
