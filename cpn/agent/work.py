"""The agent's work loop: claim the sub-tasks placed on this cluster, launch them through the
cluster's driver, report their phase and exit codes, ship their output, stop them when told.

Two tasks share the state: a watcher long-polls `GET /api/v1/subtasks?cluster=NAME&watch=true` and
claims what is pending; a monitor polls the driver every second and reports. Restart-safe: on start
the driver's earlier launches are re-adopted (pid files for local runs, labels on Kubernetes), and a
claim is idempotent on the server, so nothing is launched twice.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

from cpn.agent.devices import DevicePool
from cpn.client import ApiError, Client
from cpn.core.phases import NOT_LAUNCHED, SUBTASK_DONE
from cpn.runtime.contract import AttemptSpec, Endpoint
from cpn.runtime.launcher import agent_port_range, free_port
from layers.resource.drivers.base import SiteDriver, SubtaskState

log = logging.getLogger("cpn.agent")

DONE = SUBTASK_DONE
REPORT_EVERY = 10.0  # seconds: a keep-alive report even when nothing changed
WATCH_SECONDS = 15
STOPPING_GRACE_SECONDS = 60.0  # a claim waits this long for devices that runs being stopped still hold
LAUNCH_FAILED = -1  # exit code reported when the driver could not start a sub-task: the site's fault


def advertise_address(server: str) -> str:
    """The address this machine uses to reach the server: what other sites can reach us at."""
    url = urlparse(server)
    host, port = url.hostname or "127.0.0.1", url.port or (443 if url.scheme == "https" else 80)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


@dataclass
class Run:
    uid: str
    spec: AttemptSpec
    handle: dict[str, Any]
    reported: SubtaskState | None = None
    reported_at: float = 0.0
    cursor: dict[str, Any] = field(default_factory=dict)
    stop_sent: bool = False


class WorkLoop:
    def __init__(self, server: str, token: str | None, cluster: str, driver: SiteDriver, *,
                 advertise: str | None = None, timeout: float = 30.0, devices: DevicePool | None = None):
        """`devices`: the site's devices, each launched sub-task given its own (local runs)."""
        self.server, self.cluster, self.driver = server.rstrip("/"), cluster, driver
        self.devices = devices
        self.advertise = advertise or advertise_address(server)
        self.watch_client = Client(server, token, timeout=WATCH_SECONDS + timeout)
        self.client = Client(server, token, timeout=timeout)
        self.runs: dict[str, Run] = {}
        self.desired: dict[str, str] = {}  # uid → Run | Stop, as last seen on the server
        self.version: str | None = None
        self.deferred = False
        self.refused: set[str] = set()  # sub-tasks whose launch failed here: reported, never retried
        self.waiting: dict[str, float] = {}  # sub-task → when its claim first waited for a stopping run's devices
        self.orphans: list[Run] = []  # runs of an earlier life the server no longer wants: stopped, awaited
        self.adopted = False

    def close(self) -> None:
        self.watch_client.close()
        self.client.close()

    async def _call(self, method: str, path: str, **kw: Any) -> Any:
        return await asyncio.to_thread(getattr(self.client, method), path, **kw)

    # ------------------------------------------------------------ start
    async def adopt(self) -> None:
        """Find the runs this agent launched before it was restarted, and keep reporting them."""
        if self.adopted:
            return
        found = await self.driver.adopt()
        if not found:
            self.adopted = True
            return
        items = (await self._call("get", "/api/v1/subtasks", cluster=self.cluster))["items"]
        # only what the server still expects to run: a finished run is never signalled again
        uids = {(i["spec"]["job"], i["spec"]["attempt"], i["metadata"]["name"]): i["metadata"]["uid"]
                for i in items if i["status"]["phase"] not in DONE}
        for spec, handle in found:
            if self.devices is not None:
                self.devices.restore(spec)  # held until the run has ended, adopted or orphaned
            uid = uids.get((spec.job, spec.attempt, spec.subtask))
            if uid is not None and uid not in self.runs:
                self.runs[uid] = Run(uid, spec, handle)
                log.info("re-adopted sub-task %s attempt %s (%s)", spec.subtask, spec.attempt, handle)
            elif uid is None:
                await self._orphan(Run("", spec, handle))
        self.adopted = True

    async def _orphan(self, run: Run) -> None:
        """A run the server no longer wants (its sub-task was declared Lost while this agent was away,
        or it finished): stopped if it still runs, its slots held until it has exited, then deleted."""
        state = await self.driver.poll(run.spec, run.handle)
        if state.phase in ("Launching", "Running"):
            await self.driver.cancel(run.spec, run.handle)
            log.warning("stopping sub-task %s attempt %s: it still ran here, but the server no longer wants it "
                        "(declared lost while this agent was away)", run.spec.subtask, run.spec.attempt)
            self.orphans.append(run)
        elif not await self._cleanup(run):
            self.orphans.append(run)  # its runner is still exiting: deleted on a later pass
        else:
            self._release(run.spec)  # it ended while this agent was away: its devices are free again

    def held_slots(self) -> int:
        """Slots taken by orphans that are still stopping: the site must not offer them."""
        return sum(run.spec.workers for run in self.orphans)

    async def reap_orphans(self) -> None:
        for run in list(self.orphans):
            state = await self.driver.poll(run.spec, run.handle)
            if state.phase not in ("Launching", "Running") and await self._cleanup(run):
                self.orphans.remove(run)
                self._release(run.spec)
                log.info("orphaned sub-task %s attempt %s has stopped (%s)", run.spec.subtask, run.spec.attempt,
                         state.phase)

    async def _cleanup(self, run: Run) -> bool:
        """The run's folder goes once it has ended and was reported (a driver without a `cleanup` keeps
        it). False while the driver says it cannot yet (its runner is still exiting): ask again."""
        cleanup = getattr(self.driver, "cleanup", None)
        if cleanup is None:
            return True
        try:
            return bool(await cleanup(run.spec, run.handle))
        except OSError:
            log.exception("could not delete the run of sub-task %s attempt %s", run.spec.subtask, run.spec.attempt)
            return True

    # ------------------------------------------------------------ watcher
    async def watch_once(self) -> None:
        params = {"cluster": self.cluster, "watch": "true", "timeoutSeconds": WATCH_SECONDS}
        if self.deferred:  # a claim waits for another site's rendezvous: look again soon, not on our change
            self.deferred = False
            await asyncio.sleep(0.5)
        elif self.version:
            params["resourceVersion"] = self.version
        try:
            listing = await asyncio.to_thread(self.watch_client.get, "/api/v1/subtasks", **params)
        except ApiError as exc:
            if exc.status not in (400, 422) or "resourceVersion" not in params:
                raise
            log.warning("agent: the server refused our watch position (%s); listing afresh", exc.message)
            self.version = None
            return
        self.version = listing.get("metadata", {}).get("resourceVersion")
        active = {i["metadata"]["uid"]: i for i in listing["items"]}
        self.desired = {uid: i["spec"]["desired"] for uid, i in active.items()}
        for uid, run in self.runs.items():
            if uid not in active and (run.reported is None or run.reported.phase not in DONE):
                self.desired[uid] = "Stop"  # the server has finished with it
        for uid, item in sorted(active.items(), key=lambda kv: kv[1]["spec"]["firstRank"]):
            # Launching and not ours: claimed by an earlier life of this agent that died before the
            # launch (adopt() found no run), so claiming again launches it for the first time
            claimable = item["status"]["phase"] in ("Pending", "Launching") and item["spec"]["desired"] == "Run"
            if claimable and uid not in self.runs and uid not in self.refused:
                await self._claim_and_launch(uid, item)

    def _held_by_stopping_runs(self, uid: str, item: dict[str, Any]) -> bool:
        """Whether this sub-task's devices are still held by runs being stopped (a cancelled job's workers
        take a moment to exit, and the server leased their GPUs again at the cancel): its claim then waits
        for them, up to STOPPING_GRACE_SECONDS, instead of failing the new job for GPUs that free in seconds."""
        if self.devices is None or len(self.devices.free()) >= int(item["spec"].get("gpus") or 1):
            self.waiting.pop(uid, None)
            return False
        stopping = any(self.desired.get(u) == "Stop" or r.stop_sent for u, r in self.runs.items())
        first = self.waiting.setdefault(uid, time.monotonic())
        if not stopping or time.monotonic() - first > STOPPING_GRACE_SECONDS:
            self.waiting.pop(uid, None)
            return False
        return True

    async def _claim_and_launch(self, uid: str, item: dict[str, Any]) -> None:
        if self._held_by_stopping_runs(uid, item):
            log.info("claim of %s waits: its devices are held by a run being stopped", item["metadata"]["name"])
            self.deferred = True
            return
        body: dict[str, Any] = {}
        if item["spec"]["firstRank"] == 0:
            body["rendezvous"] = Endpoint(host=self.advertise, port=free_port(agent_port_range())).model_dump()
        try:
            raw = await self._call("post", f"/api/v1/subtasks/{uid}/claim", json=body)
        except ApiError as exc:
            if exc.status == 409:  # waiting for the first site's rendezvous, or stopped meanwhile
                log.debug("claim %s deferred: %s", item["metadata"]["name"], exc.message)
                self.deferred = True
                return
            raise
        spec = AttemptSpec.model_validate(raw).model_copy(update={"server": self.server})
        try:
            if self.devices is not None:
                spec = spec.model_copy(update={"devices": self.devices.assign(spec)})
            handle = await self.driver.launch(spec)
        except Exception as exc:  # noqa: BLE001 - one sub-task's launch must not stop the agent
            self._release(spec)
            await self._refuse(uid, spec, exc)
            return
        self.runs[uid] = Run(uid, spec, handle)
        log.info("launched sub-task %s attempt %s: ranks %s..%s, rendezvous %s:%s", spec.subtask, spec.attempt,
                 spec.first_rank, spec.first_rank + spec.workers - 1, spec.rendezvous.host if spec.rendezvous else "?",
                 spec.rendezvous.port if spec.rendezvous else "?")

    def _release(self, spec: AttemptSpec) -> None:
        if self.devices is not None:
            self.devices.release(spec)

    async def _refuse(self, uid: str, spec: AttemptSpec, exc: Exception) -> None:
        """The driver could not start the workers: the sub-task fails with the driver's reason (the
        reconciler treats it as this site's fault and re-places the job), and the agent goes on."""
        cause = getattr(exc, "message", None) or f"{type(exc).__name__}: {exc}"
        log.error("could not launch sub-task %s attempt %s: %s", spec.subtask, spec.attempt, cause)
        self.refused.add(uid)
        await self._call("post", f"/api/v1/subtasks/{uid}/status",
                         json={"phase": "Failed", "message": f"the site could not launch the workers: {cause}"[:2000],
                               "exitCodes": {NOT_LAUNCHED: LAUNCH_FAILED}})

    # ------------------------------------------------------------ monitor
    async def monitor_once(self) -> None:
        await self.reap_orphans()
        for uid, run in list(self.runs.items()):
            try:
                await self._monitor_run(uid, run)
            except ApiError:
                raise  # the server: retried by the loop
            except Exception:  # noqa: BLE001 - one run's driver error must not blind the agent to the others
                log.exception("monitoring sub-task %s attempt %s failed", run.spec.subtask, run.spec.attempt)

    async def _monitor_run(self, uid: str, run: Run) -> None:
        state = await self.driver.poll(run.spec, run.handle)
        if self.desired.get(uid) == "Stop" and not run.stop_sent and state.phase not in DONE:
            # a run that already ended is reported as it ended (its workers killed: the site was lost), not
            # cancelled: the server stops a synchronous attempt's other sites when one fails, and that
            # Stop could overtake this site's own failure and hide that the site was lost
            await self.driver.cancel(run.spec, run.handle)
            run.stop_sent = True
            log.info("stopping sub-task %s attempt %s (desired Stop)", run.spec.subtask, run.spec.attempt)
            state = await self.driver.poll(run.spec, run.handle)
        lines, cursor = await self.driver.logs(run.spec, run.handle, run.cursor)
        if lines:
            await self._call("post", f"/api/v1/subtasks/{uid}/logs",
                             json={"lines": [{"rank": x.rank, "line": x.line[:4000]} for x in lines]})
            run.cursor = cursor
        if _changed(run.reported, state) or time.monotonic() - run.reported_at > REPORT_EVERY:
            await self._report(run, state)
        if state.phase in DONE:
            self._release(run.spec)  # its workers have exited: the devices go to the next sub-task
        if state.phase in DONE and not lines and run.reported is not None and run.reported.phase in DONE:
            if await self._cleanup(run):  # reported and drained: the run's folder goes
                del self.runs[uid]

    async def _report(self, run: Run, state: SubtaskState) -> None:
        body = {"phase": state.phase, "message": state.message[:2000],
                "exitCodes": {k: v for k, v in state.exit_codes.items() if v is None or isinstance(v, int)}}
        if run.spec.devices is not None:
            body["devices"] = run.spec.devices.ids
        try:
            await self._call("post", f"/api/v1/subtasks/{run.uid}/status", json=body)
        except ApiError as exc:
            if exc.status != 404:
                raise
        run.reported, run.reported_at = state, time.monotonic()
        if state.phase != "Running" or run.reported is None:
            log.info("sub-task %s attempt %s: %s %s", run.spec.subtask, run.spec.attempt, state.phase, state.message)


def _changed(old: SubtaskState | None, new: SubtaskState) -> bool:
    return old is None or (old.phase, old.message, old.exit_codes) != (new.phase, new.message, new.exit_codes)


async def run_work(loop: WorkLoop, interval: float = 1.0) -> None:
    """Both halves until cancelled; transient API errors are retried, not fatal. The runs of an
    earlier life are sorted out first (adopted, or stopped when the server no longer wants them)."""
    await adopt(loop, interval)

    async def watcher() -> None:
        while True:
            await _retrying(loop.watch_once, interval)

    async def monitor() -> None:
        while True:
            await _retrying(loop.monitor_once, interval)
            await asyncio.sleep(interval)

    try:
        await asyncio.gather(watcher(), monitor())
    finally:
        loop.close()


async def adopt(loop: WorkLoop, interval: float = 1.0) -> None:
    """The runs of an earlier life, sorted out before this agent offers any slot (retried until the
    server answers): an orphan still running holds its slots."""
    while not loop.adopted:
        await _retrying(loop.adopt, interval, once=True)
        if not loop.adopted:
            await asyncio.sleep(interval)


async def _retrying(step: Any, interval: float, once: bool = False) -> None:
    while True:
        try:
            await step()
            return
        except ApiError as exc:
            if exc.status not in (0, 429) and exc.status < 500 and exc.status not in (404, 409):
                raise
            log.warning("agent: %s; retrying", exc)
        except OSError as exc:
            log.warning("agent: %s; retrying", exc)
        except Exception:  # noqa: BLE001 - a bug or a driver's surprise must not end the agent
            log.exception("agent: unexpected error; retrying")
        if once:
            return
        await asyncio.sleep(interval)
