"""The GPU models CPN prices and schedules, and how to recognise them in a node's labels.

TFLOPs are peak dense bf16 from the vendors' data sheets (no sparsity): the performance model
scales them by an efficiency factor, so only their ratios need to be right.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from cpn.runtime.costmodel import CPU_SLOT_TFLOPS as CPU_SLOT_TFLOPS  # one source, re-exported


@dataclass(frozen=True, kw_only=True)
class GpuModelInfo:
    model: str
    tflops: float
    memory_gb: int
    memory_variants_gb: tuple[int, ...]
    intra_node_gbps: int
    """NVLink (or PCIe when there is none) per GPU, in the unit of `interconnect.intraNodeGbps`."""
    inter_node_gbps: int
    """The usual fabric between nodes of such a cluster (InfiniBand / RoCE / Ethernet)."""
    marker: str
    """Substring of a normalised product label (`NVIDIA-H100-80GB-HBM3`) naming this model."""


CATALOGUE: tuple[GpuModelInfo, ...] = (
    GpuModelInfo(model="H100", tflops=989.0, memory_gb=80, memory_variants_gb=(80, 94),
                 intra_node_gbps=900, inter_node_gbps=400, marker="H100"),
    GpuModelInfo(model="A100", tflops=312.0, memory_gb=80, memory_variants_gb=(40, 80),
                 intra_node_gbps=600, inter_node_gbps=200, marker="A100"),
    GpuModelInfo(model="L40S", tflops=362.0, memory_gb=48, memory_variants_gb=(48,),
                 intra_node_gbps=64, inter_node_gbps=100, marker="L40S"),
    GpuModelInfo(model="RTX4090", tflops=165.0, memory_gb=24, memory_variants_gb=(24,),
                 intra_node_gbps=64, inter_node_gbps=25, marker="RTX-4090"),
)

CPU_SLOT_MODEL = "CPU"
_BY_MODEL = {info.model: info for info in CATALOGUE}
_MEMORY_RE = re.compile(r"(?<![0-9])(\d{2,3})GB")


def get(model: str) -> GpuModelInfo:
    """The catalogue entry of a CPN model name (`H100`); KeyError names the known models."""
    try:
        return _BY_MODEL[model]
    except KeyError:
        raise KeyError(f"unknown GPU model {model!r}; known: {', '.join(_BY_MODEL)}") from None


def models() -> list[str]:
    return list(_BY_MODEL)


def normalise(product: str) -> str:
    """`NVIDIA GeForce RTX 4090` and `NVIDIA-GeForce-RTX-4090` both become `NVIDIA-GEFORCE-RTX-4090`."""
    return re.sub(r"[\s_]+", "-", product.strip()).upper()


def lookup(product_label: str) -> GpuModelInfo | None:
    """Map a `nvidia.com/gpu.product` label (or a CUDA device name) to a catalogue entry.

    A memory size in the label (`NVIDIA-A100-SXM4-40GB`) picks that variant when the model has it.
    """
    product = normalise(product_label)
    for info in CATALOGUE:
        if info.marker in product:
            memory = _MEMORY_RE.search(product)
            if memory and int(memory.group(1)) in info.memory_variants_gb:
                return dataclasses.replace(info, memory_gb=int(memory.group(1)))
            return info
    return None
