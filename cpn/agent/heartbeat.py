"""The site agent's heartbeat: observe a cluster's GPUs every round and report them to CPN.

Two ways to observe: the site's Kubernetes API (discovery of node pools and free GPUs), or the
local machine (CUDA devices when torch sees any, else N CPU "slots" — torch is optional). The
agent speaks to CPN only through :mod:`cpn.client`. A failed discovery is reported as a NotReady
heartbeat instead of silence; a 409 (a concurrent write to the cluster's row) is sent again at once;
a server that cannot be reached or answers 5xx is retried next round; any other refusal (401, 403,
404, 422) stops the agent, since retrying cannot fix it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import re
import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from datetime import timedelta
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from cpn import API_VERSION
from cpn.client import ApiError, Client
from cpn.core.errors import InvalidInput, Unavailable
from layers.resource import gpus
from layers.resource.catalog import REGIONS
from layers.resource.discovery.fabric import local_fabric
from layers.resource.discovery.kubernetes import DiscoveredPool, discover
from layers.resource.drivers.base import DriverError
from layers.resource.gpus import CPU_SLOT_TFLOPS
from layers.resource.schemas import IFNAME_RE, FabricReport, KubernetesRef

log = logging.getLogger("cpn.agent")

NCCL_ENV_KEY = re.compile(r"^(NCCL|GLOO|TORCH_NCCL)_[A-Z0-9_]+$")  # what --nccl-env may set


@dataclass(frozen=True, kw_only=True)
class Registration:
    """What to create when the cluster does not exist yet (`--register`, local mode only)."""

    site: str
    region: str
    price_per_gpu_hour: str
    lat: float | None = None
    lon: float | None = None

    def __post_init__(self) -> None:
        try:
            price = Decimal(self.price_per_gpu_hour)
        except InvalidOperation:
            price = Decimal(-1)
        if not price.is_finite() or price <= 0:
            raise InvalidInput(f"price {self.price_per_gpu_hour!r} must be a positive decimal such as 0.45",
                               field="price")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    cluster: str
    server: str
    token: str | None = None
    kubeconfig: Path | None = None
    context: str | None = None
    local: bool = False
    gpus: int | None = None
    """Local mode: slots to offer when no CUDA device is visible (default 1)."""
    price_per_gpu_hour: str | None = None
    """Price for discovered pools the cluster's manifest does not price yet."""
    interval: timedelta = timedelta(seconds=15)
    timeout: timedelta = timedelta(seconds=10)
    once: bool = False
    register: Registration | None = None
    state_dir: Path | None = None
    """Where local runs live (default ~/.local/share/cpn/agent/<cluster>)."""
    advertise_address: str | None = None
    """Address other sites reach this one at (default: the one used to reach the server)."""
    namespace: str | None = None
    """Kubernetes: the namespace of the Jobs (default: the cluster's spec.kubernetes.namespace)."""
    image: str | None = None
    """Kubernetes: the image pods run when the job names none (default: the cluster's spec.kubernetes.image)."""
    socket_ifname: str | None = None
    """The interface NCCL and Gloo use at this site (the cluster's spec.fabric.socketIfname wins)."""
    nccl_env: dict[str, str] = field(default_factory=dict)
    """Extra NCCL_*/GLOO_*/TORCH_NCCL_* variables for the workers (the cluster's fabric wins)."""
    work: bool = True
    """Claim and run sub-tasks (off: heartbeat only)."""
    keep_runs: bool = False
    """Local mode: keep each run's folder after it ended (for inspection)."""

    def __post_init__(self) -> None:
        if self.local == (self.kubeconfig is not None):
            raise InvalidInput("give either --kubeconfig PATH (Kubernetes discovery) or --local", field="kubeconfig")
        if self.gpus is not None and self.gpus < 1:
            raise InvalidInput("--gpus must be at least 1", field="gpus")
        if self.interval <= timedelta(0):
            raise InvalidInput("--interval must be positive, e.g. --interval 15", field="interval")
        if self.register is not None and not self.local:
            raise InvalidInput("--register works with --local; create Kubernetes clusters with cpnctl apply",
                               field="register")
        if self.socket_ifname is not None and not re.match(IFNAME_RE, self.socket_ifname):
            raise InvalidInput(f"--socket-ifname {self.socket_ifname!r} is not an interface name (e.g. eth0, ib0)",
                               field="socketIfname")
        for key in self.nccl_env:
            if not NCCL_ENV_KEY.match(key):
                raise InvalidInput(f"--nccl-env {key}: only NCCL_*, GLOO_* and TORCH_NCCL_* variables, e.g. "
                                   "--nccl-env NCCL_IB_TIMEOUT=22", field="ncclEnv")

    def network_env(self) -> dict[str, str]:
        """The workers' network variables this agent adds (local runs; pods get them from the driver)."""
        env = dict(self.nccl_env)
        if self.socket_ifname:
            env |= {"NCCL_SOCKET_IFNAME": self.socket_ifname, "GLOO_SOCKET_IFNAME": self.socket_ifname}
        return env


@dataclass(frozen=True)
class Observation:
    allocatable_gpus: int
    capacity_gpus: int | None
    ready: bool
    reason: str
    message: str
    pools: list[DiscoveredPool] = field(default_factory=list)
    error: Exception | None = None
    fabric: FabricReport | None = None


@dataclass(frozen=True)
class LocalDevices:
    count: int
    gpu: gpus.GpuModelInfo | None
    name: str


async def run_agent_until_stopped(cfg: AgentConfig,
                                  signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)) -> str | None:
    """:func:`run_agent` until it ends or one of `signals` arrives; then, before returning the signal's
    name, a goodbye (:func:`goodbye`): the cluster is not Ready from that moment, not only once its
    heartbeat has timed out, so no new work is placed on a site whose agent is gone."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(run_agent(cfg))
    stopped: list[str] = []

    def stop(sig: signal.Signals) -> None:
        if not stopped:
            stopped.append(sig.name)
            task.cancel()

    for sig in signals:
        loop.add_signal_handler(sig, stop, sig)
    try:
        await task
    except asyncio.CancelledError:
        if not stopped:  # cancelled from outside, not by a signal
            raise
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    if stopped:
        log.info("agent for cluster %s: %s received, saying goodbye", cfg.cluster, stopped[0])
        await goodbye(cfg, f"the agent was stopped ({stopped[0]})")
        return stopped[0]
    return None


GOODBYE_TIMEOUT = 5.0  # seconds a stopping agent waits for the server to take its goodbye


async def goodbye(cfg: AgentConfig, why: str) -> bool:
    """One last heartbeat with the provider's token: the cluster reports itself not Ready (reason
    AgentStopped) with no GPU free. Best effort: an unreachable server is logged (the heartbeat timeout
    then does the same, later); True when the server took it."""
    body = {"allocatableGpus": 0,
            "conditions": [{"type": "Ready", "status": "False", "reason": "AgentStopped", "message": why}]}
    try:
        with Client(cfg.server, cfg.token, timeout=GOODBYE_TIMEOUT) as client:
            await asyncio.to_thread(client.post, f"/api/v1/clusters/{cfg.cluster}/heartbeat", body)
    except ApiError as exc:
        log.warning("agent for cluster %s: goodbye not delivered (%s); the cluster stays Ready until its heartbeat "
                    "times out", cfg.cluster, exc.message)
        return False
    log.info("agent for cluster %s: goodbye delivered, the cluster is not Ready", cfg.cluster)
    return True


async def run_agent(cfg: AgentConfig) -> None:
    """Heartbeat (and run the cluster's sub-tasks) until cancelled, or heartbeat once. Raises
    ApiError / CPNError on a permanent failure."""
    client = Client(cfg.server, cfg.token, timeout=cfg.timeout.total_seconds())
    try:
        spec = await _prepare(client, cfg)
        kube = kubernetes_settings(spec)
        if cfg.kubeconfig is not None and cfg.context is None and kube is not None and kube.context:
            cfg = replace(cfg, context=kube.context)  # the cluster's registered context, unless --context
        if cfg.once or not cfg.work:
            await _heartbeats(client, cfg, spec)
            return
        from cpn.agent.work import WorkLoop, adopt, run_work

        devices = None
        if cfg.local:
            from cpn.agent.devices import DevicePool

            devices = await asyncio.to_thread(DevicePool.discover, cfg.gpus)
            log.info("agent for cluster %s: %d %s device(s) %s", cfg.cluster, len(devices.ids), devices.kind,
                     ",".join(devices.ids))
        driver = make_driver(cfg, kube)
        if cfg.kubeconfig is not None:
            await asyncio.to_thread(_check_server, driver, kube)
        loop = WorkLoop(cfg.server, cfg.token, cfg.cluster, driver, advertise=cfg.advertise_address,
                        devices=devices)
        log.info("agent for cluster %s: claiming its sub-tasks, advertising %s", cfg.cluster, loop.advertise)
        await adopt(loop)  # before any heartbeat: an orphan of an earlier life still holds its slots
        await asyncio.gather(_heartbeats(client, cfg, spec, loop.held_slots, _settings_sink(driver)),
                             run_work(loop))
    finally:
        client.close()


async def _heartbeats(client: Client, cfg: AgentConfig, spec: dict[str, Any],
                      held: Callable[[], int] | None = None,
                      on_spec: Callable[[dict[str, Any]], None] | None = None) -> None:
    """`held`: slots still taken by runs the server no longer counts (orphans being stopped); `on_spec`
    gets the cluster's spec from every answered heartbeat (its manifest), so settings applied since
    take effect without a restart."""
    while True:
        observation = await observe(cfg)
        if held is not None and (busy := held()):
            observation = replace(observation, allocatable_gpus=max(0, observation.allocatable_gpus - busy),
                                  message=f"{observation.message}; {busy} held by a lost run that is stopping")
        answer = await _send(client, cfg, observation, _prices(spec, cfg))
        if on_spec is not None and isinstance(answer, dict) and isinstance(answer.get("spec"), dict):
            on_spec(answer["spec"])
        if cfg.once:
            if observation.error is not None:
                raise observation.error
            return
        await asyncio.sleep(cfg.interval.total_seconds())


def default_state_dir(cluster: str) -> Path:
    return Path.home() / ".local" / "share" / "cpn" / "agent" / cluster


def make_driver(cfg: AgentConfig, kube: KubernetesRef | None = None) -> Any:
    """The cluster's driver, running here at the site; `kube`: the cluster's `spec.kubernetes`."""
    if cfg.local:
        from layers.resource.drivers.local import LocalDriver

        return LocalDriver(cfg.state_dir or default_state_dir(cfg.cluster), env=cfg.network_env(),
                           keep_runs=cfg.keep_runs)
    from layers.resource.drivers.kubernetes import KubernetesDriver

    return KubernetesDriver(kubeconfig=cfg.kubeconfig, context=cfg.context, namespace=cfg.namespace, image=cfg.image,
                            socket_ifname=cfg.socket_ifname or "eth0", nccl_env=cfg.nccl_env, cluster=kube)


def kubernetes_settings(spec: dict[str, Any]) -> KubernetesRef | None:
    """The cluster's `spec.kubernetes` as the server stored it; None when it has none or it no longer
    validates (a row written before the schema tightened: logged, the driver keeps its settings)."""
    raw = spec.get("kubernetes")
    if not isinstance(raw, dict):
        return None
    try:
        return KubernetesRef.model_validate(raw)
    except ValueError as exc:
        log.warning("the cluster's spec.kubernetes is not valid any more (%s): re-apply it", str(exc).splitlines()[0])
        return None


def _settings_sink(driver: Any) -> Callable[[dict[str, Any]], None] | None:
    use = getattr(driver, "use_cluster", None)
    if use is None:
        return None

    def sink(spec: dict[str, Any]) -> None:
        kube = kubernetes_settings(spec)
        if kube is not None and kube != driver.cluster:
            log.info("cluster settings changed: spec.kubernetes is now %s", kube.wire())
            use(kube)

    return sink


def _check_server(driver: Any, kube: KubernetesRef | None) -> None:
    """Warn when the kubeconfig points at another API server than the cluster registered (a wrong
    --context puts the jobs on the wrong cluster); the registered URL may be an external name of the
    same server, so it is a warning, not a refusal."""
    if kube is None or not kube.server:
        return
    try:
        found = driver.server
    except DriverError as exc:  # a broken kubeconfig: discovery and launches report it
        log.warning("cannot read the kubeconfig's server: %s", exc)
        return
    if found.rstrip("/") != kube.server.rstrip("/"):
        log.warning("the kubeconfig points at %s but the cluster's spec.kubernetes.server is %s: check --context "
                    "(or correct the cluster's spec)", found, kube.server)


async def observe(cfg: AgentConfig) -> Observation:
    if cfg.local:
        devices = await asyncio.to_thread(local_devices, cfg.gpus)
        fabric = await asyncio.to_thread(local_fabric)
        return Observation(devices.count, devices.count, True, "LocalDevices", f"{devices.count} × {devices.name}",
                           fabric=fabric)
    assert cfg.kubeconfig is not None
    try:
        found = await asyncio.to_thread(discover, cfg.kubeconfig, cfg.context,
                                        timeout=cfg.timeout.total_seconds())
    except Unavailable as exc:
        return Observation(0, None, False, "DiscoveryFailed", exc.message, error=exc)
    ready = found.conditions[0] if found.conditions else {"status": "True", "reason": "", "message": ""}
    return Observation(found.allocatable_gpus, found.capacity_gpus, ready["status"] == "True",
                       ready["reason"], ready["message"], found.node_pools, fabric=found.fabric)


def local_devices(fallback_slots: int | None) -> LocalDevices:
    """CUDA devices if torch is installed and sees any; otherwise `fallback_slots` CPU slots."""
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is not None and torch.cuda.is_available() and torch.cuda.device_count() > 0:
        name = torch.cuda.get_device_name(0)
        return LocalDevices(torch.cuda.device_count(), gpus.lookup(name), name)
    return LocalDevices(fallback_slots or 1, None, "CPU slot")


def heartbeat_body(observation: Observation, prices: dict[str, str]) -> dict[str, Any]:
    """The wire body; nodePools only when every discovered pool can be priced and rated."""
    body: dict[str, Any] = {
        "allocatableGpus": observation.allocatable_gpus,
        "conditions": [{"type": "Ready", "status": "True" if observation.ready else "False",
                        "reason": observation.reason, "message": observation.message}],
    }
    if observation.capacity_gpus is not None:
        body["capacityGpus"] = observation.capacity_gpus
    if observation.fabric is not None:
        body["fabric"] = observation.fabric.model_dump(mode="json", by_alias=True)  # nulls: unknown
    pools = [_priced(p, prices) for p in observation.pools]
    if pools and all(p is not None for p in pools):
        body["nodePools"] = pools
    return body


def _priced(pool: DiscoveredPool, prices: dict[str, str]) -> dict[str, Any] | None:
    price = prices.get(f"pool:{pool.name}") or prices.get(f"model:{pool.gpu_model}") or prices.get("default")
    if price is None or pool.tflops is None:
        return None
    return {**pool.manifest(), "pricePerGpuHour": price}


def _prices(spec: dict[str, Any], cfg: AgentConfig) -> dict[str, str]:
    """Prices the cluster's manifest already states, by pool name and by GPU model; `--price` last."""
    prices = {"default": cfg.price_per_gpu_hour} if cfg.price_per_gpu_hour else {}
    for pool in reversed(spec.get("nodePools") or []):
        prices[f"pool:{pool['name']}"] = str(pool["pricePerGpuHour"])
        prices[f"model:{pool['gpu']['model']}"] = str(pool["pricePerGpuHour"])
    return prices


async def _send(client: Client, cfg: AgentConfig, observation: Observation, prices: dict[str, str]) -> Any:
    """The server's answer (the cluster's manifest), or None when the report did not get through."""
    body = heartbeat_body(observation, prices)
    try:
        answer = await _post_heartbeat(client, cfg.cluster, body)
    except ApiError as exc:
        if cfg.once or not _transient(exc):
            raise
        log.warning("heartbeat cluster=%s failed, retrying in %ss: %s", cfg.cluster,
                    int(cfg.interval.total_seconds()), exc.message)
        return None
    capacity = "?" if observation.capacity_gpus is None else observation.capacity_gpus
    pools = f" pools={len(body['nodePools'])}" if "nodePools" in body else ""
    log.info("heartbeat cluster=%s ready=%s allocatable=%s/%s%s: %s", cfg.cluster, observation.ready,
             observation.allocatable_gpus, capacity, pools, observation.message)
    return answer


CONFLICT_RETRIES = 6  # a heartbeat answered 409 is sent again at once, up to this many times, before the next round
CONFLICT_BACKOFF = 0.05  # seconds before the first repeat; doubled each time, jittered


async def _post_heartbeat(client: Client, cluster: str, body: dict[str, Any]) -> Any:
    """POST one heartbeat; a 409 (someone else wrote the cluster's row meanwhile: a price or label change)
    is repeated after a short jittered backoff -- the server re-reads the row each time -- since the report
    itself is never wrong (issue 36, item 3: the agent exited on it and its site was lost)."""
    for attempt in range(CONFLICT_RETRIES + 1):
        try:
            return await asyncio.to_thread(client.post, f"/api/v1/clusters/{cluster}/heartbeat", body)
        except ApiError as exc:
            if exc.status != 409 or attempt == CONFLICT_RETRIES:
                raise
            delay = CONFLICT_BACKOFF * 2**attempt * random.uniform(0.5, 1.5)
            log.info("heartbeat cluster=%s met a concurrent write (%s); sending again in %.2fs", cluster,
                     exc.message, delay)
            await asyncio.sleep(delay)


def _transient(exc: ApiError) -> bool:
    """Worth the next round: the server unreachable or failing, a rate limit, or a conflict that outlasted
    :func:`_post_heartbeat`'s repeats (nothing in the agent's own report is wrong)."""
    return exc.status in (0, 409, 429) or exc.status >= 500


async def _prepare(client: Client, cfg: AgentConfig) -> dict[str, Any]:
    """The cluster's current spec (for prices), registering site and cluster first if asked to."""
    try:
        return (await asyncio.to_thread(client.get, f"/api/v1/clusters/{cfg.cluster}"))["spec"]
    except ApiError as exc:
        if exc.status != 404 or cfg.register is None:
            raise
    devices = await asyncio.to_thread(local_devices, cfg.gpus)
    await _ensure_site(client, cfg.register)
    manifest = cluster_manifest(cfg.cluster, cfg.register, devices)
    created = await asyncio.to_thread(client.post, "/api/v1/clusters", manifest)
    log.info("registered cluster=%s site=%s gpus=%s", cfg.cluster, cfg.register.site, devices.count)
    return created["spec"]


async def _ensure_site(client: Client, reg: Registration) -> None:
    try:
        await asyncio.to_thread(client.get, f"/api/v1/sites/{reg.site}")
        return
    except ApiError as exc:
        if exc.status != 404:
            raise
    try:
        await asyncio.to_thread(client.post, "/api/v1/sites", site_manifest(reg))
    except ApiError as exc:
        if exc.status != 409:  # registered meanwhile by another agent of the same site
            raise


def site_manifest(reg: Registration) -> dict[str, Any]:
    spec: dict[str, Any] = {"region": reg.region}
    lat, lon = (reg.lat, reg.lon) if reg.lat is not None and reg.lon is not None else REGIONS.get(reg.region,
                                                                                                  (None, None))
    if lat is not None and lon is not None:
        spec["location"] = {"lat": lat, "lon": lon}
    return {"apiVersion": API_VERSION, "kind": "Site", "metadata": {"name": reg.site}, "spec": spec}


def cluster_manifest(name: str, reg: Registration, devices: LocalDevices) -> dict[str, Any]:
    if devices.gpu is not None:
        info = devices.gpu
        gpu = {"model": info.model, "memoryGB": info.memory_gb, "tflops": info.tflops}
        interconnect = {"intraNodeGbps": info.intra_node_gbps, "interNodeGbps": info.inter_node_gbps}
    else:
        gpu = {"model": "CPU", "memoryGB": _memory_per_slot_gb(devices.count), "tflops": CPU_SLOT_TFLOPS}
        interconnect = {"intraNodeGbps": 100, "interNodeGbps": 10}
    pool = {"name": gpu["model"].lower(), "gpu": gpu, "gpusPerNode": devices.count, "nodes": 1,
            "pricePerGpuHour": reg.price_per_gpu_hour}
    return {"apiVersion": API_VERSION, "kind": "Cluster", "metadata": {"name": name},
            "spec": {"site": reg.site, "driver": "local", "currency": "USD", "nodePools": [pool],
                     "interconnect": interconnect}}


def _memory_per_slot_gb(slots: int) -> float:
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 8 * 2**30
    return max(0.5, round(total / slots / 2**30, 1))
