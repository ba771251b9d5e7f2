"""How much of a GPU's peak the compute model assumes a training step achieves (MFU), per GPU model.

The figures are model-FLOPs utilisation for dense transformer training in bf16 at moderate scale,
as reported for Megatron/torchtitan-style runs: big-memory parts with fast HBM sustain more of
their (lower) peak than parts whose peak outruns their memory bandwidth. The model multiplies the
catalogue's peak TFLOPs by these factors, so only the products need to be right.

Local slots (the `local` driver on a machine with no GPU) appear to the planner as a "GPU" of
model ``CPU``: one slot is one core running fp32 PyTorch at ``CPU_SLOT_TFLOPS`` of matmul peak, of
which a training step of the built-in ``tiny`` LM gets 0.40: 0.040 TFLOP/s (6·parameters·tokens) per
CPU-second, measured once on this machine (2026-11-25) with one torch thread, AdamW, 8 sequences × 128
tokens (a bench rank's share of the 4,096-token batch), timed by the thread's CPU time so that other
load on the shared machine does not count (200 steps a run, three runs: 0.0397–0.0409). Slots of one
machine share memory (80 Gbit/s "NVLink") and machines talk over 10 Gbit/s Ethernet; slots that
share a machine's cores are priced with ``perf.predict(host_cores=...)``.
"""

from __future__ import annotations

from decimal import Decimal

from cpn.runtime.costmodel import CPU_SLOT_MFU
from layers.orchestration.planning.types import ClusterOffer
from layers.resource.gpus import CPU_SLOT_TFLOPS

__all__ = ["CPU_MODEL", "CPU_TFLOPS", "MFU", "effective_tflops", "local_slot_offer", "mfu"]

CPU_MODEL = "CPU"
CPU_TFLOPS = CPU_SLOT_TFLOPS
CPU_MEMORY_GB = 4.0
DEFAULT_MFU = 0.35

MFU: dict[str, float] = {
    "H100": 0.40,
    "A100": 0.45,
    "L40S": 0.35,
    "RTX4090": 0.30,
    CPU_MODEL: CPU_SLOT_MFU,  # measured: module docstring
}


def mfu(gpu_model: str) -> float:
    """Calibrated utilisation of `gpu_model`; unknown models get :data:`DEFAULT_MFU`."""
    return MFU.get(gpu_model, DEFAULT_MFU)


def effective_tflops(gpu_model: str, peak_tflops: float) -> float:
    """TFLOP/s one GPU of this model delivers to a training step."""
    return peak_tflops * mfu(gpu_model)


def local_slot_offer(name: str, site: str, slots: int, *, region: str = "local", provider: str = "local",
                     price_per_slot_hour: Decimal = Decimal("0")) -> ClusterOffer:
    """The offer of a `local`-driver cluster whose slots are CPU cores: one slot = one CPU "GPU"."""
    return ClusterOffer(name=name, site=site, region=region, provider=provider, gpu_model=CPU_MODEL,
                        tflops=CPU_TFLOPS, memory_gb=CPU_MEMORY_GB, free_gpus=slots,
                        price_per_gpu_hour=price_per_slot_hour, intra_node_gbps=80.0, inter_node_gbps=10.0,
                        gpus_per_node=max(1, slots), driver="local")
