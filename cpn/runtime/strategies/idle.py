"""Whether a synchronous job runs faster with its slowest ranks idle: measured, at most twice per job.

Throughput-proportional shares give a slow site a small share of each global batch. That share still
costs the step: the site's ranks must take part at all, and where sites share hardware (emulated sites
on one host, a site's other jobs on the same nodes) their compute slows the fast ranks down. Whether
the job is faster with the slowest class of ranks idle (no sequences; they still join each step's
all-reduce with weight 0, so their replicas stay in step and can take work again) is not something a
model can tell, so the balanced strategy tries it: after a window run on an uneven split, one window
with the slowest class idle; the idle split stands if the job's throughput (sequences per second of
training, evaluations excluded; the windows' median step) rose by at least :data:`IDLE_GAIN`, else
the ranks take their shares again. A trial costs (1 − gain) of its window. One that was not faster
but came within :data:`RETRY_ABOVE` is repeated once (:data:`IDLE_TRIES`): on a shared host one
window's rate moves by ±15 % with the neighbours' load, so a single window can say no by chance. On
separate hardware the gain is the working ranks' part of the throughput: a site half as fast as one
other measured 0.67-0.76 here (two emulated sites, a core each; 0.667 in theory), so it is tried
once, costs about a third of one window, and every site keeps working.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

# the idle split must make the job this much faster to stand. Measured on the straggler bench (three
# emulated sites on two vCPUs, site 2 twice as slow), by the windows' median step: 1.03-1.21x in nine
# runs of nine. By their mean (tried first) one run of ten measured 0.83x in a busy neighbour's window,
# and that whole run took 1.15x longer than the runs that kept the idle split.
IDLE_GAIN = 1.02
IDLE_TRIES = 2  # trials per job: one more after a trial that was not faster but came within RETRY_ABOVE
RETRY_ABOVE = 0.85


# what a run summary's ``idle_trial`` says, in words (the bench's "resolved to" column, ``cpn train``)
IDLE_WORDS = {"kept": ", slowest ranks idle (tried: faster)", "dropped": ", every rank works (idle tried: not faster)",
              "trying": ", slowest ranks idle on trial when the run ended"}


class TrialState(StrEnum):
    READY = "ready"  # not tried yet
    TRYING = "trying"  # the current window runs the slowest class idle
    KEPT = "kept"  # it was faster: those ranks stay idle
    DROPPED = "dropped"  # it was not (and not close, or tried IDLE_TRIES times): every rank works


@dataclass
class IdleTrial:
    state: TrialState = TrialState.READY
    idle: frozenset[int] = frozenset()
    speeds: dict[int, float] = field(default_factory=dict)  # the idle ranks' speeds when they last worked
    base_rate: float = 0.0  # the job's sequences per second in the window before the trial
    gain: float | None = None  # the last trial window's rate over ``base_rate``
    tries: int = 0
    uneven: bool = False  # the window that just ended ran an uneven split

    def speeds_with_idle(self, speeds: list[float]) -> list[float]:
        """``speeds`` as posted, with each idle rank's (0: it did no work) replaced by its last working speed."""
        return [self.speeds.get(r, s) if r in self.idle else s for r, s in enumerate(speeds)]

    def next_idle(self, classes: list[float], rate: float) -> frozenset[int]:
        """After a window at ``rate`` (sequences per second) with speed ``classes`` per rank (uneven):
        the ranks idle in the next window."""
        if rate <= 0:  # no step was timed: nothing to compare with
            return self.idle
        if self.state is TrialState.READY and self.uneven:
            slowest = min(classes)
            idle = frozenset(r for r, c in enumerate(classes) if c == slowest)
            if len(idle) < len(classes):
                self.state, self.base_rate, self.tries = TrialState.TRYING, rate, self.tries + 1
                self.speeds = {r: classes[r] for r in idle}
                self.idle = idle
        elif self.state is TrialState.TRYING:
            self.gain = rate / self.base_rate
            kept = self.gain >= IDLE_GAIN
            self.state = TrialState.KEPT if kept else self._after_no()
            self.idle = self.idle if kept else frozenset()
        return self.idle

    def _after_no(self) -> TrialState:
        again = self.tries < IDLE_TRIES and (self.gain or 0.0) >= RETRY_ABOVE
        return TrialState.READY if again else TrialState.DROPPED

    def stop(self) -> None:
        """Speeds became even (the fast ranks slowed to the idle ones' last speed): every rank works, and
        a later uneven window may try again while tries are left."""
        if self.state in (TrialState.TRYING, TrialState.KEPT):
            self.gain = None if self.state is TrialState.TRYING else self.gain  # that trial was not measured
            self.state = TrialState.READY if self.tries < IDLE_TRIES else TrialState.DROPPED
        self.idle = frozenset()


def shares_with_idle(total: int, classes: list[float], idle: frozenset[int],
                     split: Callable[[int, list[float]], list[int]]) -> list[int]:
    """``total`` sequences split by ``split(total, speeds)`` over the working ranks; idle ranks get 0."""
    working = [r for r in range(len(classes)) if r not in idle]
    part = split(total, [classes[r] for r in working])
    shares = [0] * len(classes)
    for r, n in zip(working, part, strict=True):
        shares[r] = n
    return shares
