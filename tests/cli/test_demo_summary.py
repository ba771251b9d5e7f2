"""`cpn demo`'s summary: each provider's cost is its payout (its share of the invoice's total to the cent),
so the providers' lines add up to the total the user pays — not each provider's lines rounded on their own."""

from __future__ import annotations

from typing import Any

from cpn.cli import demo


class FakeClient:
    def get(self, path: str, **params: Any) -> dict[str, Any]:
        if path.endswith("/metrics"):
            return {"items": [{"rank": 0, "valLoss": 5.3, "wanBytes": 1e6}, {"rank": 0, "valLoss": 1.9, "wanBytes": 2e6}]}
        if path == "/api/v1/invoices":
            lines = [{"provider": "alpha-cloud", "amount": "0.004500"}, {"provider": "beta-dc", "amount": "0.004000"}]
            providers = [{"provider": "alpha-cloud", "subtotal": "0.004500", "total": "0.01"},
                         {"provider": "beta-dc", "subtotal": "0.004000", "total": "0.00"}]
            return {"items": [{"status": {"lines": lines, "providers": providers, "total": "0.01"}}]}
        return {"items": []}  # no quote: the quoted-vs-measured part is skipped


def test_the_providers_costs_add_up_to_the_total(capsys) -> None:  # type: ignore[no-untyped-def]
    job = {"metadata": {"name": "demo-lm"}, "status": {"phase": "Succeeded", "placement": [], "strategy": "diloco"}}
    demo._summary(FakeClient(), job, wall=30.0)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "cost alpha-cloud  0.01 USD" in out and "cost beta-dc      0.00 USD" in out, out  # each alone: 0.00 + 0.00
    assert "cost total        0.01 USD" in out, out
