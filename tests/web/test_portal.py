"""The web portal: served by the API, talks only to endpoints the API documents, and drives a real
job from the form to the live chart in a headless Chromium."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from cpn.core.db import Database
from tests.api.test_resource import cluster, site
from tests.conftest import LiveServer, make_token, start_server, stop_server

if TYPE_CHECKING:
    from playwright.sync_api import Page

WEB = Path(__file__).resolve().parents[2] / "web"
CHROMIUM = "/usr/bin/chromium"
API_STRING = re.compile(r"""["'`](/api/v1/[^"'`]*)["'`]""")


def referenced_endpoints(source: str) -> set[tuple[str, str]]:
    """(method, path) for every '/api/v1/...' literal in the script; `${…}` becomes one path segment."""
    found = set()
    for line in source.splitlines():
        method = re.search(r"""method:\s*["'](\w+)["']""", line)
        for literal in API_STRING.findall(line):
            path = re.sub(r"\$\{[^}]*\}", "X", literal).split("?", 1)[0]
            found.add(((method.group(1) if method else "GET").lower(), path))
    return found


def template_regex(template: str) -> re.Pattern[str]:
    return re.compile("^" + re.sub(r"\\\{[^}]*\\\}", "[^/]+", re.escape(template)) + "$")


def test_endpoint_parser_reads_template_literals() -> None:
    js = 'api(`/api/v1/jobs/${enc(name)}/accept`, { method: "POST" });\nfetch("/api/v1/events?job=" + x);'
    assert referenced_endpoints(js) == {("post", "/api/v1/jobs/X/accept"), ("get", "/api/v1/events")}
    assert template_regex("/api/v1/jobs/{name}/quotes").match("/api/v1/jobs/X/quotes")
    assert not template_regex("/api/v1/jobs/{name}").match("/api/v1/jobs/X/quotes")


async def test_index_and_assets_are_served(api) -> None:
    for path in ("/", "/ui"):
        resp = await api.client.get(path)
        assert resp.status == 200
        assert resp.content_type == "text/html"
        html = await resp.text()
        assert '<script type="module" src="/ui/static/app.js">' in html
        assert 'href="/ui/static/style.css"' in html
    js = await api.client.get("/ui/static/app.js")
    assert js.status == 200 and js.content_type in ("text/javascript", "application/javascript")
    css = await api.client.get("/ui/static/style.css")
    assert css.status == 200 and css.content_type == "text/css"
    assert "prefers-color-scheme: dark" in await css.text()


async def test_script_uses_only_documented_endpoints(api) -> None:
    spec = await (await api.client.get("/api/v1/openapi.json")).json()
    documented = [(template_regex(path), set(ops)) for path, ops in spec["paths"].items()]
    used = referenced_endpoints((WEB / "app.js").read_text())
    assert {p for _, p in used} >= {"/api/v1/whoami", "/api/v1/top/sites", "/api/v1/jobs",
                                     "/api/v1/jobs/X/metrics", "/api/v1/jobs/X/quotes", "/api/v1/invoices"}
    missing = [(m, p) for m, p in used if not any(rx.match(p) and m in ops for rx, ops in documented)]
    assert not missing, f"app.js calls endpoints the API does not document: {missing}"


def test_script_never_writes_raw_html() -> None:
    source = (WEB / "app.js").read_text()
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert source.count(sink) == 0, f"app.js uses {sink}; build nodes with el()/svg() and textContent"
    for name in ("index.html", "app.js", "style.css"):
        text = (WEB / name).read_text()
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), f"{name} loads something external"


# ---------------------------------------------------------------- the browser


def _browser_missing() -> str | None:
    if importlib.util.find_spec("playwright") is None:
        return "playwright is not installed (pip install playwright)"
    if not Path(CHROMIUM).exists() and not shutil.which("chromium"):
        return f"{CHROMIUM} is missing (apt-get install -y chromium)"
    return None


async def _tokens(db_url: str) -> tuple[str, str]:
    """Straight into the database: `LiveServer.token` would start the CLI twice (~10 s each here)."""
    db = Database(db_url)
    try:
        return await make_token(db, "prov-a", "provider"), await make_token(db, "alice", "user")
    finally:
        await db.dispose()


@pytest.fixture
def portal_world(db_url: str, tmp_path: Path) -> Iterator[tuple[LiveServer, str]]:
    """A live server with one provider's site and cluster, heartbeating, and a user token."""
    provider, user = asyncio.run(_tokens(db_url))
    server = start_server(db_url, tmp_path)
    try:
        headers = {"Authorization": f"Bearer {provider}"}
        docs = [site("fra-1"), cluster("fra-cpu", "fra-1", gpus_per_node=2, nodes=1, price="0.90")]
        resp = httpx.post(f"{server.url}/api/v1/apply", json={"items": docs}, headers=headers, timeout=30)
        assert resp.status_code == 200, resp.text
        resp = httpx.post(f"{server.url}/api/v1/clusters/fra-cpu/heartbeat", headers=headers, timeout=30,
                          json={"allocatableGpus": 2, "conditions": [{"type": "Ready", "status": "True"}]})
        assert resp.status_code == 200, resp.text
        yield server, user
    finally:
        stop_server(server)


needs_browser = pytest.mark.skipif(_browser_missing() is not None, reason=_browser_missing() or "")


@contextmanager
def signed_in(server: LiveServer, token: str) -> Iterator[Page]:
    """A headless Chromium page on the portal, signed in through the form, failing on any script error."""
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--headless"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            page.set_default_timeout(30_000)
            expect.set_options(timeout=20_000)  # pricing a job takes seconds on a loaded CI machine
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{server.url}/ui")
            page.get_by_label("API token").fill(token)
            page.get_by_role("button", name="Sign in").click()
            expect(page.locator("#who-name")).to_have_text("alice")
            yield page
            assert not errors, errors
        finally:
            browser.close()


def submit_and_accept(page: Page, name: str) -> None:
    """Overview → Jobs → New job → three quotes → accept balanced → the job's page."""
    from playwright.sync_api import expect

    expect(page.get_by_role("cell", name="fra-cpu", exact=True)).to_be_visible()
    page.get_by_role("link", name="Jobs", exact=True).click()
    page.get_by_role("link", name="New job").click()
    page.get_by_label("Name", exact=True).fill(name)
    page.get_by_label("Tokens", exact=True).fill("30000")
    page.get_by_label("GPUs max", exact=True).fill("1")
    page.get_by_label("Sites max", exact=True).fill("1")
    page.get_by_role("button", name="Get quotes").click()
    expect(page.locator("article.quote")).to_have_count(3)
    for label in ("cheapest", "fastest", "balanced"):
        expect(page.locator(f'article.quote[data-label="{label}"] .price')).to_contain_text("USD")
    page.get_by_role("button", name="Accept the balanced quote").click()
    page.wait_for_url(f"**/ui#/jobs/{name}")


@needs_browser
def test_user_submits_accepts_and_sees_the_job_page(portal_world: tuple[LiveServer, str]) -> None:
    from playwright.sync_api import expect

    server, user = portal_world
    with signed_in(server, user) as page:
        page.goto(f"{server.url}/ui#/jobs/new")
        page.get_by_label("GPUs min", exact=True).fill("50")
        page.get_by_label("GPUs max", exact=True).fill("60")
        page.get_by_role("button", name="Get quotes").click()
        expect(page.locator("#new-job + div .error")).to_contain_text("no placement")
        expect(page.locator("#new-job + div .error code")).to_have_text("spec.gpus.min")
        expect(page.get_by_label("GPUs min", exact=True)).to_have_attribute("aria-invalid", "true")

        page.goto(f"{server.url}/ui#/overview")
        submit_and_accept(page, "portal-job")
        expect(page.locator("#phase .badge")).to_have_text(re.compile(r"Accepted|Reserved|Launching|Running|Succeeded"))
        expect(page.locator("svg#loss-chart")).to_be_visible()
        expect(page.get_by_role("progressbar", name="job progress")).to_be_visible()
        expect(page.get_by_role("cell", name="Submitted", exact=True)).to_be_visible()

        page.get_by_role("button", name="Sign out").click()
        expect(page.get_by_label("API token")).to_be_visible()
        assert page.evaluate("localStorage.getItem('cpn.token')") is None
        page.get_by_label("API token").fill("not-a-token")
        page.get_by_role("button", name="Sign in").click()
        expect(page.get_by_role("alert").filter(has_text="token")).to_be_visible()


@needs_browser
@pytest.mark.slow
def test_live_chart_follows_the_run_to_a_trained_model(portal_world: tuple[LiveServer, str],
                                                       tmp_path: Path) -> None:
    from playwright.sync_api import expect

    server, user = portal_world
    with signed_in(server, user) as page:
        submit_and_accept(page, "portal-run")
        expect(page.locator("svg#loss-chart polyline.train")).to_have_attribute(
            "points", re.compile(r"\d,\d+(\.\d+)?\s+\d"), timeout=300_000)
        expect(page.locator("#phase .badge")).to_have_text("Succeeded", timeout=300_000)
        expect(page.locator("svg#loss-chart polyline.val")).to_have_attribute("points", re.compile(r"\d"))
        expect(page.locator("svg#speed-chart")).to_be_visible()
        page.get_by_role("link", name="Invoices").click()
        expect(page.get_by_role("heading", name=re.compile(r"^portal-run — \d+\.\d\d USD$"))).to_be_visible()
        page.screenshot(path=str(tmp_path / "portal-invoices.png"), full_page=True)
