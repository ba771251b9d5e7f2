"""The worker entry point for a job with ``spec.code``: ``python -m cpn.train.run``.

Imports ``CPN_CODE_ENTRYPOINT`` (``module:function``) from the extracted bundle in ``CPN_CODE_DIR``
(put first on ``sys.path``) and calls the function with no arguments; the function calls
:func:`cpn.train.init` itself. Runs only in a worker process at a site, never in the API server.
"""

from __future__ import annotations

import importlib
import os
import sys
import traceback

from cpn.runtime.contract import ENV
from cpn.train.api import close_job


def load_entrypoint(code_dir: str, entrypoint: str):  # type: ignore[no-untyped-def]
    module, _, function = entrypoint.partition(":")
    if not module or not function:
        raise ValueError(f"entrypoint {entrypoint!r} is not module:function (spec.code.entrypoint)")
    sys.path.insert(0, code_dir)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        raise ValueError(f"spec.code.entrypoint {entrypoint!r}: module {module!r} is not in the bundle ({exc})") from None
    fn = getattr(mod, function, None)
    if not callable(fn):
        raise ValueError(f"spec.code.entrypoint {entrypoint!r}: {module} has no function {function!r}")
    return fn


def main() -> int:
    code_dir, entrypoint = os.environ.get(ENV.CODE_DIR), os.environ.get(ENV.CODE_ENTRYPOINT)
    if not code_dir or not entrypoint:
        print(f"{ENV.CODE_DIR} and {ENV.CODE_ENTRYPOINT} must be set (the job runner sets them)", file=sys.stderr)
        return 2
    os.chdir(code_dir)  # the user's relative paths (a local text file …) resolve inside the bundle
    try:
        load_entrypoint(code_dir, entrypoint)()
        close_job()  # the final figures and, on rank 0, the run summary
    except Exception as exc:  # noqa: BLE001 - the user's traceback belongs in the rank's log
        traceback.print_exc()
        print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # live Gloo pairs to finished peers can hang a clean teardown


if __name__ == "__main__":
    sys.exit(main())
