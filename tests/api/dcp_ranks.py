"""The ranks of tests/api/test_dcp_checkpoints.py's gloo jobs, in a module of their own: a spawned rank
imports only this (torch and the runtime's checkpoint module), not the API tests' database helpers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpn.runtime import checkpoint

STEP = 3
SHAPES = {"site0/w": (6, 4), "site0/b": (6,), "global/m": (5, 3)}


def full_state() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {k: torch.randn(shape, generator=gen) for k, shape in SHAPES.items()}


def _nested(flat: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for k, v in flat.items():
        top, leaf = k.split("/")
        out.setdefault(top, {})[leaf] = v
    return out


def _rank(rank: int, world: int, store_file: str, root: str, mode: str, out: str) -> None:
    """One rank of a gloo job of `world` ranks: `save` the tensors sharded on dim 0 with save_sharded, or
    `load` them with load_sharded into this world's shards and write what it holds to `out`."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = full_state()
        if mode == "save":
            state = _nested({k: distribute_tensor(v, mesh, [Shard(0)]) for k, v in full.items()})
            checkpoint.save_sharded(Path(root), STEP, state, group=dist.group.WORLD, is_rank0=rank == 0, sites=[0])
            return

        def template(sites: list[int]) -> dict[str, Any]:
            return _nested({k: distribute_tensor(torch.zeros_like(v), mesh, [Shard(0)]) for k, v in full.items()})
        loaded = checkpoint.load_sharded(root, template, group=dist.group.WORLD)
        assert loaded is not None
        step, state = loaded
        whole = {f"{top}/{leaf}": t.full_tensor() for top, part in state.items() for leaf, t in part.items()}
        if rank == 0:
            torch.save({"step": step, "state": whole}, out)
    finally:
        dist.destroy_process_group()


def run_ranks(world: int, tmp: Path, root: Path, mode: str) -> dict[str, Any] | None:
    store_file, out = tmp / f"store-{mode}-{world}", tmp / f"out-{mode}-{world}.pt"
    mp.spawn(_rank, args=(world, str(store_file), str(root), mode, str(out)), nprocs=world, join=True)
    return torch.load(out) if mode == "load" else None
