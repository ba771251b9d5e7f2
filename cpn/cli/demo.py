"""`cpn demo`: the whole system on one machine in a few minutes.

Starts an embedded API server on SQLite, registers three local sites of two providers with
different prices and WAN links, starts a site agent per cluster (each in its own network namespace
behind the emulated WAN when root), submits a TrainingJob with
strategy `auto` on 1–3 sites (so the three quotes differ) that profiles its own first steps (so the
quotes rest on this machine's measured speed), shows the quotes, accepts `balanced`, runs it with a live progress bar and prints
the summary: validation loss start → end, wall time, WAN traffic and cost per provider.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import click

from cpn.agent.localsites import LocalCluster, LocalSites
from cpn.cli.ctl import output
from cpn.client import ApiError, Client
from cpn.runtime.launcher import free_port
from layers.resource.gpus import CPU_SLOT_TFLOPS

PROVIDERS = {"alpha-cloud": ["fra-1", "ams-1"], "beta-dc": ["nyc-1"]}
SITES = [  # name, region, lat, lon, price per slot-hour
    ("fra-1", "eu-central", 50.11, 8.68, "0.90"),
    ("ams-1", "eu-west", 52.37, 4.90, "0.60"),
    ("nyc-1", "us-east", 40.71, -74.01, "0.45"),
]
LINKS = [("fra-1", "ams-1", 0.2, 8.0, "0.02"), ("ams-1", "nyc-1", 0.1, 75.0, "0.05"),
         ("fra-1", "nyc-1", 0.1, 85.0, "0.05")]


def world(provider: str) -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    mine = PROVIDERS[provider]
    for name, region, lat, lon, price in SITES:
        if name not in mine:
            continue
        docs.append({"apiVersion": "cpn/v1", "kind": "Site", "metadata": {"name": name},
                     "spec": {"region": region, "location": {"lat": lat, "lon": lon}}})
        docs.append({"apiVersion": "cpn/v1", "kind": "Cluster", "metadata": {"name": f"{name}-cpu"},
                     "spec": {"site": name, "driver": "local", "nodePools": [{
                         "name": "slots", "gpu": {"model": "CPU", "memoryGB": 4, "tflops": CPU_SLOT_TFLOPS},
                         "gpusPerNode": 1, "nodes": 1, "pricePerGpuHour": price}],
                         "interconnect": {"intraNodeGbps": 50, "interNodeGbps": 10}}})
    # links from this provider's sites; one to beta-dc's site is pending until beta-dc applies it too
    # (`consents`, after every provider's world: docs/security.md, M4)
    docs += [_link(*ln) for ln in LINKS if ln[0] in mine and (ln[1] in mine or provider == "alpha-cloud")]
    return docs


def consents(provider: str) -> list[dict[str, Any]]:
    """The links other providers' worlds made to `provider`'s sites, for it to apply (its consent: a link
    between two providers' sites is used only once both applied it) after every provider's `world`."""
    mine = PROVIDERS[provider]
    return [_link(*ln) for ln in LINKS if ln[1] in mine and ln[0] not in mine]


def _link(a: str, b: str, gbps: float, rtt: float, price: str) -> dict[str, Any]:
    return {"apiVersion": "cpn/v1", "kind": "Link", "metadata": {"name": f"{a}--{b}"},
            "spec": {"a": a, "b": b, "bandwidthGbps": gbps, "rttMs": rtt, "pricePerGB": price}}


DEMO_BATCH_TOKENS = 3 * 128 * 8  # a step of 24 sequences: 8, 12 or 24 per slot on 3, 2 or 1 slots
PROFILE_WORTH = 10  # profile a job of at least this many times the profile's steps (a shorter one just runs)


def job_manifest(tokens: int, model: str) -> dict[str, Any]:
    # imported here: at module level the server's layers would add 3 s to every `cpn --help`
    from layers.orchestration.jobs.profile import PROFILE_STEPS

    profile = tokens // DEMO_BATCH_TOKENS >= PROFILE_WORTH * PROFILE_STEPS
    return {"apiVersion": "cpn/v1", "kind": "TrainingJob", "metadata": {"name": "demo-lm"},
            "spec": {"model": model, "dataset": "pystdlib", "tokens": tokens, "globalBatchTokens": DEMO_BATCH_TOKENS,
                     "strategy": "auto", "gpus": {"min": 1, "max": 3}, "sites": {"min": 1, "max": 3},
                     # a user in a hurry (time 4:1 over cost): at the demo's prices and CPU slots an even
                     # weighting makes `balanced` the one-site `cheapest`, so the demo would show no choice
                     # and no cross-site training; this weighting puts a two-site plan between the extremes
                     "objective": {"cost": 0.2, "time": 0.8},
                     # priced from its own timed steps (docs/byo.md): a machine's speed varies 1.6x from one
                     # day to the next here, which the modelled CPU slot cannot know
                     "profile": profile}}


def _token(env: dict[str, str], name: str, role: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "cpn.cli.server", "token", "create", name, "--role", role, "--init"],
                          env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise click.ClickException(f"could not create a token: {proc.stderr.strip()}")
    return proc.stdout.strip()


def _start_server(env: dict[str, str], url: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "cpn.cli.server", "serve"], env=env,
                                stdout=fh, stderr=subprocess.STDOUT)
    with Client(url) as client:
        for _ in range(300):
            if proc.poll() is not None:
                raise click.ClickException(f"the server did not start; see {log}")
            try:
                client.get("/healthz")
                return proc
            except ApiError:
                time.sleep(0.1)
    raise click.ClickException(f"the server did not become healthy; see {log}")


def _bar(percent: float, width: int = 30) -> str:
    filled = int(width * percent / 100)
    return "█" * filled + "·" * (width - filled)


def _wait(client: Client, name: str, started: float) -> dict[str, Any]:
    tty = sys.stdout.isatty()
    last = ""
    while True:
        job = client.get(f"/api/v1/jobs/{name}")
        st = job["status"]
        prog = st.get("progress") or {}
        pct = float(prog.get("percent") or 0)
        line = (f"{st['phase']:<10} {_bar(pct)} {pct:5.1f}%  loss {prog.get('loss') or '-':<7} "
                f"sites {st.get('sites') or '-'}  cost {((st.get('cost') or {}).get('total') or '0.00')} USD  "
                f"{time.time() - started:5.0f}s")
        marker = f"{st['phase']} {int(pct // 10)}"
        if tty:
            click.echo("\r" + line, nl=False)
        elif marker != last:
            click.echo(line)
        last = marker
        if st["phase"] in ("Succeeded", "Failed", "Cancelled"):
            if tty:
                click.echo()
            return job
        time.sleep(1.0)


def _summary(client: Client, job: dict[str, Any], wall: float) -> None:
    metrics = client.get(f"/api/v1/jobs/{job['metadata']['name']}/metrics")["items"]
    vals = [m["valLoss"] for m in metrics if m["valLoss"] is not None]
    wan = 0.0
    final_by_rank: dict[int, float] = {}
    for m in metrics:
        final_by_rank[m["rank"]] = max(final_by_rank.get(m["rank"], 0.0), m.get("wanBytes") or 0.0)
    wan = sum(final_by_rank.values())
    invoices = client.get("/api/v1/invoices", job=job["metadata"]["name"])["items"]
    per_provider: dict[str, Decimal] = {}  # each provider's payout: its share of the invoice's total, to the cent
    exact = Decimal(0)  # the lines, before the invoice rounds its total
    for inv in invoices:
        for share in inv["status"]["providers"]:
            per_provider[share["provider"]] = per_provider.get(share["provider"], Decimal(0)) + Decimal(share["total"])
            exact += Decimal(share["subtotal"])
    click.echo("")
    click.echo(f"job {job['metadata']['name']}: {job['status']['phase']} — {job['status'].get('message', '')}")
    if vals:
        click.echo(f"  validation loss   {vals[0]:.3f} → {vals[-1]:.3f}  ({len(vals)} evaluations)")
    click.echo(f"  wall time         {wall:.0f} s (predicted {job['status'].get('predictedSeconds', 0):.0f} s)")
    sites = sorted({p["site"] for p in job["status"].get("placement", [])})
    click.echo(f"  strategy          {job['status'].get('strategy')} over {len(sites)} site{'s' if len(sites) != 1 else ''} ({', '.join(sites)})")
    click.echo(f"  WAN traffic       {wan / 1e9:.4f} GB")
    for provider, amount in sorted(per_provider.items()):
        click.echo(f"  cost {provider:<12} {amount:.2f} USD")
    billed = sum((Decimal(inv["status"]["total"]) for inv in invoices), Decimal(0))  # rounded once, per invoice
    click.echo(f"  cost total        {billed} USD (lines exact to 6 places, the invoice total to the cent)")
    quote = next(iter(client.get(f"/api/v1/jobs/{job['metadata']['name']}/quotes")["items"]), None)
    if quote is not None:
        _quoted_vs_measured(quote, wall, wan / 1e9, exact)


def _quoted_vs_measured(quote: dict[str, Any], wall: float, wan_gb: float, cost: Decimal) -> None:
    """The accepted quote next to the run: how far the compute model was off (it learns from this run)."""
    def ratio(measured: float, predicted: float) -> str:
        return f"{measured / predicted:.2f}×" if predicted else "–"

    # the quote's lines, exact to 6 places like the invoice's (its total is rounded to the cent)
    price = float(sum((Decimal(x["amount"]) for x in quote["price"]["lines"]), Decimal(0))
                  or Decimal(quote["price"]["total"]))
    click.echo("  quoted → measured")
    click.echo(f"    time            {quote['predictedSeconds']:.0f} s → {wall:.0f} s ({ratio(wall, quote['predictedSeconds'])})")
    click.echo(f"    WAN             {quote['wanGB']:.4f} GB → {wan_gb:.4f} GB ({ratio(wan_gb, quote['wanGB'])})")
    click.echo(f"    cost            {price:.4f} → {cost:.4f} USD ({ratio(float(cost), price)}, before rounding)")
    click.echo("  (each finished run corrects later quotes: cpnctl get calibrations)")


@click.command("demo")
@click.option("--tokens", type=int, default=3_000_000, show_default=True, help="Token budget of the demo job.")
@click.option("--model", default="tiny", show_default=True, help="Runtime model preset.")
@click.option("--wan/--no-wan", default=None, help="Each site in its own network namespace behind an emulated "
              "WAN (netns + tbf; default: when root).")
@click.option("--data-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Keep the demo's database and runs here (default: a temporary directory).")
@click.option("--keep", is_flag=True, help="Keep the server and the site agents up after the demo job, for your "
              "own jobs (cpnctl apply -f examples/byo-vision/job.yaml), until Ctrl-C.")
def demo_cmd(tokens: int, model: str, wan: bool | None, data_dir: Path | None, keep: bool) -> None:
    """Run the end-to-end demo: three sites with their agents, quotes, a training job across them, the bill."""
    wan = LocalSites.can_emulate() if wan is None else wan
    if wan and not LocalSites.can_emulate():
        raise click.ClickException("--wan needs root and iproute2 (ip, tc); rerun as root or drop --wan")
    if not wan:
        click.echo("● not root: the site agents share this machine's network (no emulated WAN)")
    temporary = data_dir is None
    data_dir = data_dir or Path(tempfile.mkdtemp(prefix="cpn-demo-"))
    data_dir.mkdir(parents=True, exist_ok=True)
    try:
        _run_demo(data_dir, wan, tokens, model, keep)
    finally:  # also after a failure or Ctrl-C: the files stay either way
        click.echo(files_note(data_dir, temporary))


def files_note(data_dir: Path, temporary: bool) -> str:
    """Where the demo left its files (database, server and agent logs, the sites' runs), how much, and how
    to remove them: the demo keeps them for a look afterwards, and a temporary directory is not emptied
    until the system does it."""
    size = 0
    for folder, _, names in os.walk(data_dir):
        for name in names:
            with contextlib.suppress(OSError):
                size += os.lstat(os.path.join(folder, name)).st_size
    kind = "a temporary directory, kept" if temporary else "--data-dir"
    return (f"● the demo's files (database, server and agent logs, runs: {size / 1e6:.0f} MB) are in {data_dir} "
            f"({kind}); remove them with: rm -rf {shlex.quote(str(data_dir))}")


def _run_demo(data_dir: Path, wan: bool, tokens: int, model: str, keep: bool) -> None:
    port = free_port()
    env = {**os.environ, "CPN_DATA_DIR": str(data_dir), "CPN_PORT": str(port), "CPN_DATABASE_URL":
           f"sqlite+aiosqlite:///{data_dir / 'cpn.db'}", "CPN_HEARTBEAT_TIMEOUT_SECONDS": "30",
           "CPN_RECONCILE_INTERVAL_SECONDS": "1"}
    env.pop("CPN_TOKEN", None)
    tokens_by = {p: _token(env, p, "provider") for p in PROVIDERS}
    user = _token(env, "demo-user", "user")
    clusters = [LocalCluster(f"{site}-cpu", site, tokens_by[provider])
                for provider, sites in PROVIDERS.items() for site in sites]
    links = [(a, b, gbps * 1000) for a, b, gbps, _, _ in LINKS]
    with LocalSites(port, clusters, links, data_dir / "sites", wan=wan) as sites:
        env["CPN_HOST"] = sites.server_host
        server = sites.server_url
        click.echo(f"● starting CPN on {server} (SQLite in {data_dir}; "
                   + ("each site in its own network namespace behind the emulated WAN)" if wan else "no WAN emulation)"))
        proc = _start_server(env, server, data_dir / "server.log")
        try:
            for provider in sorted(PROVIDERS, key=lambda p: p == "alpha-cloud"):  # alpha links to beta's site
                with Client(server, tokens_by[provider]) as client:
                    result = client.post("/api/v1/apply", json={"items": world(provider)})
                    click.echo(f"● {provider} registered " + ", ".join(f"{i['kind'].lower()}/{i['name']}"
                                                                       for i in result["items"]))
            for provider in PROVIDERS:  # ... and beta accepts those links by applying them too
                if consents(provider):
                    with Client(server, tokens_by[provider]) as client:
                        result = client.post("/api/v1/apply", json={"items": consents(provider)})
                        click.echo(f"● {provider} accepted " + ", ".join(f"link/{i['name']}" for i in result["items"]))
            sites.start_all()
            click.echo("● started a site agent per cluster: " + ", ".join(c.name for c in clusters)
                       + f" (logs in {sites.state_root / 'logs'})")
            with Client(server, user) as client:
                _wait_ready(client, len(clusters))
                _run_job(client, tokens, model)
            if keep:
                _hold(server, data_dir, user)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _hold(server: str, data_dir: Path, user: str) -> None:
    """--keep: the server and the site agents stay up for the user's own jobs until Ctrl-C. The
    user's token goes to a 0600 file, never onto a command line."""
    token_file = data_dir / "demo-user.token"
    token_file.touch(mode=0o600)
    token_file.write_text(user + "\n")
    click.echo(f"● the demo world stays up until Ctrl-C: server {server}, data in {data_dir}\n"
               f"  export CPN_SERVER={server} CPN_TOKEN=$(cat {token_file})\n"
               "  cpnctl apply -f examples/byo-vision/job.yaml && cpnctl accept byo-vision && cpnctl wait byo-vision")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        click.echo("● stopping the demo world")


def _wait_ready(client: Client, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [c for c in client.get("/api/v1/clusters")["items"]
                 if any(x["type"] == "Ready" and x["status"] == "True" for x in c["status"].get("conditions", []))]
        if len(ready) >= count:
            return
        time.sleep(0.5)
    raise click.ClickException(f"the site agents did not report in {timeout:.0f} s; see their logs")


def _wait_quoted(client: Client, name: str) -> None:
    """spec.profile: the job times a few of its own steps on one site before it is quoted."""
    started, said = time.monotonic(), False
    while True:
        status = client.get(f"/api/v1/jobs/{name}")["status"]
        if status["phase"] != "Profiling":
            break
        if not said:
            click.echo("● profiling: the job times its own first steps on one site, so the quotes rest on this "
                       "machine's measured speed, not only on the model")
            said = True
        time.sleep(0.5)
    if status["phase"] != "Quoted":
        raise click.ClickException(f"the demo job ended {status['phase']} before its quotes: {status.get('message')}")
    profile = status.get("profile") or {}
    if profile.get("measuredStepSeconds"):
        click.echo(f"● profiled in {time.monotonic() - started:.0f} s: {profile['measuredStepSeconds']:.3f} s per step "
                   f"on {profile.get('site', 'one site')}")


def _run_job(client: Client, tokens: int, model: str) -> None:
    job = client.post("/api/v1/jobs", json=job_manifest(tokens, model))
    name = job["metadata"]["name"]
    click.echo(f"● submitted trainingjob/{name}: {job['status']['phase']}")
    _wait_quoted(client, name)
    quotes = client.get(f"/api/v1/jobs/{name}/quotes")
    kinds = {k["kind"]: k for k in client.get("/api/v1/kinds")["items"]}
    click.echo(output.table(quotes["items"], kinds["Quote"]["columns"]))
    started = time.time()
    accepted = client.post(f"/api/v1/jobs/{name}/accept", json={"quote": "balanced"})
    click.echo(f"● accepted the balanced quote: {accepted['status']['phase']}, "
               f"{accepted['status'].get('strategy')} over " + ", ".join(
                   f"{lease['gpus']}×{lease['cluster']}" for lease in accepted["status"].get("leases", [])))
    final = _wait(client, name, started)
    _summary(client, final, time.time() - started)
    if final["status"]["phase"] != "Succeeded":
        raise click.ClickException(f"the demo job ended {final['status']['phase']}: {final['status'].get('message')}")


