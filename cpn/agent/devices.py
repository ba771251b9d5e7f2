"""The local agent's devices, and which sub-task holds which.

Found once at start: CUDA devices as torch counts them when torch is installed and sees any, else
the GPUs ``nvidia-smi -L`` lists, else those under ``/proc/driver/nvidia/gpus`` (the agent does not
need torch), else the ``--gpus`` count declared as CPU slots ``0..N-1``. An agent started with
``CUDA_VISIBLE_DEVICES`` set owns only those GPUs.

Each launched sub-task gets a disjoint set, one device per worker; the set travels in its attempt
contract (:class:`cpn.runtime.contract.Devices`), so the run directory's ``spec.json`` records it
and a restarted agent restores it when it re-adopts the run. It is freed when the run ends.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from cpn.runtime.contract import AttemptSpec, Devices
from layers.resource.drivers.base import DriverError

NVIDIA_PROC = Path("/proc/driver/nvidia/gpus")


def run_key(spec: AttemptSpec) -> str:
    return f"{spec.job_uid or spec.job}/{spec.attempt}/{spec.subtask}"


def cuda_ids(environ: dict[str, str] | None = None, proc: Path = NVIDIA_PROC) -> list[str]:
    """The GPUs this machine shows the agent (indices as CUDA_VISIBLE_DEVICES takes them)."""
    env = os.environ if environ is None else environ
    count = _torch_count()
    if count is None:
        count = _nvidia_smi_count()
    if count is None:
        count = len(list(proc.iterdir())) if proc.is_dir() else 0
    visible = [x.strip() for x in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if x.strip()]
    if visible and "CUDA_VISIBLE_DEVICES" in env:
        return visible[:count]  # torch counts inside the agent's own visible set
    return [str(i) for i in range(count)]


def _torch_count() -> int | None:
    try:
        import torch
    except ImportError:
        return None
    return torch.cuda.device_count() if torch.cuda.is_available() else None


def _nvidia_smi_count() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return len(re.findall(r"^GPU \d+:", out, flags=re.MULTILINE))


@dataclass
class DevicePool:
    """Devices ``ids`` of one ``kind``; ``held`` maps a run's key to the ids it holds."""

    kind: str
    ids: list[str]
    held: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def discover(cls, declared: int | None) -> DevicePool:
        found = cuda_ids()
        if found:
            return cls("cuda", found)
        return cls("slot", [str(i) for i in range(declared or 1)])

    def free(self) -> list[str]:
        taken = {i for ids in self.held.values() for i in ids}
        return [i for i in self.ids if i not in taken]

    def assign(self, spec: AttemptSpec) -> Devices:
        """A disjoint set for the sub-task's workers (the same one when asked again for the same run)."""
        key = run_key(spec)
        if key in self.held:
            return Devices(kind=self.kind, ids=self.held[key])  # type: ignore[arg-type]
        free = self.free()
        if self.kind == "cuda":
            present = set(cuda_ids())
            missing = [i for i in free if i not in present]
            if missing:
                raise DriverError(f"GPUs {','.join(missing)} of this site are no longer visible "
                                  f"(nvidia-smi lists {len(present)}): the sub-task's GPUs are not there")
            free = [i for i in free if i in present]
        if len(free) < spec.workers:
            raise DriverError(f"the sub-task needs {spec.workers} device(s) and {len(free)} of this site's "
                              f"{len(self.ids)} {self.kind} device(s) are free ({len(self.held)} run(s) hold the "
                              "others): its leased GPUs are not there")
        self.held[key] = free[:spec.workers]
        return Devices(kind=self.kind, ids=self.held[key])  # type: ignore[arg-type]

    def restore(self, spec: AttemptSpec) -> None:
        """A re-adopted run keeps the devices its contract names."""
        if spec.devices is not None:
            self.held[run_key(spec)] = list(spec.devices.ids)

    def release(self, spec: AttemptSpec) -> None:
        self.held.pop(run_key(spec), None)
