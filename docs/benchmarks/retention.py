"""Space freed by checkpoint retention (issue 36, item 6): J jobs of S steps checkpointing every E
steps, each step's real files (the `tiny` model's state dict and its AdamW state as `site0.pt`, the
model as `global.pt`, then `latest.json`), stored in a disk blob store the way the API's checkpoint
endpoint stores them (BlobStore.put, then retention.prune when a step is committed: what the
handler runs) and written into a site's checkpoint folder the way the workers write them (then
checkpoint.prune, as the job runner does after each push). Once with retention, once without.

    python3 docs/benchmarks/retention.py --jobs 25 --steps 800 --every 50 --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import platform
import tempfile
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from cpn.runtime import checkpoint
from cpn.runtime.model import build_model
from layers.orchestration.lifecycle.retention import prune
from layers.resource.blobs import BlobStore


def _tiny_step_files() -> dict[str, bytes]:
    """One checkpoint step's files for one site, from a real model after one real AdamW step."""
    model = build_model("tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(0, 256, (2, 64))
    loss = model(x).float().logsumexp(-1).mean()
    loss.backward()
    opt.step()
    out = {}
    for name, state in (("site0.pt", {"model": model.state_dict(), "optimizer": opt.state_dict()}),
                        ("global.pt", {"model": model.state_dict()})):
        buf = io.BytesIO()
        torch.save(state, buf)
        out[name] = buf.getvalue()
    return out


async def _chunks(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _bytes(root: Path) -> tuple[int, int]:
    files = [p for p in root.rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


async def _server(root: Path, files: dict[str, bytes], jobs: int, steps: list[int], keep: int | None) -> dict[str, Any]:
    store = BlobStore(root, 1 << 30)
    prune_seconds = 0.0
    for j in range(jobs):
        uid = f"job-{j:04d}"
        for step in steps:
            folder = f"{uid}/checkpoints/step-{step:08d}"
            for name, data in files.items():
                await store.put(f"{folder}/{name}", _chunks(data))
            await store.put(f"{folder}/latest.json", _chunks(json.dumps({"step": step, "sites": [0]}).encode()))
            if keep is not None:
                t0 = time.perf_counter()
                prune(store, uid, keep)
                prune_seconds += time.perf_counter() - t0
        await store.put(f"{uid}/final.pt", _chunks(files["global.pt"]))
    count, size = _bytes(root)
    return {"blobs": count, "bytes": size, "prune_seconds": round(prune_seconds, 3)}


def _site(root: Path, files: dict[str, bytes], jobs: int, steps: list[int], keep: int | None) -> dict[str, Any]:
    for j in range(jobs):
        ckpt = root / f"job-{j:04d}" / "checkpoints"
        for step in steps:
            folder = checkpoint.step_dir(ckpt, step)
            folder.mkdir(parents=True)
            for name, data in files.items():
                (folder / name).write_bytes(data)
            checkpoint.atomic_write_json({"step": step, "sites": [0]}, ckpt / checkpoint.LATEST)
            if keep is not None:
                checkpoint.prune(ckpt, keep)
    count, size = _bytes(root)
    return {"files": count, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=25)
    parser.add_argument("--steps", type=int, default=800)
    parser.add_argument("--every", type=int, default=50)
    parser.add_argument("--keep", type=int, default=checkpoint.DEFAULT_KEEP)
    parser.add_argument("--out", type=Path, default=None, help="folder for retention.json")
    args = parser.parse_args()
    files = _tiny_step_files()
    steps = list(range(args.every, args.steps + 1, args.every))
    rows = {}
    for label, keep in (("without retention", None), (f"keep {args.keep}", args.keep)):
        with tempfile.TemporaryDirectory() as tmp:
            server = asyncio.run(_server(Path(tmp) / "blobs", files, args.jobs, steps, keep))
            site = _site(Path(tmp) / "site", files, args.jobs, steps, keep)
        rows[label] = {"server": server, "site": site}
    base, kept = rows["without retention"], rows[f"keep {args.keep}"]
    result = {
        "measured": datetime.now(UTC).isoformat(timespec="seconds"), "host": platform.node(),
        "torch": torch.__version__, "jobs": args.jobs, "steps": args.steps, "every": args.every,
        "keep": args.keep, "checkpoints_per_job": len(steps),
        "step_bytes": {name: len(data) for name, data in files.items()},
        "runs": rows,
        "server_bytes_freed": base["server"]["bytes"] - kept["server"]["bytes"],
        "site_bytes_freed": base["site"]["bytes"] - kept["site"]["bytes"],
    }
    print(f"{args.jobs} jobs x {len(steps)} checkpoints (tiny: site0.pt {len(files['site0.pt']):,} B, "
          f"global.pt {len(files['global.pt']):,} B)")
    print("| run | server blobs | server MB | site files | site MB | prune s (server) |")
    print("|---|---|---|---|---|---|")
    for label, r in rows.items():
        print(f"| {label} | {r['server']['blobs']} | {r['server']['bytes'] / 1e6:,.1f} | {r['site']['files']} | "
              f"{r['site']['bytes'] / 1e6:,.1f} | {r['server']['prune_seconds']} |")
    print(f"freed: server {result['server_bytes_freed'] / 1e6:,.1f} MB, site {result['site_bytes_freed'] / 1e6:,.1f} MB")
    if args.out:
        (args.out / "retention.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
