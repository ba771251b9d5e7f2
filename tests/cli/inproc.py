"""cpnctl run in this process, in a thread, against the `api` fixture's in-process server (real HTTP on
a local port): the event loop goes on serving (and a test can drive the reconciler and agents) while the
command runs. No subprocess and no `cpn serve`: each call takes milliseconds."""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass

from click.testing import CliRunner


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str


def url_of(api) -> str:  # type: ignore[no-untyped-def]
    return str(api.client.make_url("")).rstrip("/")


def invoke(url: str, token: str, args: list[str], input: str | None = None) -> Result:
    """`cpnctl --server URL --token TOKEN ARGS…` through cpnctl's own main() (its error lines, its exit codes)."""
    from cpn.cli.ctl.main import main

    with CliRunner().isolation(input=input, env={"CPN_CONFIG": "/nonexistent/cpnctl.yaml"}) as (out, err, _):
        argv, sys.argv = sys.argv, ["cpnctl", "--server", url, "--token", token, *args]
        code = 0
        try:
            main()
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
        finally:
            sys.argv = argv
        return Result(code, out.getvalue().decode(), err.getvalue().decode())


async def cpnctl(api, who: str, *args: str, input: str | None = None) -> Result:  # type: ignore[no-untyped-def]
    """cpnctl as account `who` of the `api` fixture, off the event loop."""
    return await asyncio.to_thread(invoke, url_of(api), api.tokens[who], list(args), input)
