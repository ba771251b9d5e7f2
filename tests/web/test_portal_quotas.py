"""The portal's Invoices page shows a user the quotas that bind them, each limit against what it counts
(issue 31, item 2: "the portal shows the same on the user's page")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from cpn.core.db import Database
from tests.conftest import make_token, start_server, stop_server
from tests.web.test_portal import needs_browser, signed_in


async def _tokens(db_url: str) -> tuple[str, str]:
    db = Database(db_url)
    try:
        return await make_token(db, "root", "admin"), await make_token(db, "alice", "user")
    finally:
        await db.dispose()


@pytest.mark.slow
@needs_browser
def test_the_invoices_page_lists_the_quotas_binding_the_user(db_url: str, tmp_path: Path) -> None:
    from playwright.sync_api import expect

    admin, user = asyncio.run(_tokens(db_url))
    server = start_server(db_url, tmp_path)
    try:
        body = {"apiVersion": "cpn/v1", "kind": "Quota", "metadata": {"name": "alice-cap"},
                "spec": {"account": "alice", "maxGpus": 8, "spendPerMonth": "250"}}
        resp = httpx.post(f"{server.url}/api/v1/quotas", json=body, headers={"Authorization": f"Bearer {admin}"},
                          timeout=30)
        assert resp.status_code == 201, resp.text
        with signed_in(server, user) as page:
            page.get_by_role("link", name="Invoices").click()
            region = page.get_by_role("region", name="Quotas")
            expect(region).to_be_visible()
            rows = region.locator("tbody tr")
            expect(rows).to_have_count(2)
            expect(rows.nth(0)).to_contain_text("alice-cap")
            expect(rows.nth(0)).to_contain_text("maxGpus")
            expect(rows.nth(0).locator('td[data-label="Of"]')).to_have_text("8")
            expect(rows.nth(1).locator('td[data-label="Of"]')).to_have_text("250 USD")
            expect(rows.nth(1).locator('td[data-label="Used"]')).to_have_text("0.00")
            expect(page.get_by_text("No invoices yet.")).to_be_visible()
    finally:
        stop_server(server)
