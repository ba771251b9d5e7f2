"""Input errors a new user meets before any server is involved: one line naming what to fix, the option
or file they typed, no traceback, no validator internals; `cpn train` usage errors exit 1, as every bad input does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import run_cli


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    out = {**os.environ, "HOME": str(tmp_path), "CPN_CONFIG": str(tmp_path / "cpnctl.yaml"),
           "CPN_SERVER": "http://127.0.0.1:9", "CPN_TOKEN": "t"}
    return out


def one_line(proc) -> str:  # type: ignore[no-untyped-def]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def test_apply_of_a_missing_file_names_it(env, tmp_path: Path) -> None:
    proc = run_cli(["cpnctl", "apply", "-f", str(tmp_path / "nosuch.yaml")], env)
    assert proc.returncode == 1
    assert one_line(proc) == f"error: {tmp_path / 'nosuch.yaml'}: no such file"


def test_apply_refuses_a_duplicate_key_with_file_and_line(env, tmp_path: Path) -> None:
    path = tmp_path / "job.yaml"
    path.write_text("apiVersion: cpn/v1\nkind: TrainingJob\nmetadata: {name: dup}\n"
                    "spec:\n  model: tiny\n  tokens: 30720\n  tokens: 99\n")
    proc = run_cli(["cpnctl", "apply", "-f", str(path)], env)
    assert proc.returncode == 1
    assert one_line(proc) == (f"error: {path}: malformed YAML at line 7 column 3: duplicate key 'tokens' "
                              "(first set at line 6)")
    path.write_text('{"kind": "TrainingJob", "spec": {"tokens": 30720, "tokens": 99}}')
    proc = run_cli(["cpnctl", "apply", "-f", str(path)], env)
    assert one_line(proc) == f"error: {path}: malformed JSON: duplicate key 'tokens'"
    path.write_text("apiVersion: cpn/v1\nkind: TrainingJob\nmetadata: {name: bad-date}\nspec:\n  deadline: 2026-02-30\n")
    proc = run_cli(["cpnctl", "apply", "-f", str(path)], env)  # a YAML value, not JSON, that PyYAML refuses
    assert one_line(proc).startswith(f"error: {path}: malformed YAML: "), proc.stderr


@pytest.mark.parametrize(("args", "said"), [
    (["--strategy", "foo"], "'--strategy': 'foo' is not one of 'auto', 'ddp',"),
    (["--inner-steps", "0"], "--inner-steps: Input should be greater than or equal to 1"),
    (["--global-batch", "0"], "--global-batch: Input should be greater than 0"),
    (["--sites", "0"], "'--sites': 0 is not in the range x>=1"),
    (["--global-batch", "960"], "--global-batch 960 is not a multiple of --seq-len 128: use 896"),  # two options
    (["--strategy", "pipeline", "--sites", "4", "--stages", "3"], "--stages 3 must divide the job's 4 sites"),  # preflight
    (["--workers-per-site", "0"], "'--workers-per-site': 0 is not in the range x>=1"),
])
def test_cpn_train_names_the_option_and_exits_1(env, args: list[str], said: str) -> None:
    proc = run_cli(["cpn", "train", *args], env)
    assert proc.returncode == 1, proc.stderr
    line = one_line(proc)
    assert said in line, line
    assert "literal[" not in line and "strategy." not in line and "global_batch_tokens" not in line


def test_cpn_train_help_shows_defaults(env) -> None:
    out = " ".join(run_cli(["cpn", "train", "--help"], env).stdout.split())  # help wraps at the width
    assert "[default: ddp]" in out and "[default: 16384]" in out and "S sites [default: 2; x>=1]" in out


def test_a_token_with_a_space_or_line_break_inside_is_named_before_any_request(env) -> None:
    """A token pasted with something else (two lines of a terminal, `token stored in …`) read 'cannot reach
    the server: Illegal header value'; now one line says what is wrong with the token. A trailing line
    break alone is dropped (the server here is unreachable, so the request is what fails then)."""
    proc = run_cli(["cpnctl", "get", "clusters"], {**env, "CPN_TOKEN": "cpn_ab_cd\ntoken stored in sqlite"})
    assert proc.returncode == 1
    assert one_line(proc).startswith("error: the token holds a space, line break or other character")
    proc = run_cli(["cpnctl", "get", "clusters"], {**env, "CPN_TOKEN": "cpn_ab_cd\n"})
    assert proc.returncode == 1
    assert one_line(proc).startswith("error: cannot reach http://127.0.0.1:9")


def test_a_binary_file_and_a_broken_config_are_named(env, tmp_path: Path) -> None:
    """A probe: a binary file gave Python's codec text without the file; a config of the wrong shape said
    "1 validation error for ConfigFile", broken YAML in it no line."""
    binary = tmp_path / "model.bin"
    binary.write_bytes(b"\xd0\xcf\x11\xe0")
    proc = run_cli(["cpnctl", "apply", "-f", str(binary)], env)
    assert proc.returncode == 1
    assert one_line(proc) == f"error: {binary}: not a text file (byte 0 is not UTF-8); give a YAML or JSON manifest"
    config = Path(env["CPN_CONFIG"])
    config.write_text("contexts: 5\n")
    line = one_line(proc := run_cli(["cpnctl", "get", "jobs"], env))
    assert proc.returncode == 1 and line.startswith(f"error: {config} is not a valid cpnctl config: contexts: "), line
    config.write_text("contexts: [a\n")
    line = one_line(proc := run_cli(["cpnctl", "get", "jobs"], env))
    assert proc.returncode == 1 and "broken YAML at line 2 column 1" in line, line


def test_version_against_an_unreachable_server_prints_the_client_and_exits_1(env) -> None:
    proc = run_cli(["cpnctl", "version"], env)  # CPN_SERVER is port 9: nothing answers
    assert proc.returncode == 1, proc
    assert proc.stdout.startswith("Client Version: ") and "Server Version: unavailable (cannot reach" in proc.stdout
