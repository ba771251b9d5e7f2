"""`cpn doctor`: what a provider runs at a site before starting `cpn agent` — can this machine run
CPN's jobs, and does it match the cluster it is registered as? One line per check, ✓ or ✗ with
the fix; exit 1 when a failed check would stop a job (anchors: `sky check`, `nvidia-smi topo -m`).

Needs no torch: GPUs come from `nvidia-smi`, NCCL from torch only when torch is installed.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import click
import httpx

from cpn.cli.ctl.config import ConfigError, resolve

CLOCK_TOLERANCE_S = 5.0  # worker tokens, leases and heartbeats are timed by the server's clock
MIN_FREE_DISK_GB = 5.0  # checkpoints of a small model, logs, the code bundle
PORTS_TRIED = 64


@dataclass
class Check:
    name: str
    ok: bool
    detail: str
    fix: str | None = None
    blocking: bool = True  # a failure would stop a job (exit 1)


def _gpus() -> list[dict[str, str]]:
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
    return [{"name": r[0], "memory": r[1], "driver": r[2]} for r in rows if len(r) >= 3]


def check_api(server: str | None, token: str | None) -> tuple[Check, float | None]:
    """Reach the API with the token; the server's clock from its Date header."""
    fix = "give --server URL and --token-file PATH (or CPN_SERVER/CPN_TOKEN, or a cpnctl context)"
    if not server:
        return Check("api", False, "no server configured", fix), None
    try:
        sent = time.time()
        resp = httpx.get(f"{server.rstrip('/')}/api/v1/whoami", timeout=10,
                         headers={"Authorization": f"Bearer {token}"} if token else {})
        now = (sent + time.time()) / 2
    except httpx.HTTPError as exc:
        return Check("api", False, f"cannot reach {server}: {exc}", "check the URL, the network and the firewall "
                     "(the agent dials out to the API)"), None
    offset = None
    if date := resp.headers.get("date"):
        offset = now - parsedate_to_datetime(date).timestamp()
    if resp.status_code != 200:
        return Check("api", False, f"{server} answered {resp.status_code}: {resp.text[:200]}",
                     "use a valid provider token: cpn token create NAME --role provider"), offset
    who = resp.json()
    return Check("api", True, f"{server} as {who.get('name', '?')} ({who.get('role', '?')})"), offset


def check_clock(offset: float | None) -> Check:
    if offset is None:
        return Check("clock", False, "the server's clock was not read", "fix the api check first", blocking=False)
    ok = abs(offset) <= CLOCK_TOLERANCE_S
    return Check("clock", ok, f"this machine is {offset:+.1f} s from the server",
                 None if ok else "synchronise the clock (chrony or systemd-timesyncd)", blocking=False)


def check_devices(gpus: list[dict[str, str]]) -> Check:
    if gpus:
        names = sorted({f"{g['name']} {g['memory']}" for g in gpus})
        return Check("devices", True, f"{len(gpus)} GPU(s): {', '.join(names)}; driver {gpus[0]['driver']}")
    return Check("devices", True, f"no GPU (nvidia-smi absent or lists none): {os.cpu_count()} CPU core(s) "
                 "for CPU slots (cpn agent --local --gpus N)")


def check_nccl(gpus: list[dict[str, str]]) -> Check:
    try:
        import torch
    except ImportError:
        return Check("nccl", not gpus, "torch is not installed", "pip install torch (the workers need it)")
    if not torch.cuda.is_available():
        if gpus:
            return Check("nccl", False, f"torch {torch.__version__} sees no CUDA device",
                         "install a CUDA build of torch matching the driver")
        return Check("nccl", True, f"torch {torch.__version__} (CPU build): Gloo only, as CPU slots need")
    version = ".".join(map(str, torch.cuda.nccl.version()))
    return Check("nccl", True, f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {version}")


def check_fabric(sys_ib: Path = Path("/sys/class/infiniband")) -> Check:
    hcas = sorted(p.name for p in sys_ib.iterdir()) if sys_ib.is_dir() else []
    if hcas:
        return Check("fabric", True, f"RDMA devices {','.join(hcas)}: declare spec.fabric kind infiniband or roce "
                     f"with hcas [{', '.join(hcas)}]", blocking=False)
    return Check("fabric", True, "no RDMA device (/sys/class/infiniband): spec.fabric kind ethernet",
                 blocking=False)


def check_ports() -> Check:
    from cpn.runtime.launcher import agent_port_range

    port_range = agent_port_range()
    ports = range(port_range.low, port_range.high + 1) if port_range else range(0, 1)
    bound = 0
    for port in list(ports)[:PORTS_TRIED]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
                bound += 1
            except OSError:
                continue
    where = f"{port_range.low}-{port_range.high}" if port_range else "any free port (no --port-range)"
    return Check("ports", bound > 0, f"bound {bound} of {min(len(ports), PORTS_TRIED)} port(s) tried in {where}",
                 None if bound else "free ports in the range or choose another with cpn agent --port-range LO-HI")


def check_disk(path: Path) -> Check:
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    free = shutil.disk_usage(existing).free / 2**30
    ok = free >= MIN_FREE_DISK_GB
    return Check("disk", ok, f"{free:.1f} GB free at {existing} (runs and checkpoints)",
                 None if ok else f"free at least {MIN_FREE_DISK_GB:.0f} GB or point --state-dir elsewhere")


def check_cluster(name: str, server: str | None, token: str | None, gpus: list[dict[str, str]]) -> Check:
    fix = "fix the api check first"
    if not server:
        return Check("cluster", False, f"cluster {name} not read", fix)
    try:
        resp = httpx.get(f"{server.rstrip('/')}/api/v1/clusters/{name}", timeout=10,
                         headers={"Authorization": f"Bearer {token}"} if token else {})
    except httpx.HTTPError:
        return Check("cluster", False, f"cluster {name} not read", fix)
    if resp.status_code == 404:
        return Check("cluster", False, f"no cluster {name} on the server",
                     "register it: cpnctl apply -f cluster.yaml, or cpn agent --local --register")
    if resp.status_code != 200:
        return Check("cluster", False, f"cluster {name}: {resp.status_code}", fix)
    pools = resp.json()["spec"].get("nodePools", [])
    declared = [p["gpu"]["model"] for p in pools if p["gpu"]["model"].upper() != "CPU"]
    count = sum(p["gpusPerNode"] * p["nodes"] for p in pools)
    if declared and not gpus:
        return Check("cluster", False, f"{name} declares {count} {', '.join(sorted(set(declared)))} GPU(s); this "
                     "machine has none", "run the agent on the GPU machine, or declare the pool as model CPU")
    if declared and len(gpus) < count and resp.json()["spec"].get("driver") == "local":
        return Check("cluster", False, f"{name} declares {count} GPU(s), this machine has {len(gpus)}",
                     "lower the pool's gpusPerNode x nodes to what is here")
    return Check("cluster", True, f"{name}: {count} {'GPU' if declared else 'CPU slot'}(s) declared, "
                 f"{len(gpus) or os.cpu_count()} {'GPU' if gpus else 'core'}(s) here")


def run_checks(server: str | None, token: str | None, cluster: str | None, state_dir: Path) -> list[Check]:
    gpus = _gpus()
    api, offset = check_api(server, token)
    checks = [api, check_clock(offset), check_devices(gpus), check_nccl(gpus), check_fabric(), check_ports(),
              check_disk(state_dir)]
    if cluster:
        checks.append(check_cluster(cluster, server if api.ok else None, token, gpus))
    return checks


@click.command("doctor")
@click.option("--cluster", help="Also compare this registered cluster with what this machine has.")
@click.option("--server", help="CPN API URL (CPN_SERVER, else the cpnctl config's current context).")
@click.option("--token-file", envvar="CPN_TOKEN_FILE", type=click.Path(dir_okay=False, path_type=Path),
              help="The provider token's file [CPN_TOKEN_FILE]; else CPN_TOKEN.")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path), help="Where the agent keeps runs.")
@click.option("--json", "as_json", is_flag=True, help="A JSON list of checks: name, ok, detail, fix.")
def doctor_cmd(cluster: str | None, server: str | None, token_file: Path | None, state_dir: Path | None,
               as_json: bool) -> None:
    """Check that this machine can run CPN's jobs (exit 1 when something would stop one).

    \b
      cpn doctor --server https://cpn.example --token-file ~/.cpn-token --cluster lab-cpu
    """
    from cpn.agent.heartbeat import default_state_dir

    token = token_file.read_text().strip() if token_file and token_file.exists() else None
    try:
        target = resolve(server, token, None)
        server, token = target.server, target.token
    except ConfigError:
        pass
    checks = run_checks(server, token, cluster, state_dir or default_state_dir(cluster or "doctor"))
    failed = any(not c.ok and c.blocking for c in checks)
    if as_json:
        click.echo(json.dumps(as_json_list(checks), indent=2))
    else:
        for c in checks:
            click.echo(f"{'✓' if c.ok else '✗'} {c.name:8} {c.detail}" + (f"\n    fix: {c.fix}" if not c.ok and c.fix
                                                                          else ""))
    raise SystemExit(1 if failed else 0)


def as_json_list(checks: list[Check]) -> list[dict[str, Any]]:
    """name, ok, detail, blocking; fix only on a failed check."""
    return [{k: v for k, v in asdict(c).items() if k != "fix" or (not c.ok and v)} for c in checks]
