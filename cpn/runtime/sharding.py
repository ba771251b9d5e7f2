"""Sharding inside a site: the built-in model under FSDP2 over the ranks of each site.

:func:`build_sharded` makes this rank's model with ``shard="site"``: every block of ``model.blocks``
is one ``fully_shard`` unit, then the root (embeddings, final norm, output), all over the site's
process group (a 1-D :class:`DeviceMesh` from :attr:`Groups.intra`), so a rank keeps 1/W of every
parameter, gradient and optimiser moment; forward and backward all-gather a block's parameters and
backward reduce-scatters (averages) its gradients over the site. What crosses sites is the
strategy's business, on the local shards (:func:`local_tensors`, :func:`cross_site_average`).

Two ways to initialise, chosen by :func:`init_mode`:

- ``reference`` (a model whose fp32 parameters take less than :data:`META_INIT_BYTES`): the seeded
  model of ``shard="none"`` is built on the host and then sharded; the full tensors are freed as
  each unit is sharded. The sharded run starts from the very weights of the unsharded one.
- ``meta`` (larger models): built on the meta device, sharded, ``to_empty`` on the device, then
  ``model.init_weights()`` fills each rank's shards: no rank ever holds the whole model.

Precision: on CUDA, bf16 parameters in forward/backward with fp32 gradient reduction
(``MixedPrecisionPolicy``), fp32 master shards; on the CPU, fp32 throughout. The CUDA path (NCCL
inside a site through the ``cpu:gloo,cuda:nccl`` site group) is written for GPUs but has only run on
CPUs so far (docs/benchmarks/memory.md).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from cpn.runtime.codecs import ErrorFeedback, get_codec
from cpn.runtime.config import TrainConfig
from cpn.runtime.groups import Groups

__all__ = ["META_INIT_BYTES", "apply_activation_checkpointing", "build_sharded", "cross_site_average",
           "init_mode", "is_sharded", "local_tensors", "site_mesh"]

META_INIT_BYTES = 2 << 30  # fp32 parameters above this are initialised on the meta device (shard by shard)


def is_sharded(model: nn.Module) -> bool:
    return isinstance(model, FSDPModule)


def local(t: Tensor) -> Tensor:
    """This rank's part of ``t``: the local shard of a DTensor, else ``t`` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_tensors(tensors: Any) -> list[Tensor]:
    return [local(t) for t in tensors]


def site_mesh(groups: Groups) -> DeviceMesh:
    """The 1-D mesh of this rank's site (its ranks' site group, the fast network)."""
    return DeviceMesh.from_group(groups.intra, groups.device.type, mesh_dim_names=("site",))


def mp_policy(device: torch.device) -> MixedPrecisionPolicy:
    """bf16 compute with fp32 gradient reduction on GPUs; fp32 everywhere on the CPU."""
    if device.type == "cuda":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def init_mode(model: Any) -> str:
    """``reference`` when the model's fp32 weights are small enough to build once on the host, else ``meta``."""
    from cpn.runtime.presets import resolve

    return "meta" if 4 * resolve(model).parameters > META_INIT_BYTES else "reference"


def apply_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them (about one forward more)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, block in enumerate(model.blocks):
        model.blocks[i] = checkpoint_wrapper(block, preserve_rng_state=False)


def build_sharded(cfg: TrainConfig, groups: Groups, *, model: Any = None, mode: str | None = None) -> nn.Module:
    """This rank's model of ``cfg`` (or ``model``: a name, shape or ModelConfig), sharded over its
    site (see the module docstring). In ``meta`` mode each rank draws its own shards with a seed of
    (``cfg.seed``, its index in the site): the same-index ranks of every site draw alike, so all
    sites start from one model."""
    from cpn.runtime.data import model_config
    from cpn.runtime.model import build_model

    spec = model_config(cfg) if model is None else model
    mode = mode or init_mode(spec)
    device = groups.device
    built = build_model(spec, seed=cfg.seed, device="meta" if mode == "meta" else "cpu")
    if cfg.activation_checkpointing == "full":
        apply_activation_checkpointing(built)
    shard_model(built, site_mesh(groups), device)
    if mode == "meta":
        built.to_empty(device=device)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(cfg.seed + 7919 * groups.local_rank)  # shards differ: a shared seed would repeat rows
            built.init_weights()
    else:
        built.to(device)
    return built


def shard_model(model: nn.Module, mesh: DeviceMesh, device: torch.device) -> nn.Module:
    """``fully_shard`` every block, then the root; the last block keeps its parameters after forward
    (backward needs them at once: torchtitan's choice)."""
    policy = mp_policy(device)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < len(blocks) - 1)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds of parameters, gradients and optimiser state, from the tensors' storage
    (local shards of DTensors; a storage shared by several views counted once)."""
    seen: set[int] = set()

    def size(tensors: Any) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, Tensor):
                continue
            storage = local(t).untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return total

    params = list(model.parameters())
    out = {"params": size(params), "grads": size(p.grad for p in params if p.grad is not None)}
    out["optimizer"] = size(v for state in optimizer.state.values() for v in state.values() if v.dim() > 0)
    return out


def cross_site_average(tensors: list[Tensor], groups: Groups, *, codec_name: str | None = None,
                       ef: ErrorFeedback | None = None, key: str = "shards") -> int:
    """Average the local shards ``tensors`` in place with the same-index rank of every other site
    (:attr:`Groups.cross`), optionally coded on the wire; the bytes this rank sent (ring estimate)."""
    group, sites = groups.cross, groups.S
    if group is None or sites == 1 or not tensors:
        return 0
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    staged = flat.cpu() if groups.wan_staged else flat
    codec = get_codec(codec_name) if codec_name else None
    if codec is None:
        dist.all_reduce(staged, group=group)
        staged.div_(sites)
        sent = 2 * (sites - 1) * staged.numel() * 4 // sites
    else:
        n = staged.numel()
        padded = -(-n // codec.align) * codec.align
        buf = torch.zeros(padded, device=staged.device)
        buf[:n] = staged
        if ef is not None:
            buf = ef.compensate(key, buf)
        wire = codec.encode(buf)
        if ef is not None:
            ef.record(key, buf, codec.decode(wire, padded))
        outs = [torch.empty_like(wire) for _ in range(sites)]
        dist.all_gather(outs, wire, group=group)
        staged = sum(codec.decode(w, padded)[:n] for w in outs) / sites
        sent = (sites - 1) * wire.numel()
    flat = staged.to(flat.device)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
    return sent
