"""What `cpnctl apply` checks on the user's machine before it uploads anything (issue 32, items 4 and 6):
a code job's `spec.code.entrypoint` (module:function) is looked up by reading the module's source, never
importing it; and the "code … packed … uploaded" line appears only once the server took the batch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cpn.cli.ctl.code import MAX_BYTES, entrypoint_problem
from cpn.runtime.bundle import pack
from tests.cli.inproc import cpnctl
from tests.layers.orchestration.test_reconciler import _job, _world

TRAIN = '''"""A user's training script: reading it must never run it."""
import sys
sys.exit("imported!")  # an import at apply time would end cpnctl here


def main():
    pass


def _helper():
    pass


class Trainer:
    pass


make = main
'''


def _code_job(tmp_path: Path, entrypoint: str, **spec: object) -> str:
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True, exist_ok=True)
    (code / "train.py").write_text(TRAIN)
    (code / "pkg" / "__init__.py").write_text("from .loop import *\n")
    (code / "pkg" / "loop.py").write_text("async def run():\n    pass\n")
    (code / "broken.py").write_text("def main():\n    pass\n\ndef other(:\n    pass\n")
    job = _job("mine", code={"path": "code", "entrypoint": entrypoint}, model={"parameters": 100000}, **spec)
    manifest = tmp_path / "job.json"
    manifest.write_text(json.dumps(job))
    return str(manifest)


@pytest.mark.parametrize(("entrypoint", "problem"), [
    ("train:main", None),
    ("train:Trainer", None),                       # a class is callable
    ("train:make", None),                          # so is a name bound to a function
    ("pkg.loop:run", None),                        # a module in a package, an async function
    ("pkg:anything", None),                        # `from .loop import *`: nothing a reader can rule out
    ("train:mian", "train.py has no function 'mian'; did you mean `train:main`?"),
    ("train:fit", "train.py has no function 'fit'; its functions: main"),
    ("trian:main", "no module 'trian' in {root} (looked for trian.py and trian/__init__.py among the files the "
                   "bundle takes); did you mean `train`?"),
    ("pkg.loops:run", "did you mean `pkg.loop`?"),
    ("broken:main", "broken.py line 4: invalid syntax"),
])
def test_entrypoint_problem_reads_the_source(tmp_path: Path, entrypoint: str, problem: str | None) -> None:
    _code_job(tmp_path, "train:main")
    root = tmp_path / "code"
    found = entrypoint_problem(root, entrypoint)
    if problem is None:
        assert found is None
    else:
        assert found is not None and problem.format(root=root) in found, found


def test_an_ignored_module_is_not_in_the_bundle(tmp_path: Path) -> None:
    _code_job(tmp_path, "train:main")
    (tmp_path / "code" / ".cpnignore").write_text("train.py\n")
    assert "no module 'train'" in (entrypoint_problem(tmp_path / "code", "train:main") or "")


async def test_a_wrong_entrypoint_is_refused_before_any_upload(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    source = _code_job(tmp_path, "train:mian")
    out = await cpnctl(api, "alice", "apply", "-f", source)
    assert out.code == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert "trainingjob/mine: spec.code.entrypoint 'train:mian': train.py has no function 'mian'; did you mean " \
           "`train:main`?" in lines[0]
    assert "packed" not in out.stderr and "uploaded" not in out.stderr
    _, digest = pack(tmp_path / "code", MAX_BYTES)
    head = await api.client.head(f"/api/v1/bundles/{digest.removeprefix('sha256:')}", headers=api.auth("alice"))
    assert head.status == 404  # nothing was uploaded


async def test_packed_and_uploaded_is_said_only_when_the_apply_succeeds(api, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    await _world(api)
    refused = await cpnctl(api, "alice", "apply", "-f", _code_job(tmp_path, "train:main", tokens=-5))
    assert refused.code == 1 and "spec.tokens" in refused.stderr
    assert "packed" not in refused.stderr and "uploaded" not in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1

    done = await cpnctl(api, "alice", "apply", "-f", _code_job(tmp_path, "train:main"))
    assert done.code == 0, done.stderr
    assert "trainingjob/mine created" in done.stdout
    assert "trainingjob/mine: code" in done.stderr and "packed to sha256:" in done.stderr  # the upload is told now
