"""The one table of hardware figures the planner uses, with where each comes from.

GPU figures are the vendors' data-sheet numbers (dense, no sparsity): usable memory as the driver
reports it, HBM bandwidth, bf16 tensor throughput, the intra-node link per GPU per direction, and an
inter-node default of one 400 Gb/s NIC per GPU. The step-time model applies efficiencies to them
(`timing.py`); nothing here is measured by Tandem except the `cpu` row.

The `cpu` row is this project's 2-core development machine, measured (docs/benchmarks.md, FACTS.md):
~17 GB/s for reading weights in a decode step; 384 GFLOP/s is the fp32 peak of 2 AVX-512 cores (2 FMA
units x 16 lanes x 2 x ~3 GHz x 2 cores), of which prefill reached ~330 and decode linears ~270 GFLOP/s;
in-process copies at ~16.6 GB/s and a gloo broadcast at ~2.65 GB/s. Its memory is the machine's RAM
(read from /proc/meminfo when present), shared by the trainer and the embedded engine.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

__all__ = ["DEVICES", "Device", "device"]

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class Device:
    name: str
    memory_gib: float  # usable device memory per GPU (host RAM for cpu)
    hbm_gbps: float  # memory bandwidth, GB/s
    bf16_tflops: float  # dense tensor throughput (fp32 matmul throughput for cpu)
    link_gbps: float  # intra-node GPU-to-GPU, per direction (NVLink / xGMI / PCIe)
    internode_gbps: float = 50.0  # per GPU, one 400 Gb/s NIC
    gpus_per_node: int = 8
    host_memory_gib: float = 1800.0  # per node, for CPU offload
    host_link_gbps: float = 64.0  # GPU <-> host per GPU per direction (PCIe Gen5 x16; Gen4 x16: 32), for offload
    fp8: bool = True
    source: str = ""

    @property
    def is_cpu(self) -> bool:
        return self.name == "cpu"


DEVICES: dict[str, Device] = {d.name: d for d in [
    Device("H100", 79.6, 3350, 989, 450, source="NVIDIA H100 SXM5 data sheet (80 GB HBM3, NVLink 4 900 GB/s)"),
    Device("H200", 139.8, 4800, 989, 450, source="NVIDIA H200 SXM data sheet (141 GB HBM3e, NVLink 4)"),
    Device("B200", 178.4, 8000, 2250, 900, source="NVIDIA B200 (HGX) data sheet (180 GB HBM3e, NVLink 5)"),
    Device("A100", 79.2, 2039, 312, 300, fp8=False, host_link_gbps=32.0,
           source="NVIDIA A100 SXM4 80GB data sheet (NVLink 3, PCIe Gen4)"),
    Device("A100-40GB", 39.4, 1555, 312, 300, fp8=False, host_link_gbps=32.0,
           source="NVIDIA A100 SXM4 40GB data sheet (PCIe Gen4)"),
    Device("H20", 95.0, 4000, 148, 450, source="NVIDIA H20 (96 GB HBM3, 148 TFLOPS bf16)"),
    Device("L40S", 44.4, 864, 362, 32, internode_gbps=25.0, host_link_gbps=32.0,
           source="NVIDIA L40S data sheet (48 GB GDDR6, PCIe Gen4 x16, no NVLink)"),
    Device("RTX4090", 23.6, 1008, 165, 32, internode_gbps=12.5, gpus_per_node=1, host_memory_gib=128.0, fp8=False,
           host_link_gbps=32.0,
           source="NVIDIA GeForce RTX 4090 (24 GB GDDR6X, 165 TFLOPS bf16 with fp32 accumulate, PCIe)"),
    Device("MI300X", 191.5, 5300, 1307, 64 * 7, source="AMD Instinct MI300X data sheet (192 GB HBM3, 7 x 64 GB/s xGMI)"),
    Device("cpu", 23.0, 17.0, 0.384, 16.6, internode_gbps=2.65, gpus_per_node=1, host_memory_gib=0.0, fp8=False,
           source="measured on the 2-core development machine (docs/benchmarks.md)"),
]}

_ALIASES = {"h100-80gb": "H100", "h800": "H100", "a800": "A100", "a100-80gb": "A100", "b200-180gb": "B200",
            "mi300": "MI300X", "4090": "RTX4090"}


def _ram_gib() -> float | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        return None
    return None


def device(name: str, memory_gib: float | None = None) -> Device:
    """The table row for ``name`` (case-insensitive; H800/A800 count as H100/A100), ``memory_gib`` overriding
    its memory. ``cpu`` takes this machine's RAM unless given."""
    key = _ALIASES.get(name.lower(), name)
    match = next((d for n, d in DEVICES.items() if n.lower() == key.lower()), None)
    if match is None:
        raise ValueError(f"unknown GPU type {name!r} (known: {', '.join(DEVICES)}; "
                         "another GPU: the closest type with --gpu-memory-gib)")
    if memory_gib is not None:
        if memory_gib <= 0:
            raise ValueError(f"--gpu-memory-gib {memory_gib} must be > 0")
        return replace(match, memory_gib=float(memory_gib))
    if match.is_cpu and os.path.exists("/proc/meminfo"):
        ram = _ram_gib()
        if ram:
            return replace(match, memory_gib=round(ram, 1))
    return match
