"""Host (CPU) memory per node: the catalog defaults, each rank's share, and the emulated host out-of-memory error.

Units: bytes; datasheet sizes use 1 GB = 1e9 bytes as in :mod:`whale.cluster`. A node's host memory is declared
in the cluster spec (``nodes[i].host_memory_bytes``) or, when not given, is the sum over its devices of
:data:`HOST_MEMORY_PER_DEVICE` (the host memory of the reference server for that device divided by its GPUs):

========================  ===================================  ==========
device type               reference server                     per device
========================  ===================================  ==========
V100-16GB / V100-32GB     DGX-1 (8 x V100, 512 GB)             64 GB
P100-16GB / P100-PCIE     DGX-1 P100 (8 x P100, 512 GB)        64 GB
T4                        4 x T4 server (e.g. AWS g4dn.12xlarge, 192 GB)  48 GB
A100-40GB                 DGX A100 320GB (8 x A100, 1 TB)      128 GB
A100-80GB                 DGX A100 640GB (8 x A100, 2 TB)      256 GB
H100-80GB / H200          DGX H100 / H200 (8 GPUs, 2 TB)       256 GB
CPU (nominal test rank)   -                                    64 GB
custom device             -                                    4 x its device memory
========================  ===================================  ==========

So a node of 8 V100s defaults to 512 GB (a DGX-1). The node's ranks share its host memory evenly: a rank may
hold ``host_memory_bytes / ranks on the node`` (x ``memory_scale`` under emulation) of offloaded state
(:mod:`whale.runtime.offload`), checked by :class:`whale.memory.monitor.MemoryMonitor` each step.
"""

from __future__ import annotations

from whale.units import format_bytes

GB = 1e9
HOST_MEMORY_PER_DEVICE: dict[str, float] = {
    "V100-16GB": 64 * GB, "V100-32GB": 64 * GB, "P100-16GB": 64 * GB, "P100-PCIE-16GB": 64 * GB, "T4": 48 * GB,
    "A100-40GB": 128 * GB, "A100-80GB": 256 * GB, "H100-80GB": 256 * GB, "H200": 256 * GB, "CPU": 64 * GB,
}
"""Default host memory (bytes) a node provides per device of each catalog type (see the module docstring)."""
CUSTOM_HOST_FACTOR = 4.0
"""Default host memory of a device type not in :data:`HOST_MEMORY_PER_DEVICE`: this many times its memory."""


def node_host_memory(node) -> float:
    """Host memory (bytes) of ``node`` (a :class:`whale.cluster.NodeSpec`): its declared ``host_memory_bytes``,
    else the sum over its devices of each one's catalog default (see the module docstring)."""
    if node.host_memory_bytes is not None:
        return node.host_memory_bytes
    return float(sum(HOST_MEMORY_PER_DEVICE.get(d.name, CUSTOM_HOST_FACTOR * d.memory_bytes) for d in node.devices))


def host_memory_capacity(spec, rank: int) -> float:
    """Host memory (bytes) rank ``rank`` of cluster ``spec`` (:class:`whale.cluster.ClusterSpec`) may use: its
    node's host memory divided evenly by the node's ranks, times ``memory_scale`` when emulating.

    Raises:
        ClusterError: ``rank`` out of range.
    """
    node = spec.nodes[spec.node_of(rank)]
    return node_host_memory(node) * (spec.memory_scale if spec.emulate else 1.0) / len(node.devices)


class EmulatedHostOutOfMemoryError(RuntimeError):
    """Under an emulated cluster, a rank's measured peak of host memory (offloaded parameters, gradients and
    optimizer state: :mod:`whale.runtime.offload`) exceeded its share of its node's host memory. Raised on every
    rank with the same message, naming each over-capacity rank, its node, the bytes needed and the capacity.

    Attributes:
        over: ``[(rank, node, needed_bytes, capacity_bytes)]``.
    """

    def __init__(self, over: list[tuple]) -> None:
        self.over = over
        parts = [f"rank {r} (node {node}) needed {format_bytes(need)} of host memory at its peak but its share of "
                 f"the node's host memory is {format_bytes(cap)}" for r, node, need, cap in over]
        super().__init__("emulated host out of memory: " + "; ".join(parts) + ". The node's host_memory_bytes "
                         "(x memory_scale) is shared evenly by its ranks; shard the offloaded state over more "
                         "lanes (Config(zero=1 or 2)), offload less (offload='optimizer' or 'none'), or declare "
                         "more host memory (cluster spec nodes[i].host_memory_bytes) or a larger memory_scale")
