"""`cpn agent`: the site agent — heartbeats a cluster's live capacity and runs its sub-tasks."""

from __future__ import annotations

import asyncio
import logging
import os
from datetime import timedelta
from pathlib import Path

import click

from cpn.cli.ctl.config import ConfigError, resolve
from cpn.client import ApiError
from cpn.core.errors import CPNError

__all__ = ["agent_cmd"]


def _port_range(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    """Checked here, then handed on through the environment to the work loop, drivers and runners."""
    if not value:
        return
    from cpn.runtime.launcher import ENV_PORT_RANGE, PortRange

    try:
        os.environ[ENV_PORT_RANGE] = str(PortRange.parse(value))
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


def _pairs(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict[str, str]:
    pairs = {}
    for item in value:
        key, sep, val = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r}: write KEY=VALUE, e.g. NCCL_IB_TIMEOUT=22")
        pairs[key] = val
    return pairs


def _secret(token: str | None, token_file: Path | None) -> str | None:
    """--token, else the token file's first line."""
    if token or token_file is None:
        return token
    try:
        text = token_file.read_text().strip()
        mode = token_file.stat().st_mode
    except OSError as exc:
        raise click.ClickException(f"--token-file {token_file}: {exc.strerror}") from None
    if not text:
        raise click.ClickException(f"--token-file {token_file} is empty: write the provider token in it")
    if mode & 0o077:
        logging.getLogger("cpn.agent").warning("--token-file %s can be read by other users (mode %o): chmod 600 it",
                                               token_file, mode & 0o777)
    return text.splitlines()[0].strip()


def _forget_token() -> None:
    """Once read, the token lives only in this process's memory: out of its environment (nothing it
    starts inherits it), and the process non-dumpable, so that neither /proc/<pid>/environ (which keeps
    the environment it started with) nor its memory can be read by any other process of its user."""
    from cpn.runtime.sandbox import make_undumpable

    os.environ.pop("CPN_TOKEN", None)
    os.environ.pop("CPN_TOKEN_FILE", None)
    make_undumpable()


@click.command("agent")
@click.option("--cluster", required=True, help="Name of the CPN Cluster this agent reports for.")
@click.option("--kubeconfig", type=click.Path(dir_okay=False, path_type=Path),
              help="Discover GPUs from this Kubernetes cluster.")
@click.option("--kube-context", "--context", "kube_context", help="With --kubeconfig: the kubeconfig context "
              "(default: its current-context). Not a cpnctl context: the server and token come from "
              "--server/--token, CPN_SERVER/CPN_TOKEN, else cpnctl's current context.")
@click.option("--namespace", help="With --kubeconfig: namespace for Jobs [the cluster's spec.kubernetes.namespace].")
@click.option("--image", envvar="CPN_AGENT_IMAGE", help="With --kubeconfig: the container image (with CPN and "
              "torch) that pods run when a job names none in spec.image [CPN_AGENT_IMAGE, else the cluster's "
              "spec.kubernetes.image].")
@click.option("--socket-ifname", help="The network interface NCCL and Gloo use here (NCCL_SOCKET_IFNAME, "
              "GLOO_SOCKET_IFNAME) [eth0 in pods; the cluster's spec.fabric.socketIfname wins].")
@click.option("--nccl-env", "nccl_env", multiple=True, metavar="KEY=VALUE", callback=_pairs,
              help="Extra NCCL_*/GLOO_*/TORCH_NCCL_* variable for the workers, repeatable "
              "(e.g. --nccl-env NCCL_IB_TIMEOUT=22); the cluster's spec.fabric wins where both set one.")
@click.option("--local", is_flag=True, help="Offer this machine's GPUs (or CPU slots) instead.")
@click.option("--gpus", type=int, help="With --local: slots to offer when no CUDA device is visible [1].")
@click.option("--server", help="CPN API URL (CPN_SERVER, else the cpnctl config's current context).")
@click.option("--token", help="Provider token (prefer --token-file: a flag shows in `ps`; else CPN_TOKEN, else the "
              "cpnctl config).")
@click.option("--token-file", envvar="CPN_TOKEN_FILE", type=click.Path(dir_okay=False, path_type=Path),
              help="Read the provider token from this file (mode 0600, the agent's user only) [CPN_TOKEN_FILE].")
@click.option("--keep-runs", is_flag=True, help="With --local: keep each run's folder after it ended (outputs, "
              "logs), for inspection; by default it is deleted once its outputs are on the server.")
@click.option("--advertise-address", help="Address other sites reach this one at, for the rendezvous of jobs "
              "whose first site is here [the address used to reach the server].")
@click.option("--port-range", metavar="LO-HI", callback=_port_range, expose_value=False,
              help="TCP ports to open between sites: the rendezvous this agent advertises and (on Kubernetes) "
              "the pods' ephemeral ports, where Gloo and NCCL listen, come from it [any free port].")
@click.option("--state-dir", type=click.Path(file_okay=False, path_type=Path),
              help="Where local runs live [~/.local/share/cpn/agent/CLUSTER].")
@click.option("--no-work", is_flag=True, help="Heartbeat only; do not claim sub-tasks.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=15.0, show_default=True,
              help="Seconds between heartbeats.")
@click.option("--once", is_flag=True, help="Send one heartbeat and exit.")
@click.option("--price", help="USD per GPU-hour for pools the cluster does not price yet (e.g. 0.45).")
@click.option("--register", is_flag=True, help="With --local: create the Site and Cluster if missing.")
@click.option("--site", help="With --register: the Site to create or join.")
@click.option("--region", help="With --register: the new Site's region, e.g. eu-central.")
@click.option("--lat", type=click.FloatRange(-90, 90), help="With --register: the new Site's latitude.")
@click.option("--lon", type=click.FloatRange(-180, 180), help="With --register: the new Site's longitude.")
def agent_cmd(cluster: str, kubeconfig: Path | None, kube_context: str | None, local: bool, gpus: int | None,
              namespace: str | None, image: str | None, socket_ifname: str | None, nccl_env: dict[str, str],
              server: str | None, token: str | None, token_file: Path | None,
              keep_runs: bool, advertise_address: str | None,
              state_dir: Path | None, no_work: bool, interval: float, once: bool, price: str | None,
              register: bool, site: str | None, region: str | None, lat: float | None,
              lon: float | None) -> None:
    """Heartbeat a cluster's allocatable GPUs every --interval seconds, claim the sub-tasks CPN places
    on it and run them (local processes, or Indexed Jobs on the site's Kubernetes).

    \b
      CPN_TOKEN=... cpn agent --cluster fra-1-h100 --kubeconfig ~/.kube/config --server https://cpn.example
      cpn agent --cluster lab-cpu --local --gpus 4 --register --site lab-1 --region eu-west --price 0.10
    """
    from cpn.agent.heartbeat import AgentConfig, Registration, run_agent_until_stopped

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s",
                        datefmt="%Y-%m-%dT%H:%M:%S")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per heartbeat, not per request
    if image and kubeconfig is None:
        raise click.ClickException("--image is the container image of Kubernetes pods: add --kubeconfig PATH")
    if kube_context and kubeconfig is None:
        raise click.ClickException(f"--context/--kube-context {kube_context!r} names a context of a kubeconfig: "
                                   "add --kubeconfig PATH (the CPN server and token come from --server/--token)")
    try:
        target = resolve(server, _secret(token, token_file), None)
        _forget_token()
        if note := target.source_note():
            click.echo(f"cpn agent: {note}", err=True)
        registration = None
        if register:
            if not (site and region and price):
                raise click.ClickException("--register needs --site, --region and --price")
            registration = Registration(site=site, region=region, price_per_gpu_hour=price, lat=lat, lon=lon)
        cfg = AgentConfig(cluster=cluster, server=target.server or "", token=target.token, kubeconfig=kubeconfig,
                          context=kube_context, local=local, gpus=gpus, price_per_gpu_hour=price,
                          interval=timedelta(seconds=interval), once=once, register=registration,
                          namespace=namespace, image=image, socket_ifname=socket_ifname, nccl_env=nccl_env,
                          advertise_address=advertise_address, state_dir=state_dir,
                          work=not no_work, keep_runs=keep_runs)
        # SIGTERM or Ctrl-C: a goodbye first, so the cluster is not Ready at once (not after the heartbeat timeout)
        if asyncio.run(run_agent_until_stopped(cfg)) == "SIGINT":
            raise SystemExit(130)
    except (ApiError, ConfigError) as exc:
        raise click.ClickException(str(exc)) from exc
    except CPNError as exc:
        raise click.ClickException(exc.message) from exc
    except KeyboardInterrupt:
        raise SystemExit(130) from None
