"""Job verbs: accept a quote, cancel, wait with a progress bar, logs, top, and run (apply + accept + follow)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import click

from cpn.cli.ctl import output
from cpn.cli.ctl.commands.resources import OUTPUT, apply_documents, read_documents
from cpn.cli.ctl.context import Ctx, pass_ctx
from cpn.cli.ctl.main import cli
from cpn.client import ApiError
from cpn.core.phases import JOB_TERMINAL


@cli.command()
@click.argument("job")
@click.option("--quote", "quote", default="balanced", show_default=True,
              help="Quote id or label: cheapest | fastest | balanced.")
@OUTPUT
@pass_ctx
def accept(obj: Ctx, job: str, quote: str, fmt: str) -> None:
    """Accept a quote for JOB: signs the contract and reserves the GPUs."""
    result = accept_quote(obj, job, quote)
    if fmt in ("json", "yaml"):
        click.echo(output.dump(result, fmt))
        return
    click.echo(accepted_line(job, quote, result))


def accept_quote(obj: Ctx, job: str, quote: str) -> dict[str, Any]:
    """POST …/accept; a quote JOB does not have is one line with the labels it has."""
    try:
        return obj.client.post(f"/api/v1/jobs/{obj.ref(job)}/accept", json={"quote": quote})
    except ApiError as exc:
        if exc.status == 404 and exc.field == "quote":
            raise click.ClickException(_no_such_quote(obj, job, quote)) from exc
        raise


def accepted_line(job: str, quote: str, result: dict[str, Any]) -> str:
    leases = ", ".join(f"{lease['gpus']}×{lease['cluster']}" for lease in result["status"].get("leases", []))
    price = result["status"].get("price", {})
    return (f"trainingjob/{job} accepted ({quote}): {result['status']['phase']}; leased {leases}; "
            f"quoted {price.get('total')} {price.get('currency')}")


def _no_such_quote(obj: Ctx, job: str, quote: str) -> str:
    """The refusal with the labels JOB's open quotes go by, so the user need not run `get quotes`."""
    items = obj.client.get(f"/api/v1/jobs/{obj.ref(job)}/quotes").get("items", [])
    labels = [q["label"] for q in items if q.get("state") == "open"]
    if not labels:
        return f"job {job!r} has no open quote {quote!r}: it has no open quotes (see `cpnctl get quotes {job}`)"
    return f"job {job!r} has no open quote {quote!r}: use one of {', '.join(labels)} (or a quote id)"


TERMINAL = JOB_TERMINAL
WAITING_FOR_USER = {  # phases that never move on by themselves: waiting would wait forever
    "Quoted": "{job} is Quoted and waits for you: accept a quote first: cpnctl accept {job} --quote balanced "
              "(see the options with `cpnctl get quotes {job}`)",
}


@cli.command()
@click.argument("job")
@pass_ctx
def cancel(obj: Ctx, job: str) -> None:
    """Cancel JOB: stops its workers and releases its GPUs."""
    result = obj.client.post(f"/api/v1/jobs/{obj.ref(job)}/cancel")
    click.echo(f"trainingjob/{job} {result['status']['phase'].lower()}")


@cli.command()
@click.argument("job")
@click.option("--site", default=None, help="Only this site's (or cluster's) workers.")
@click.option("-f", "--follow", is_flag=True,
              help="Stream every attempt's lines as they come (\"--- attempt N ---\" starts each) until the job ends.")
@click.option("--rank", type=click.IntRange(min=0), default=None, help="Only this global rank.")
@click.option("--attempt", type=click.IntRange(min=1), default=None,
              help="This attempt [the current one]; with -f, from this attempt on.")
@click.option("--tail", type=click.IntRange(min=0), default=None,
              help="Only the last N lines [all of them].")
@pass_ctx
def logs(obj: Ctx, job: str, site: str | None, follow: bool, rank: int | None, attempt: int | None,
         tail: int | None) -> None:
    """Print every rank's output of JOB, as the site agents shipped it: all lines of the current
    attempt (or --attempt N), or with -f, every attempt's lines as they come until the job ends."""
    if follow:  # following a job that waits for its user would sit there silently: say what it waits for
        phase = obj.client.get(f"/api/v1/jobs/{obj.ref(job)}")["status"].get("phase")
        if phase in WAITING_FOR_USER:
            click.echo(f"{job} is {phase}: no worker runs until a quote is accepted (cpnctl accept {job} --quote "
                       "balanced); following from its first attempt, Ctrl-C to stop", err=True)
    for line in stream_logs(obj, job, site=site, follow=follow, rank=rank, attempt=attempt, tail=tail):
        click.echo(line)


def stream_logs(obj: Ctx, job: str, *, follow: bool, site: str | None = None, rank: int | None = None,
                attempt: int | None = None, tail: int | None = None) -> Iterator[str]:
    """JOB's log lines as the server sends them; with `follow`, until the job ends."""
    params = {"site": site, "follow": "1" if follow else None, "rank": rank, "attempt": attempt, "tail": tail}
    yield from obj.client.stream_lines(f"/api/v1/jobs/{obj.ref(job)}/logs",
                                       params={k: v for k, v in params.items() if v is not None})


@cli.command()
@click.argument("job")
@click.option("--timeout", type=click.FloatRange(min=0), default=0,
              help="Give up after this many seconds (0: never).")
@click.option("--interval", type=click.FloatRange(min=0.1), default=1.0, show_default=True,
              help="Seconds between two looks at the job.")
@pass_ctx
def wait(obj: Ctx, job: str, timeout: float, interval: float) -> None:
    """Wait for JOB to finish, with a live progress bar (on a terminal; elsewhere a line at each phase and
    every 10 %); exit 1 unless it Succeeded, or at once when it waits for you (Quoted: accept a quote)."""
    manifest = obj.client.get(f"/api/v1/jobs/{obj.ref(job)}")
    if manifest["status"].get("phase") in WAITING_FOR_USER:
        raise click.ClickException(WAITING_FOR_USER[manifest["status"]["phase"]].format(job=job))
    currency = job_currency(manifest)
    statuses = _until_done(obj, job, timeout, interval)
    if click.get_text_stream("stdout").isatty():
        with click.progressbar(length=1000, label=job, show_percent=True, show_eta=False,
                               item_show_func=lambda s: s) as bar:
            done = 0
            for st in statuses:
                target = int(10 * float((st.get("progress") or {}).get("percent") or 0))
                bar.update(max(0, target - done), _progress_text(st, currency))
                done = max(done, target)
    else:  # a pipe, a CI log: no bar to redraw, so a line whenever the phase or the tens of percent move
        lines = ProgressLines(job, currency)
        for st in statuses:
            lines.show(st)
    report_end(obj, job)


def job_currency(manifest: dict[str, Any]) -> str:
    """The job's currency before the first metrics bring status.cost (a job is billed in spec.currency)."""
    return ((manifest.get("spec") or {}).get("currency") or ((manifest.get("status") or {}).get("price") or {}).get(
        "currency") or "USD")


def report_end(obj: Ctx, job: str) -> None:
    """The ended job's phase and message; exit 1 (a ClickException) unless it Succeeded."""
    st = obj.client.get(f"/api/v1/jobs/{obj.ref(job)}")["status"]
    click.echo(f"trainingjob/{job} {st['phase']}: {st.get('message', '')}")
    if st["phase"] != "Succeeded":
        raise click.ClickException(f"{job} ended {st['phase']}")


class ProgressLines:
    """A line whenever the phase or the tens of percent move: for a pipe or a CI log, where no bar can be
    redrawn, and beside the logs of `run --follow` (on stderr there)."""

    def __init__(self, job: str, currency: str, *, err: bool = False):
        self.job, self.currency, self.err = job, currency, err
        self.said: tuple[str, int] | None = None

    def show(self, st: dict[str, Any]) -> None:
        mark = (st["phase"], int(float((st.get("progress") or {}).get("percent") or 0)) // 10)
        if mark != self.said:
            click.echo(f"{self.job}: {_progress_text(st, self.currency, percent=True)}", err=self.err)
            self.said = mark


def _until_done(obj: Ctx, job: str, timeout: float, interval: float) -> Iterator[dict[str, Any]]:
    """The job's status every ``interval`` seconds, the last one terminal; a ClickException after ``timeout``,
    or as soon as the job waits for its user (a profile run ends Quoted: it would wait forever)."""
    start = time.monotonic()
    while True:
        st = obj.client.get(f"/api/v1/jobs/{obj.ref(job)}")["status"]
        yield st
        if st["phase"] in TERMINAL:
            return
        if st["phase"] in WAITING_FOR_USER:
            raise click.ClickException(WAITING_FOR_USER[st["phase"]].format(job=job))
        if timeout and time.monotonic() - start > timeout:
            raise click.ClickException(f"{job} still {st['phase']} after {timeout:g}s")
        time.sleep(interval)


def _progress_text(st: dict[str, Any], currency: str, *, percent: bool = False) -> str:
    prog, cost = st.get("progress") or {}, st.get("cost") or {}
    share = f" {float(prog.get('percent') or 0):.0f}%" if percent else ""
    return (f"{st['phase']}{share} loss {prog.get('loss') or '-'} "
            f"cost {cost.get('total') or '0.00'} {cost.get('currency') or currency}")


@cli.command()
@click.argument("what", type=click.Choice(["sites", "links", "job"]))
@click.argument("name", required=False)
@OUTPUT
@pass_ctx
def top(obj: Ctx, what: str, name: str | None, fmt: str) -> None:
    """Live usage: per site (GPUs capacity / allocatable / leased, running sub-tasks), per link
    (bandwidth, RTT, how many running jobs span both of its ends), or a job's run (`top job NAME`:
    its newest step, tokens, loss, throughput and WAN bytes, exact at any length)."""
    if what == "job":
        _top_job(obj, name, fmt)
        return
    if name:
        raise click.UsageError(f"top {what} takes no NAME (top job NAME shows one job)")
    data = obj.client.get(f"/api/v1/top/{what}")
    if fmt in ("json", "yaml"):
        click.echo(output.dump(data, fmt))
        return
    if not data["items"]:
        click.echo(f"No {what} found.", err=True)
        return
    if what == "links":
        rows = [[i["metadata"]["name"], str(i.get("a", "-")), str(i.get("b", "-")), _number(i.get("bandwidthGbps")),
                 _number(i.get("rttMs")), str(i.get("jobs", 0))] for i in data["items"]]
        click.echo(output.format_rows(["LINK", "A", "B", "BANDWIDTH GBPS", "RTT MS", "JOBS"], rows))
        return
    rows = [[i["metadata"]["name"], i["region"], i["provider"], f"{i['ready']}/{i['clusters']}",
             str(i["capacity"]), str(i["allocatable"]), str(i["leased"]), i["utilization"], str(i["running"])]
            for i in data["items"]]
    click.echo(output.format_rows(["SITE", "REGION", "PROVIDER", "READY", "CAPACITY", "ALLOCATABLE", "LEASED",
                                   "UTIL", "RUNNING"], rows))


def _top_job(obj: Ctx, name: str | None, fmt: str) -> None:
    if not name:
        raise click.UsageError("top job needs the job's NAME: cpnctl top job NAME")
    data = obj.client.get(f"/api/v1/jobs/{obj.ref(name)}/metrics", maxPoints=16, maxReports=0)
    if fmt in ("json", "yaml"):
        click.echo(output.dump({"totals": data["totals"], "series": data["series"]}, fmt))
        return
    totals, points = data["totals"], data["series"]["points"]
    if totals["step"] is None:
        click.echo(f"{name}: no metric reports yet.", err=True)
        return
    newest = points[-1]

    def mean(key: str) -> str:
        return f"{newest[key]['mean']:.4g}" if newest.get(key) else "-"

    val = next((p["valLoss"]["mean"] for p in reversed(points) if p.get("valLoss")), None)
    row = [name, str(totals["attempt"]), str(totals["step"]), str(totals["tokens"]), mean("trainLoss"),
           "-" if val is None else f"{val:.4g}", mean("tokensPerSecond"), str(totals["workers"]),
           f"{totals['wallSeconds']:.0f}s", f"{totals['wanBytes'] / 1e9:.3f}"]
    click.echo(output.format_rows(["JOB", "ATTEMPT", "STEP", "TOKENS", "LOSS", "VAL LOSS", "TOKENS/S", "WORKERS",
                                   "TIME", "WAN GB"], [row]))


def _number(value: Any) -> str:
    return "-" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


@cli.command()
@click.argument("source")
@click.argument("dest", type=click.Path(dir_okay=False, writable=True))
@pass_ctx
def cp(obj: Ctx, source: str, dest: str) -> None:
    """Download a job's artefact: cpnctl cp job/NAME:final ./model.pt (the final weights, a torch state_dict)."""
    kind, _, rest = source.partition("/")
    name, _, what = rest.partition(":")
    if kind not in ("job", "jobs", "trainingjob", "tj") or not name or what != "final":
        raise click.UsageError(f"cannot copy {source!r}: the source is job/NAME:final")
    target = Path(dest)
    folder = target.parent
    if not folder.is_dir():  # one line naming the folder, never the .part file written before the rename
        raise click.ClickException(f"{folder}: no such directory" if not folder.exists() else f"{folder}: not a directory")
    partial = target.with_name(target.name + ".part")
    try:
        fh = partial.open("wb")
    except OSError as exc:
        raise click.ClickException(f"{target}: cannot write: {(exc.strerror or str(exc)).lower()}") from exc
    stderr = click.get_text_stream("stderr")
    # a bar on a terminal only: elsewhere (a pipe, a CI log) click would print its label as a stray line
    bar = click.progressbar(length=1, label=f"{name}:final", show_eta=False, file=stderr) if stderr.isatty() else None
    with fh, bar if bar is not None else contextlib.nullcontext():
        def progress(done: int, total: int) -> None:
            if bar is not None:
                bar.length = max(total, done, 1)
                bar.update(done - bar.pos)

        try:
            size = obj.client.download(f"/api/v1/jobs/{obj.ref(name)}/final", fh, progress)
        except BaseException:
            fh.close()
            partial.unlink(missing_ok=True)
            raise
    partial.replace(target)  # never a half-written model under the user's name
    click.echo(f"job/{name}:final → {target} ({size:,} bytes)")


QUOTE_LABELS = ("cheapest", "fastest", "balanced")
BEFORE_QUOTES = {"Pending", "Profiling"}  # phases that move on to Quoted by themselves


@cli.command()
@click.option("-f", "--filename", "source", required=True,
              help="A YAML/JSON file with one TrainingJob (and whatever it uses, e.g. its Dataset), or - for stdin.")
@click.option("--quote", type=click.Choice(QUOTE_LABELS), default="balanced", show_default=True,
              help="The offer to accept: balanced is the one `get quotes` recommends and `accept` takes by default.")
@click.option("--max-price", "max_price", default=None, metavar="AMOUNT",
              help="Accept only if that quote's total is at most AMOUNT in the job's currency; otherwise exit 1 "
                   "and leave the job Quoted.")
@click.option("--follow", is_flag=True, help="Then show progress (stderr) and the workers' logs (stdout) until "
                                             "the job ends; exit 0 if it Succeeded, 1 otherwise.")
@click.option("--interval", type=click.FloatRange(min=0.1), default=2.0, show_default=True,
              help="Seconds between two looks at the job (while it is quoted and while following).")
@pass_ctx
def run(obj: Ctx, source: str, quote: str, max_price: str | None, follow: bool, interval: float) -> None:
    """Submit the job in FILE, accept its --quote offer within --max-price, and with --follow stay with it to
    the end: `apply`, `accept` and `logs -f` plus progress in one command."""
    cap = _amount(max_price) if max_price is not None else None
    docs = read_documents(source)
    jobs = [d for d in docs if obj.kind(str(d.get("kind") or ""))["kind"] == "TrainingJob"] if docs else []
    if len(jobs) != 1:
        raise click.ClickException(f"{source}: cpnctl run takes one TrainingJob, found {len(jobs)} (apply the "
                                   "others with cpnctl apply -f)")
    result = apply_documents(obj, docs, source)
    for item in result["items"]:
        click.echo(f"{item['kind'].lower()}/{item['name']} {item['action']}")
    applied = next(i for i in result["items"] if i["kind"] == "TrainingJob")
    name = applied["name"]
    manifest = _quoted(obj, name, interval)
    phase = manifest["status"]["phase"]
    if phase in TERMINAL and applied["action"] != "unchanged":  # a profile run that failed, say
        raise click.ClickException(f"{name} ended {phase} before it was quoted: "
                                   f"{manifest['status'].get('message') or 'see cpnctl describe job ' + name}")
    if phase in TERMINAL:
        raise click.ClickException(f"{name} already ended {phase}, nothing new was run: to run it again delete it "
                                   f"(cpnctl delete job {name}) or give the manifest a new metadata.name")
    if phase == "Quoted":
        offer = _offer(obj, name, quote, cap)
        click.echo(accepted_line(name, quote, accept_quote(obj, name, offer["id"])))
    else:  # applied before and accepted then: `apply` left it as it was ("unchanged")
        click.echo(f"trainingjob/{name} was accepted before and is {phase}: no quote accepted now", err=True)
    if not follow:
        click.echo(f"follow it: cpnctl wait {name}; cpnctl logs {name} -f", err=True)
        return
    _follow(obj, name, job_currency(manifest), interval)
    report_end(obj, name)


def _amount(text: str) -> Decimal:
    try:
        value = Decimal(text)
    except InvalidOperation:
        value = Decimal("NaN")
    if not value.is_finite() or value < 0:
        raise click.ClickException(f"--max-price {text!r}: give an amount such as 2.50 (in the job's currency)")
    return value


def _quoted(obj: Ctx, job: str, interval: float) -> dict[str, Any]:
    """JOB once it is past being planned or profiled (Quoted, or any later phase)."""
    told = False
    while True:
        manifest = obj.client.get(f"/api/v1/jobs/{obj.ref(job)}")
        phase = manifest["status"].get("phase")
        if phase not in BEFORE_QUOTES:
            return manifest
        if not told:
            click.echo(f"{job} is {phase}: waiting for its quotes", err=True)
            told = True
        time.sleep(interval)


def _offer(obj: Ctx, job: str, label: str, cap: Decimal | None) -> dict[str, Any]:
    """JOB's open quote labelled `label`, refused in one line when its total is above `cap`."""
    quotes = [q for q in obj.client.get(f"/api/v1/jobs/{obj.ref(job)}/quotes").get("items", [])
              if q.get("state") == "open"]
    offer = next((q for q in quotes if q.get("label") == label), None)
    if offer is None:
        raise click.ClickException(_no_such_quote(obj, job, label))
    total, currency = Decimal(str(offer["price"]["total"])), offer["price"].get("currency", "")
    if cap is None or total <= cap:
        return offer
    cheaper = [q for q in quotes if Decimal(str(q["price"]["total"])) <= cap]
    instead = (f"the {cheaper[0]['label']} quote costs {cheaper[0]['price']['total']} {currency}: "
               f"--quote {cheaper[0]['label']}" if cheaper else "raise --max-price or ask for less (spec.tokens, "
               "spec.budget)")
    raise click.ClickException(f"{job}: the {label} quote costs {total} {currency}, above --max-price {cap} "
                               f"{currency}: not accepted, the job stays Quoted ({instead}; all offers: "
                               f"cpnctl get quotes {job})")


def _follow(obj: Ctx, job: str, currency: str, interval: float) -> None:
    """The job's logs on stdout as they come (the main thread) and a progress line on stderr whenever its
    phase or tens of percent move (a thread with its own client), until the job ends."""
    stop = threading.Event()
    watcher = obj.new_client()
    lines = ProgressLines(job, currency, err=True)

    def progress() -> None:
        try:
            while not stop.is_set():
                st = watcher.get(f"/api/v1/jobs/{obj.ref(job)}")["status"]
                lines.show(st)
                if st["phase"] in TERMINAL:
                    return
                stop.wait(interval)
        except ApiError:  # a lost server: the log stream in the main thread says so
            return
        finally:
            watcher.close()

    thread = threading.Thread(target=progress, name="cpnctl-progress", daemon=True)
    thread.start()
    try:
        for line in stream_logs(obj, job, follow=True):
            click.echo(line)
        for _ in _until_done(obj, job, 0, interval):  # the stream ends with the job; should it end early, wait
            pass
    except KeyboardInterrupt:
        click.echo(f"stopped following; {job} goes on (cpnctl wait {job}, cpnctl logs {job} -f, cpnctl cancel {job})",
                   err=True)
        raise
    finally:
        stop.set()
        thread.join(timeout=30)
