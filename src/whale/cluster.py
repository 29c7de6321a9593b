"""Device catalog, cluster spec (YAML), detection and emulation helpers.

Units everywhere: FLOP/s for compute speeds, bytes for memory, bytes/s for bandwidths. Datasheet memory uses
1 GB = 1e9 bytes (so "V100-32GB" has 32e9 bytes). Catalog numbers are dense datasheet peaks (NVIDIA datasheets):
``fp32_flops`` without tensor cores, ``bf16_flops`` with 16-bit tensor cores.

YAML schema (ranks are numbered node by node; numbers may be written ``5e12``)::

    emulate: true                 # optional, default false
    memory_scale: 1.0e-3          # optional, default 1; applies under emulation
    inter_node_bandwidth: 6.25e9  # optional, bytes/s, default 50 Gb/s
    inter_node_latency: 2.5e-5    # optional, seconds per message between nodes, default 25 us (Ethernet)
    intra_node_latency: 5.0e-6    # optional, seconds per message inside a node, default 5 us (NVLink/PCIe)
    nodes:
      - devices: [V100-32GB, V100-32GB]             # catalog names
        name: a                                     # optional: the node's name (elastic jobs: WHALE_NODE)
        intra_node_bandwidth: 3.0e11                # optional, bytes/s
        host_memory_bytes: 5.12e11                  # optional, bytes of CPU memory (whale.memory.host defaults)
      - devices: {P100-16GB: 1}                     # shorthand {name: count}
      - devices:
          - {name: T4, memory_bytes: 8e9}           # catalog entry with overrides
          - {name: MyGPU, fp32_flops: 5e12, bf16_flops: 2e13, memory_bytes: 8e9, mem_bandwidth: 3e11}

Nothing here starts processes or touches a GPU; detection (:mod:`whale.detect`) only reads
``torch.cuda.get_device_properties``.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from whale.emulation_cores import emulation_cores as emulation_cores  # re-exported: whale.cluster.emulation_cores

GB, TB, TFLOPS = 1e9, 1e12, 1e12  # datasheet units: bytes, bytes, FLOP/s
PCIE_BANDWIDTH = 16e9
"""Default intra-node bandwidth (bytes/s) when not every device of a node has NVLink: PCIe 3.0 x16 (~16 GB/s)."""
DEFAULT_INTER_NODE_BANDWIDTH = 6.25e9
"""50 Gb/s Ethernet = 6.25e9 bytes/s, the paper's testbed (Whale, ATC'22, §5)."""
DEFAULT_INTER_NODE_LATENCY, DEFAULT_INTRA_NODE_LATENCY = 25e-6, 5e-6
"""Seconds per message between nodes (TCP over Ethernet) and inside a node (NVLink/PCIe), typical values."""

_DEVICE_FIELDS = ("fp32_flops", "bf16_flops", "memory_bytes", "mem_bandwidth")
_NODE_KEYS = ("devices", "intra_node_bandwidth", "host_memory_bytes", "name")


class ClusterError(ValueError):
    """A cluster spec Whale cannot use; the message names the bad entry, the value and the fix."""


def _number(value: Any, what: str) -> float:
    """``value`` as a finite float > 0; accepts numeric strings (PyYAML reads ``5e12`` as a string)."""
    try:
        x = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        x = math.nan
    if not (math.isfinite(x) and x > 0):
        raise ClusterError(f"{what} must be a finite number > 0, got {value!r}")
    return x


@dataclass(frozen=True)
class DeviceType:
    """One kind of accelerator (or CPU), with datasheet peaks.

    Attributes:
        name: catalog name (e.g. ``"V100-32GB"``) or a user-chosen name for a custom device.
        fp32_flops: dense fp32 peak without tensor cores, FLOP/s.
        bf16_flops: dense 16-bit (bf16/fp16) tensor-core peak, FLOP/s.
        memory_bytes: device memory, bytes (1 GB = 1e9 bytes).
        mem_bandwidth: memory (HBM/GDDR/DRAM) bandwidth, bytes/s.
        nvlink_bandwidth: total NVLink bandwidth per device, bytes/s; ``None`` when it has none.

    Raises:
        ClusterError: a number is not finite and > 0, or the name is empty.
    """

    name: str
    fp32_flops: float
    bf16_flops: float
    memory_bytes: float
    mem_bandwidth: float
    nvlink_bandwidth: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ClusterError(f"device name must be a non-empty string, got {self.name!r}")
        for f in _DEVICE_FIELDS:
            object.__setattr__(self, f, _number(getattr(self, f), f"device {self.name!r}: {f}"))
        if self.nvlink_bandwidth is not None:
            nv = _number(self.nvlink_bandwidth, f"device {self.name!r}: nvlink_bandwidth")
            object.__setattr__(self, "nvlink_bandwidth", nv)

    def flops(self, dtype: str = "fp32") -> float:
        """Peak FLOP/s for ``dtype``: ``"fp32"``, or ``"bf16"``/``"fp16"`` (tensor cores). Raises ClusterError."""
        if dtype not in ("fp32", "bf16", "fp16"):
            raise ClusterError(f"unknown dtype {dtype!r}; choose 'fp32', 'bf16' or 'fp16'")
        return self.fp32_flops if dtype == "fp32" else self.bf16_flops

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON/YAML-ready)."""
        return dataclasses.asdict(self)


CATALOG: dict[str, DeviceType] = {d.name: d for d in (
    # NVIDIA datasheets (dense peaks). NVLink is the per-GPU total.
    DeviceType("V100-16GB", 15.7 * TFLOPS, 125 * TFLOPS, 16 * GB, 900 * GB, 300 * GB),
    DeviceType("V100-32GB", 15.7 * TFLOPS, 125 * TFLOPS, 32 * GB, 900 * GB, 300 * GB),
    DeviceType("P100-16GB", 10.6 * TFLOPS, 21.2 * TFLOPS, 16 * GB, 732 * GB, 160 * GB),  # SXM2, NVLink 1.0
    DeviceType("P100-PCIE-16GB", 9.3 * TFLOPS, 18.7 * TFLOPS, 16 * GB, 732 * GB, None),
    DeviceType("T4", 8.1 * TFLOPS, 65 * TFLOPS, 16 * GB, 320 * GB, None),
    DeviceType("A100-40GB", 19.5 * TFLOPS, 312 * TFLOPS, 40 * GB, 1555 * GB, 600 * GB),  # ~1.6 TB/s
    DeviceType("A100-80GB", 19.5 * TFLOPS, 312 * TFLOPS, 80 * GB, 2039 * GB, 600 * GB),  # ~2.0 TB/s
    DeviceType("H100-80GB", 67 * TFLOPS, 989 * TFLOPS, 80 * GB, 3.35 * TB, 900 * GB),  # SXM5
    DeviceType("H200", 67 * TFLOPS, 989 * TFLOPS, 141 * GB, 4.8 * TB, 900 * GB),
    # Nominal, not a datasheet: a stand-in for one CPU rank (tests, emulation base).
    DeviceType("CPU", 1 * TFLOPS, 1 * TFLOPS, 16 * GB, 50 * GB, None),
)}
"""Built-in device types by name (case-insensitive lookup via :func:`get_device_type`)."""


def get_device_type(name: str) -> DeviceType:
    """The catalog entry called ``name`` (case-insensitive). Raises ClusterError for an unknown name, listing the
    known names and suggesting the closest."""
    for key, dev in CATALOG.items():
        if key.lower() == str(name).lower():
            return dev
    close = difflib.get_close_matches(str(name).upper(), list(CATALOG), n=1, cutoff=0.4)
    hint = f"did you mean {close[0]!r}? " if close else ""
    raise ClusterError(
        f"unknown device type {name!r}; {hint}known types: {', '.join(CATALOG)} "
        f"(or give a custom device with name and {', '.join(_DEVICE_FIELDS)})"
    )


def _parse_device(entry: Any, where: str) -> DeviceType:
    """A catalog name, or a dict: catalog name plus overrides, or a custom device with every field."""
    if isinstance(entry, DeviceType):
        return entry
    if isinstance(entry, str):
        return get_device_type(entry)
    if not isinstance(entry, dict) or "name" not in entry:
        raise ClusterError(f"{where}: a device is a catalog name or a mapping with 'name', got {entry!r}")
    fields = {f.name for f in dataclasses.fields(DeviceType)}
    unknown = sorted(set(entry) - fields)
    if unknown:
        raise ClusterError(f"{where}: unknown device field(s) {unknown}; allowed: {sorted(fields)}")
    try:
        base = get_device_type(entry["name"]).to_dict()
    except ClusterError:
        base = {}
        missing = [f for f in _DEVICE_FIELDS if f not in entry]
        if missing:
            raise ClusterError(
                f"{where}: custom device {entry['name']!r} is not in the catalog ({', '.join(CATALOG)}) and "
                f"lacks field(s) {', '.join(missing)}; give them (FLOP/s, bytes, bytes/s)"
            ) from None
    return DeviceType(**{**base, **entry})


@dataclass(frozen=True)
class NodeSpec:
    """One machine: its devices in local-rank order and the bandwidth between them.

    Attributes:
        devices: device type of each local rank.
        intra_node_bandwidth: bytes/s between two devices of this node; ``None`` = NVLink bandwidth when every
            device has NVLink (the smallest), else PCIe (:data:`PCIE_BANDWIDTH`).
        host_memory_bytes: the node's CPU memory, bytes, shared by its ranks; ``None``: whale.memory.host's default.
        name: the node's name (an elastic job's agents say which node they are by it: :mod:`whale.runtime.elastic`);
            ``None``: its index in the spec.
    """

    devices: tuple[DeviceType, ...]
    intra_node_bandwidth: float | None = None
    host_memory_bytes: float | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "devices", tuple(self.devices))
        for f in ("intra_node_bandwidth", "host_memory_bytes"):
            if getattr(self, f) is not None:
                object.__setattr__(self, f, _number(getattr(self, f), f))

    def bandwidth(self) -> float:
        """Bandwidth (bytes/s) between two devices of this node, resolving the ``None`` default."""
        if self.intra_node_bandwidth is not None:
            return self.intra_node_bandwidth
        links = [d.nvlink_bandwidth for d in self.devices]
        return min(links) if links and all(x is not None for x in links) else PCIE_BANDWIDTH  # type: ignore


def _parse_node(entry: Any, i: int) -> NodeSpec:
    where = f"nodes[{i}]"
    if not isinstance(entry, dict) or "devices" not in entry:
        raise ClusterError(f"{where}: a node is a mapping with 'devices' (list or {{name: count}}), got {entry!r}")
    unknown = sorted(set(entry) - set(_NODE_KEYS))
    if unknown:
        raise ClusterError(f"{where}: unknown key(s) {unknown}; allowed: {', '.join(_NODE_KEYS)}")
    raw = entry["devices"]
    if isinstance(raw, dict):  # shorthand {name: count}
        items = []
        for name, count in raw.items():
            if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                raise ClusterError(f"{where}: device count for {name!r} must be an int >= 1, got {count!r}")
            items += [name] * count
        raw = items
    if not isinstance(raw, list) or not raw:
        raise ClusterError(f"{where}: 'devices' must be a non-empty list or {{name: count}} mapping")
    devices = tuple(_parse_device(d, f"{where}.devices[{j}]") for j, d in enumerate(raw))
    name = entry.get("name")
    if name is not None and (not isinstance(name, str | int) or isinstance(name, bool) or not str(name)):
        raise ClusterError(f"{where}: name must be a non-empty string, got {name!r}")
    return NodeSpec(devices, entry.get("intra_node_bandwidth"), entry.get("host_memory_bytes"),
                    None if name is None else str(name))


@dataclass(frozen=True)
class ClusterSpec:
    """The devices and links a job runs on; ranks are numbered node by node, devices in order.

    Attributes:
        nodes: the machines, in rank order.
        inter_node_bandwidth: bytes/s between nodes (default 50 Gb/s Ethernet = 6.25e9 B/s, the paper's testbed).
        emulate: CPU ranks imitate their declared devices (:mod:`whale.runtime.emulation`); every report must say so.
        memory_scale: under emulation, memory capacity = declared memory x this factor (lets tests hit limits).
        inter_node_latency, intra_node_latency: seconds per message between nodes / inside a node (the cost
            model's latency term, :mod:`whale.planner.steptime.cost`).

    Raises:
        ClusterError: no nodes, a bad bandwidth, latency or memory_scale.
    """

    nodes: tuple[NodeSpec, ...]
    inter_node_bandwidth: float = DEFAULT_INTER_NODE_BANDWIDTH
    emulate: bool = False
    memory_scale: float = 1.0
    inter_node_latency: float = DEFAULT_INTER_NODE_LATENCY
    intra_node_latency: float = DEFAULT_INTRA_NODE_LATENCY

    def __post_init__(self) -> None:
        object.__setattr__(self, "nodes", tuple(self.nodes))
        if not self.nodes or any(not n.devices for n in self.nodes):
            raise ClusterError("cluster spec is empty: give at least one node with at least one device")
        object.__setattr__(self, "inter_node_bandwidth", _number(self.inter_node_bandwidth, "inter_node_bandwidth"))
        object.__setattr__(self, "memory_scale", _number(self.memory_scale, "memory_scale"))
        for f in ("inter_node_latency", "intra_node_latency"):
            object.__setattr__(self, f, _number(getattr(self, f), f))
        if not isinstance(self.emulate, bool):
            raise ClusterError(f"emulate must be true or false, got {self.emulate!r}")

    def devices(self) -> list[DeviceType]:
        """Device type of every rank, in rank order."""
        return [d for n in self.nodes for d in n.devices]

    @property
    def world_size(self) -> int:
        """Number of ranks (devices) the spec declares."""
        return sum(len(n.devices) for n in self.nodes)

    def node_of(self, rank: int) -> int:
        """Index of the node holding ``rank``. Raises ClusterError when rank is out of range."""
        if not 0 <= rank < self.world_size:
            raise ClusterError(f"rank {rank} is out of range for a cluster of {self.world_size} devices")
        for i, n in enumerate(self.nodes):
            if rank < len(n.devices):
                return i
            rank -= len(n.devices)
        raise AssertionError("unreachable")

    def link_bandwidth(self, rank_a: int, rank_b: int) -> float:
        """Bandwidth (bytes/s) between two ranks: the node's intra-node link, or the inter-node link."""
        na, nb = self.node_of(rank_a), self.node_of(rank_b)
        return self.nodes[na].bandwidth() if na == nb else self.inter_node_bandwidth

    def link_latency(self, rank_a: int, rank_b: int) -> float:
        """Seconds per message between two ranks: ``intra_node_latency`` on one node, else ``inter_node_latency``."""
        return self.intra_node_latency if self.node_of(rank_a) == self.node_of(rank_b) else self.inter_node_latency

    def check_world_size(self, world_size: int) -> None:
        """Raise ClusterError unless the spec declares exactly ``world_size`` devices."""
        if self.world_size != world_size:
            raise ClusterError(
                f"cluster spec declares {self.world_size} devices but world size is {world_size}; "
                f"launch {self.world_size} ranks or edit the spec so its nodes list {world_size} devices"
            )

    def describe(self) -> list[str]:
        """Printable lines: one per rank with its type, and a banner when emulated."""
        lines = []
        if self.emulate:
            lines.append(f"EMULATED cluster (CPU ranks imitate the devices below; memory x {self.memory_scale:g})")
        for r, d in enumerate(self.devices()):
            lines.append(
                f"rank {r} node {self.node_of(r)}: {d.name} {d.fp32_flops / TFLOPS:g} TFLOPS fp32, "
                f"{memory_capacity(self, r) / GB:g} GB"
            )
        return lines

    def to_dict(self) -> dict[str, Any]:
        """Plain dict in the YAML schema; catalog devices by name, custom ones in full."""
        nodes = []
        for n in self.nodes:
            node: dict[str, Any] = {"devices": [d.name if CATALOG.get(d.name) == d else d.to_dict() for d in n.devices]}
            for f in ("intra_node_bandwidth", "host_memory_bytes", "name"):
                if getattr(n, f) is not None:
                    node[f] = getattr(n, f)
            nodes.append(node)
        return {"emulate": self.emulate, "memory_scale": self.memory_scale,
                "inter_node_bandwidth": self.inter_node_bandwidth, "inter_node_latency": self.inter_node_latency,
                "intra_node_latency": self.intra_node_latency, "nodes": nodes}

    @classmethod
    def from_dict(cls, data: Any) -> ClusterSpec:
        """Build from the YAML schema (module docs). Raises ClusterError naming the offending entry."""
        if not isinstance(data, dict):
            raise ClusterError(f"cluster spec must be a mapping with 'nodes', got {type(data).__name__}")
        allowed = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise ClusterError(f"unknown cluster spec key(s) {unknown}; allowed: {sorted(allowed)}")
        nodes = data.get("nodes")
        if not isinstance(nodes, list) or not nodes:
            raise ClusterError("cluster spec is empty: 'nodes' must be a non-empty list of {devices: [...]}")
        given = {k: data[k] for k in allowed - {"nodes"} if k in data}  # the rest: the dataclass defaults
        return cls(nodes=tuple(_parse_node(n, i) for i, n in enumerate(nodes)), **given)

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterSpec:
        """Read a YAML spec file. Raises ClusterError (missing file, bad YAML, bad content)."""
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise ClusterError(f"cannot read cluster spec {str(path)!r}: {e}") from None
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise ClusterError(f"cluster spec {str(path)!r} is not valid YAML: {e}") from None
        try:
            return cls.from_dict(data)
        except ClusterError as e:
            raise ClusterError(f"cluster spec {str(path)!r}: {e}") from None

    def to_yaml(self) -> str:
        """The spec as YAML text (readable back with :meth:`from_yaml`)."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def from_device_types(devices: list[DeviceType], ranks_per_node: int | None = None, **kwargs: Any) -> ClusterSpec:
    """A spec from one device type per rank, ``ranks_per_node`` ranks to a node (default: one node).

    ``kwargs`` go to :class:`ClusterSpec` (e.g. ``emulate``). Raises ClusterError on empty input.
    """
    if not devices:
        raise ClusterError("cluster spec is empty: no devices given")
    k = ranks_per_node or len(devices)
    nodes = tuple(NodeSpec(tuple(devices[i : i + k])) for i in range(0, len(devices), k))
    return ClusterSpec(nodes=nodes, **kwargs)


def homogeneous_cpu(n: int) -> ClusterSpec:
    """``n`` identical (nominal) CPU ranks on one node, not emulated. Raises ClusterError if n < 1."""
    if n < 1:
        raise ClusterError(f"need at least one device, got n={n}")
    return from_device_types([CATALOG["CPU"]] * n)


def emulation_delays(spec: ClusterSpec) -> list[float]:
    """Per-rank slowdown factor s_max / s_i - 1 by fp32 peak: after a compute segment of t seconds, rank i waits
    about ``t * factor`` (see :class:`whale.runtime.emulation.EmulatedDevice`) so it runs at its declared speed
    relative to the fastest device. The fastest rank gets 0.0. Pure; applies whether or not ``spec.emulate`` is set."""
    speeds = [d.fp32_flops for d in spec.devices()]
    top = max(speeds)
    return [top / s - 1.0 for s in speeds]


def memory_capacity(spec: ClusterSpec, rank: int) -> float:
    """Memory (bytes) rank ``rank`` may use: declared memory, times ``memory_scale`` when emulating."""
    spec.node_of(rank)  # range check
    return spec.devices()[rank].memory_bytes * (spec.memory_scale if spec.emulate else 1.0)
