"""Where a worker computes: its device, its precision, and the host staging of WAN traffic.

Every rank of a site binds ``cuda:LOCAL_RANK`` when the machine has a CUDA device per local rank,
else the CPU (a site decides as one: ranks of one group must all hold CUDA tensors or all CPU
ones). Model, optimiser state, batches, buckets, codec buffers and error-feedback residuals live on
that device. Gloo moves only host tensors, so a CUDA tensor bound for a Gloo (WAN) group is copied
into pinned host memory on a side stream (:class:`HostStage`) and back after the exchange.

Only this module asks torch about CUDA, so a CPU run never initialises it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
from torch import Tensor

from cpn.runtime.config import DeviceConfig
from cpn.runtime.contract import ENV

__all__ = [
    "HOST",
    "HostStage",
    "autocast",
    "cuda_devices",
    "outer_on_host",
    "ready_event",
    "select_device",
    "synchronize",
    "uses_bf16",
]

HOST = torch.device("cpu")
OUTER_MEMORY_SHARE = 0.5  # the outer state goes to the host when training state would exceed this share
log = logging.getLogger(__name__)


def cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _local(environ: dict[str, str] | None = None) -> tuple[int, int]:
    env = os.environ if environ is None else environ
    return int(env.get("LOCAL_RANK", "0")), int(env.get("LOCAL_WORLD_SIZE", "1"))


def select_device(kind: str = "auto", environ: dict[str, str] | None = None) -> torch.device:
    """``cuda:LOCAL_RANK`` or the CPU, the same choice on every rank of a site.

    ``auto`` takes CUDA only when there is a device per local rank (two ranks on one GPU would
    break NCCL); ``cuda`` insists and says what is missing, and so does ``auto`` when the site's agent
    assigned GPUs (``CPN_DEVICES=cuda``): the job is billed GPU time, so it never trains on the CPU.
    ``CUDA_VISIBLE_DEVICES`` (the agent's assignment) makes ``cuda:LOCAL_RANK`` this sub-task's own GPU.
    """
    if kind == "cpu":
        return HOST
    env = os.environ if environ is None else environ
    local, per_site = _local(environ)
    count = cuda_devices()
    if count >= per_site and count > local:
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        return device
    if env.get(ENV.DEVICES) == "cuda":
        raise RuntimeError(
            f"the site assigned GPUs {env.get('CUDA_VISIBLE_DEVICES', '?')} to this sub-task, but {count} CUDA "
            f"device(s) are visible for {per_site} local ranks: the GPUs are gone or the CUDA driver failed "
            "(check nvidia-smi); refusing to train on the CPU while GPU time is billed"
        )
    if kind == "cuda":
        raise RuntimeError(
            f"device.kind is 'cuda' but this machine has {count} CUDA device(s) for {per_site} local ranks: "
            "run fewer workers per site or set device.kind to auto/cpu"
        )
    if count:
        log.warning("%d CUDA device(s) for %d local ranks: the site trains on the CPU", count, per_site)
    return HOST


def uses_bf16(device: torch.device, precision: str) -> bool:
    """bf16 autocast: asked for, or ``auto`` on a GPU that supports it."""
    if precision == "bf16":
        return True
    return precision == "auto" and device.type == "cuda" and torch.cuda.is_bf16_supported()


def autocast(device: torch.device, precision: str) -> contextlib.AbstractContextManager:
    if not uses_bf16(device, precision):
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously; timers need it finished)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def outer_on_host(cfg: DeviceConfig, device: torch.device, params: int) -> bool:
    """The DiLoCo anchor and outer state go to the host when asked, or (by default) when fp32
    weights, gradients, two Adam moments and the three outer copies (anchor, global parameters,
    momentum) would fill more than half of the GPU."""
    if cfg.outer_on_host is not None:
        return cfg.outer_on_host
    if device.type != "cuda":
        return False
    need = 7 * 4 * params
    return need > OUTER_MEMORY_SHARE * torch.cuda.get_device_properties(device).total_memory


def ready_event(device: torch.device) -> torch.cuda.Event | None:
    """An event after the work queued so far on ``device``'s current stream (None on the CPU)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class HostStage:
    """Copies between a CUDA device and pinned host memory on a side stream.

    ``out`` waits for ``ready`` (or the caller's stream) before copying, ``back`` returns when the
    device copy is done, so a background thread can stage while the main stream computes. On the
    CPU both are the identity.
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def active(self) -> bool:
        return self.stream is not None

    @contextlib.contextmanager
    def _side(self, ready: torch.cuda.Event | None) -> Iterator[None]:
        producer = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):
            if ready is not None:
                self.stream.wait_event(ready)
            else:
                self.stream.wait_stream(producer)
            yield
        self.stream.synchronize()

    def out(self, t: Tensor, ready: torch.cuda.Event | None = None) -> Tensor:
        if self.stream is None or t.device.type != "cuda":
            return t
        host = torch.empty(t.shape, dtype=t.dtype, device=HOST, pin_memory=True)
        with self._side(ready):
            host.copy_(t, non_blocking=True)
        return host

    def back(self, host: Tensor, dst: Tensor) -> None:
        if host is dst:
            return
        if self.stream is None:
            dst.copy_(host)
            return
        with self._side(None):
            dst.copy_(host, non_blocking=True)

    def to_device(self, host: Tensor) -> Tensor:
        if self.stream is None:
            return host
        out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
        self.back(host, out)
        return out
