"""Job verbs: accept a quote, cancel, wait with a progress bar, logs, top."""

from __future__ import annotations

import click

from cpn.cli.ctl import output
from cpn.cli.ctl.commands.resources import OUTPUT, emit
from cpn.cli.ctl.context import Ctx, pass_ctx
from cpn.cli.ctl.main import cli


@cli.command()
@click.argument("job")
@click.option("--quote", "quote", default="balanced", show_default=True,
              help="Quote id or label: cheapest | fastest | balanced.")
@OUTPUT
@pass_ctx
def accept(obj: Ctx, job: str, quote: str, fmt: str) -> None:
    """Accept a quote for JOB: signs the contract and reserves the GPUs."""
    result = obj.client.post(f"/api/v1/jobs/{job}/accept", json={"quote": quote})
    if fmt in ("json", "yaml"):
        click.echo(output.dump(result, fmt))
        return
    leases = ", ".join(f"{lease['gpus']}×{lease['cluster']}" for lease in result["status"].get("leases", []))
    price = result["status"].get("price", {})
    click.echo(f"trainingjob/{job} accepted ({quote}): {result['status']['phase']}; leased {leases}; "
               f"quoted {price.get('total')} {price.get('currency')}")


__all__ = ["accept", "emit"]
