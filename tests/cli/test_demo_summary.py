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


class QuotedClient(FakeClient):
    def get(self, path: str, **params: Any) -> dict[str, Any]:
        if path.endswith("/quotes"):
            lines = [{"provider": "alpha-cloud", "amount": "0.008000"}, {"provider": "beta-dc", "amount": "0.006000"}]
            return {"items": [{"predictedSeconds": 48.0, "wanGB": 0.0094, "price": {"total": "0.01", "lines": lines}}]}
        return super().get(path, **params)


def test_the_quote_is_compared_at_its_exact_price_not_the_cent_it_shows(capsys) -> None:  # type: ignore[no-untyped-def]
    """The quote's total is rounded to the cent (0.014 shows 0.01); the measured cost is the invoice's lines
    before rounding, so the quoted side is its lines too: 0.0140 → 0.0085, not 0.0100 → 0.0085."""
    job = {"metadata": {"name": "demo-lm"}, "status": {"phase": "Succeeded", "placement": [], "strategy": "diloco"}}
    demo._summary(QuotedClient(), job, wall=60.0)  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "time            48 s → 60 s (1.25×)" in out, out
    assert "cost            0.0140 → 0.0085 USD (0.61×, before rounding)" in out, out


class ProfilingClient:
    def __init__(self, phases: list[str]) -> None:
        self.phases = phases

    def get(self, path: str, **params: Any) -> dict[str, Any]:
        phase = self.phases.pop(0) if len(self.phases) > 1 else self.phases[0]
        profile = {"measuredStepSeconds": 0.0847, "site": "nyc-1"} if phase == "Quoted" else None
        return {"status": {"phase": phase, "profile": profile, "message": "no agent claimed the profile"}}


def test_the_demo_waits_out_its_profile_and_says_what_it_measured(capsys, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import click
    import pytest

    monkeypatch.setattr(demo.time, "sleep", lambda s: None)
    demo._wait_quoted(ProfilingClient(["Profiling", "Profiling", "Quoted"]), "demo-lm")  # type: ignore[arg-type]
    out = capsys.readouterr().out
    assert "● profiling:" in out and "0.085 s per step on nyc-1" in out, out
    with pytest.raises(click.ClickException, match="ended Failed before its quotes: no agent claimed the profile"):
        demo._wait_quoted(ProfilingClient(["Profiling", "Failed"]), "demo-lm")  # type: ignore[arg-type]


def test_the_demo_profiles_a_job_long_enough_to_be_worth_it() -> None:
    assert demo.job_manifest(3_000_000, "tiny")["spec"]["profile"] is True  # 976 steps: priced from its own
    assert demo.job_manifest(20_000, "tiny")["spec"]["profile"] is False  # 6 steps: the profile would be the run


def test_the_demo_says_where_its_files_are_and_how_to_remove_them(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Issue 32: `cpn demo` left 320 MB in the temporary directory without a word. Its last line, also after
    a failure, names the folder, its size and the command that removes it."""
    import click
    import pytest

    folder = tmp_path / "cpn demo"
    (folder / "sites" / "runs").mkdir(parents=True)
    (folder / "cpn.db").write_bytes(b"x" * 2_500_000)
    (folder / "sites" / "runs" / "rank0.log").write_bytes(b"y" * 1_000_000)
    note = demo.files_note(folder, temporary=True)
    assert note == (f"● the demo's files (database, server and agent logs, runs: 4 MB) are in {folder} (a temporary "
                    f"directory, kept); remove them with: rm -rf '{folder}'")
    assert "--data-dir" in demo.files_note(folder, temporary=False)

    said: list[str] = []
    monkeypatch.setattr(demo.tempfile, "mkdtemp", lambda prefix: str(folder))
    monkeypatch.setattr(click, "echo", lambda text="", **_: said.append(str(text)))

    def broken(*args: object) -> None:
        raise click.ClickException("no site became Ready")

    monkeypatch.setattr(demo, "_run_demo", broken)
    with pytest.raises(click.ClickException):
        demo.demo_cmd.callback(tokens=1, model="tiny", wan=False, data_dir=None, keep=False)
    assert said[-1].startswith("● the demo's files") and f"rm -rf '{folder}'" in said[-1], said
