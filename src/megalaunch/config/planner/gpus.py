"""What megalaunch knows of a GPU by its name: dense bf16 peak (MFU, the planner), memory (the
preflight memory check, the planner) and the bandwidths the planner's throughput model uses.
Standard library only: status, report and preflight run on login nodes."""

from __future__ import annotations

import re
from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class GPUSpec:
    name: str  # the substring matched in torch.cuda.get_device_name() or cluster.gpu
    peak_tflops: float  # dense bf16
    memory_gib: float  # what torch.cuda.get_device_properties().total_memory reports, in GiB
    hbm_tbps: float  # memory bandwidth, TB/s
    nvlink_gbps: float  # achievable ring bus bandwidth inside a node per GPU, GB/s (NCCL all-reduce)
    capability: tuple[int, int]  # CUDA compute capability: which MoE experts the job builds (fit.grouped_experts)


# First match wins: a more specific name comes before the name it contains ("H100 PCIe" before "H100").
GPUS: tuple[GPUSpec, ...] = (
    GPUSpec("GH200", 989.0, 94.5, 4.0, 360.0, (9, 0)),
    GPUSpec("H200", 989.0, 139.8, 4.8, 360.0, (9, 0)),
    GPUSpec("H100 PCIe", 756.0, 79.2, 2.0, 50.0, (9, 0)),
    GPUSpec("H100 NVL", 835.0, 93.1, 3.9, 300.0, (9, 0)),
    GPUSpec("H100", 989.0, 79.2, 3.35, 360.0, (9, 0)),
    GPUSpec("H800", 989.0, 79.2, 3.35, 160.0, (9, 0)),
    GPUSpec("GB200", 2500.0, 184.0, 8.0, 720.0, (10, 0)),
    GPUSpec("B200", 2250.0, 178.4, 8.0, 720.0, (10, 0)),
    GPUSpec("A100-40GB", 312.0, 39.4, 1.55, 230.0, (8, 0)),
    GPUSpec("A100 40GB", 312.0, 39.4, 1.55, 230.0, (8, 0)),
    GPUSpec("A100-SXM4-40GB", 312.0, 39.4, 1.55, 230.0, (8, 0)),
    GPUSpec("A100", 312.0, 79.2, 2.0, 230.0, (8, 0)),
    GPUSpec("A800", 312.0, 79.2, 2.0, 160.0, (8, 0)),
    GPUSpec("L40S", 362.0, 44.4, 0.86, 25.0, (8, 9)),
)


def gpu_spec(name: str | None) -> GPUSpec | None:
    """The spec of a GPU named `name` (a device name or a cluster profile's `gpu`), first match wins."""
    if not name:
        return None
    for spec in GPUS:
        if re.search(re.escape(spec.name), name, re.I):
            return spec
    return None


def known_gpus() -> str:
    return ", ".join(dict.fromkeys(s.name for s in GPUS))
