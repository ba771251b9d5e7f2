"""`cpn agent --context/--kube-context` is a kubeconfig context, refused without --kubeconfig; when the
agent takes its server or token from cpnctl's config it says which context (never the token)."""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from cpn.runtime.launcher import free_port
from tests.conftest import run_cli

SECRET = "cpn_0123456789abcdef_do-not-print-me"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    config = tmp_path / "cpnctl.yaml"
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: the agent fails fast after saying what it uses
    config.write_text(yaml.safe_dump({"currentContext": "prov-b", "contexts": [
        {"name": "prov-b", "server": closed, "token": SECRET}]}))
    env = {k: v for k, v in os.environ.items() if k not in ("CPN_SERVER", "CPN_TOKEN")}
    return {**env, "CPN_CONFIG": str(config), "HOME": str(tmp_path), **extra}


def test_kube_context_without_kubeconfig_is_one_line_error(tmp_path: Path) -> None:
    for flag in ("--context", "--kube-context"):
        out = run_cli(["cpn", "agent", "--cluster", "fra-1-h100", flag, "kind-fra"], _env(tmp_path))
        assert out.returncode == 1, (flag, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and "'kind-fra'" in lines[0] and "--kubeconfig" in lines[0], (flag, out.stderr)


def test_the_agent_says_which_cpnctl_context_it_took(tmp_path: Path) -> None:
    env = _env(tmp_path)
    server = yaml.safe_load(Path(env["CPN_CONFIG"]).read_text())["contexts"][0]["server"]
    out = run_cli(["cpn", "agent", "--cluster", "lab-cpu", "--local", "--once"], env)
    assert out.returncode == 1  # nothing answers at the context's server
    notes = [line for line in out.stderr.splitlines() if "cpnctl context" in line]
    assert len(notes) == 1, out.stderr
    assert "server and token" in notes[0] and "'prov-b'" in notes[0] and server in notes[0], notes
    assert SECRET not in out.stdout + out.stderr

    out = run_cli(["cpn", "agent", "--cluster", "lab-cpu", "--local", "--once"], {**env, "CPN_TOKEN": "cpn_x_y"})
    notes = [line for line in out.stderr.splitlines() if "cpnctl context" in line]
    assert len(notes) == 1 and "the server of cpnctl context 'prov-b'" in notes[0], out.stderr  # token from env

    out = run_cli(["cpn", "agent", "--cluster", "lab-cpu", "--local", "--once", "--server", server],
                  {**env, "CPN_TOKEN": "cpn_x_y"})
    assert out.returncode == 1 and "cpnctl context" not in out.stderr, out.stderr  # nothing taken from the config
