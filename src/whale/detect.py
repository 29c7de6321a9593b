"""Detecting the cluster a job runs on: the catalog type of each local CUDA device, and a spec for the job.

Kept apart from :mod:`whale.cluster` (the catalog and the spec data), which it builds on.
"""

from __future__ import annotations

from whale.cluster import CATALOG, TB, ClusterError, ClusterSpec, DeviceType, from_device_types, homogeneous_cpu


def detect_local_device(index: int = 0) -> DeviceType:
    """The catalog type of local CUDA device ``index`` (from ``torch.cuda.get_device_properties``).

    Matching: the catalog family named in the device name (H200, H100, A100, V100, P100, T4; "PCIE" picks the
    PCIe P100), then the entry whose memory is closest. An unknown GPU becomes a custom type with a rough
    estimate: SMs x 128 lanes x 2 FLOP x 1.5 GHz fp32, 8x that for bf16 on compute capability >= 8 (2x before),
    and 1 TB/s memory bandwidth. Requires CUDA.
    """
    import torch

    p = torch.cuda.get_device_properties(index)
    name = p.name.upper().replace(" ", "-")
    for family in ("H200", "H100", "A100", "V100", "P100", "T4"):
        if family in name:
            cands = [d for k, d in CATALOG.items() if k.startswith(family)]
            if family == "P100":
                cands = [d for d in cands if ("PCIE" in d.name) == ("PCIE" in name)] or cands
            return min(cands, key=lambda d: abs(d.memory_bytes - p.total_memory))
    fp32 = p.multi_processor_count * 128 * 2 * 1.5e9
    return DeviceType(p.name, fp32, fp32 * (8 if p.major >= 8 else 2), float(p.total_memory), 1 * TB)


def detect_cluster(world_size: int) -> ClusterSpec:
    """The cluster this job most likely runs on: with CUDA, every node is taken to look like this one (rank r
    uses local device ``r % device_count``); without CUDA, ``world_size`` nominal CPU devices on one node.
    Mixed multi-node clusters cannot be seen from one process: give a spec, or gather each rank's
    :func:`detect_local_device` at run time and use :func:`from_device_types`. Raises ClusterError if < 1."""
    import torch

    if world_size < 1:
        raise ClusterError(f"world size must be >= 1, got {world_size}")
    if not torch.cuda.is_available() or torch.cuda.device_count() == 0:
        return homogeneous_cpu(world_size)
    k = torch.cuda.device_count()
    local = [detect_local_device(i) for i in range(k)]
    return from_device_types([local[r % k] for r in range(world_size)], ranks_per_node=min(k, world_size))
