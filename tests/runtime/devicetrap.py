"""A trap for tensors the runtime creates without saying where, and an inventory of a worker's state.

:class:`DeviceTrap` is a ``TorchFunctionMode``: when a factory (``torch.zeros``, ``torch.tensor``...)
is called straight from a module of ``cpn/runtime`` without a ``device``, it records the call site
and makes the tensor on the ``meta`` device -- which has no data, so the run breaks the way a CPU
tensor breaks a CUDA run. Calls made inside torch (an optimiser's step counter) are left alone.
Torch function modes are per thread, so :meth:`DeviceTrap.cover_threads` enters the trap in every
thread started afterwards (gossip mailboxes, parameter servers, the WAN pipeline).
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

import cpn.runtime

RUNTIME = str(Path(cpn.runtime.__file__).parent)
FACTORIES = {
    torch.zeros, torch.empty, torch.ones, torch.full, torch.tensor, torch.as_tensor, torch.arange,
    torch.randn, torch.rand, torch.randint, torch.linspace, torch.eye,
}


DISPATCH = (str(Path(torch.__file__).parent / "overrides.py"), str(Path(torch.__file__).parent / "utils" / "_device.py"))


def _call_site() -> str | None:
    """The frame that called the factory (past the mode dispatch), if it is runtime code."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename in DISPATCH:
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(RUNTIME):
        return None  # torch's own code (an optimiser's step counter), or the test's
    return f"{Path(frame.f_code.co_filename).relative_to(RUNTIME)}:{frame.f_lineno}"


class DeviceTrap(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.violations: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in FACTORIES and kwargs.get("device") is None:
            where = _call_site()
            if where is not None:
                self.violations.append(where)
                kwargs["device"] = "meta"
        return func(*args, **kwargs)

    def cover_threads(self) -> None:
        trap, run = self, threading.Thread.run

        def trapped(thread: threading.Thread) -> None:
            with trap:
                run(thread)

        threading.Thread.run = trapped  # type: ignore[method-assign]


def state_tensors(ctx: Any, strategy: Any) -> dict[str, tuple[torch.Tensor, torch.device]]:
    """Every long-lived tensor of a worker, with the device it must be on."""
    device = ctx.device
    out: dict[str, tuple[torch.Tensor, torch.device]] = {}
    for name, p in ctx.model.named_parameters():
        out[f"param {name}"] = (p, device)
        if p.grad is not None:
            out[f"grad {name}"] = (p.grad, device)
    for name, b in ctx.model.named_buffers():
        out[f"buffer {name}"] = (b, device)
    for i, (x, y) in enumerate(ctx.val):
        out[f"val {i}"] = (x, device)
        out[f"val target {i}"] = (y, device)
    _optimizer(out, "opt", strategy.opt, device)
    outer = getattr(strategy, "outer_device", None)
    if outer is not None:  # diloco / local_sgd
        out["anchor"] = (strategy.anchor, outer)
        out["theta"] = (strategy.theta, outer)
        _optimizer(out, "outer", strategy.outer, outer)
    for owner in (getattr(strategy, "ef", None), getattr(getattr(strategy, "exchange", None), "ef", None)):
        for key, r in (owner.residuals.items() if owner is not None else ()):
            out[f"error feedback {key}"] = (r, device)
    return out


def _optimizer(out: dict, prefix: str, opt: torch.optim.Optimizer, device: torch.device) -> None:
    for i, state in enumerate(opt.state.values()):
        for key, t in state.items():
            if torch.is_tensor(t) and key != "step":  # torch keeps the step counter on the host
                out[f"{prefix} {i} {key}"] = (t, device)


def misplaced(tensors: dict[str, tuple[torch.Tensor, torch.device]]) -> list[str]:
    return [f"{name} on {t.device}, expected {want}" for name, (t, want) in tensors.items()
            if t.device != want]
