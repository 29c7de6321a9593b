"""Per-rank memory measurement during training, the emulated out-of-memory check and the memory table.

The :class:`MemoryMonitor` of an engine measures each step: on CPU (and wherever ``Config.track_memory`` is
on) with a :class:`~whale.memory.tracker.StorageTracker` (live storage by category), on CUDA also with the
allocator's own peak (``torch.cuda.max_memory_allocated``, reset every step). Under an emulated cluster every
rank compares its measured peak with its declared device memory (x ``memory_scale``) at the end of each step,
and all ranks agree (one all-reduce of the peaks) so that an over-capacity rank stops every rank with the same
:class:`EmulatedOutOfMemoryError` instead of leaving its peers waiting.

With offload (:mod:`whale.runtime.offload`, attached by :meth:`MemoryMonitor.attach_host`) host memory is
measured apart (the tracker's host categories; on CUDA without the tracker, the host tensors by identity),
reported as ``host_peak_memory_bytes`` / ``host_memory`` and, under emulation, bounded by the rank's share of its
node's host memory in the same all-reduce (:class:`whale.memory.host.EmulatedHostOutOfMemoryError`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from whale.cluster import memory_capacity
from whale.memory.host import EmulatedHostOutOfMemoryError
from whale.memory.tracker import CATEGORIES, HOST_CATEGORIES, StorageTracker
from whale.units import format_bytes


class EmulatedOutOfMemoryError(RuntimeError):
    """Under an emulated cluster, a rank's measured peak exceeded its declared device memory (x
    ``memory_scale``). Raised on every rank; the message names each over-capacity rank, its device, the bytes
    it needed, its capacity and the planner's prediction.

    Attributes:
        over: ``[(rank, device, needed_bytes, capacity_bytes, predicted_bytes or None)]``.
    """

    def __init__(self, over: list[tuple]) -> None:
        self.over = over
        parts = [f"rank {r} ({dev}) needed {format_bytes(need)} at its peak but has {format_bytes(cap)} "
                 f"(planner predicted {format_bytes(pred) if pred else 'nothing: model not profiled'})"
                 for r, dev, need, cap, pred in over]
        super().__init__("emulated out of memory: " + "; ".join(parts) + ". Use activation checkpointing "
                         "(Config(activation_checkpoint=...)), more micro-batches, more pipeline stages or a "
                         "larger memory_scale")


class MemoryMonitor:
    """Measures one rank's memory per step (see the module docstring).

    Args:
        module, optimizer: this rank's stage module and optimizer (their tensors are labelled by identity).
        device: this rank's compute device.
        track: ``Config.track_memory`` (``None``: auto, on when ``capacity`` is given).
        capacity: emulation only, this rank's memory capacity in bytes (``None``: no check).
        rank, world_size, device_names, predicted: for the out-of-memory check and the table (``predicted``:
            the plan's per-rank predicted peak bytes, possibly empty).
    """

    def __init__(self, module: nn.Module, optimizer, device: torch.device, track: bool | None,
                 capacity: float | None, rank: int, world_size: int, device_names: tuple[str, ...] = (),
                 predicted: tuple[float, ...] = ()) -> None:
        self.module, self.optimizer, self.device = module, optimizer, device
        self.rank, self.world_size, self.capacity = rank, world_size, capacity
        self.names, self.predicted = device_names, predicted
        self.cuda = device.type == "cuda" and track is not False
        self.tracker = StorageTracker() if track or (track is None and capacity is not None) else None
        self.steps, self.peak, self.at_peak = 0, 0, {}
        self.category_peaks = dict.fromkeys(CATEGORIES + HOST_CATEGORIES, 0)
        self.host, self.host_capacity, self.node, self.host_peak, self.host_at_peak = None, None, 0, 0, {}
        if self.tracker is not None:
            self._hook()

    @classmethod
    def for_rank(cls, module: nn.Module, optimizer, ctx, plan) -> MemoryMonitor:
        """The monitor of an engine: ``ctx`` (:class:`whale.runtime.context.Context`) gives the device, the
        config's ``track_memory`` and, under an emulated cluster, the rank's capacity; ``plan`` the device names
        and predicted bytes."""
        emulated = ctx.cluster is not None and ctx.cluster.emulate
        return cls(module, optimizer, ctx.device, ctx.config.track_memory,
                   memory_capacity(ctx.cluster, ctx.rank) if emulated else None, ctx.rank, ctx.world_size,
                   plan.devices, plan.predicted_memory)

    def attach_host(self, host, capacity: float | None, node: int) -> None:
        """Measure the host memory of ``host`` (a :class:`whale.runtime.offload.HostOffload`) apart from the
        device's: its tensors and the optimizer's state count in the host categories. ``capacity``: emulation
        only, this rank's share of its node's host memory, bytes (``None``: no check); ``node``: its node."""
        self.host, self.host_capacity, self.node = host, capacity, node
        if self.tracker is not None:
            self.tracker.optimizer_category = "host_optimizer_state"

    @property
    def enabled(self) -> bool:
        """True when steps are measured."""
        return self.tracker is not None or self.cuda

    def _hook(self) -> None:
        tr = self.tracker
        self._handles = [p.register_post_accumulate_grad_hook(lambda p: tr.label(p.grad, "gradients"))
                         for p in self.module.parameters() if p.requires_grad]
        self._handles += [self.optimizer.register_step_pre_hook(lambda *a: setattr(tr, "in_optimizer", True)),
                          self.optimizer.register_step_post_hook(lambda *a: setattr(tr, "in_optimizer", False))]

    def _label_state(self) -> None:
        tr = self.tracker
        for p in self.module.parameters():
            tr.label(p, "parameters")
            tr.label(p.grad, "gradients")
        for group in self.optimizer.param_groups:  # ZeRO's pieces: views of shards the module does not hold
            for p in group["params"]:
                tr.label(p, "parameters")
                tr.label(p.grad, "gradients")
        for b in self.module.buffers():
            tr.label(b, "buffers")
        if self.host is not None:  # the optimizer's state is among the host tensors
            for t, category in self.host.device_tensors():  # its groups hold host masters in their place
                tr.label(t, category)
            for t, category in self.host.host_tensors():
                tr.label(t, category)
            return
        for state in self.optimizer.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor) and v.dim():
                    tr.label(v, "optimizer_state")

    @contextmanager
    def tracking(self):
        """Measure the step inside: the tracker is on (and the CUDA peak reset) only within it."""
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        if self.tracker is None:
            yield
            return
        self._label_state()
        self.tracker.reset_peak()
        with self.tracker:
            yield

    def _static_bytes(self) -> dict[str, int]:
        """CUDA without the tracker: live bytes of parameters, gradients and optimizer state by identity."""
        seen: set[int] = set()

        def size(ts) -> int:
            """Bytes of the distinct storages of ``ts``."""
            out = 0
            for t in ts:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    out += t.untyped_storage().nbytes()
            return out
        params = list(self.module.parameters())
        state = [] if self.host is not None else [v for s in self.optimizer.state.values() for v in s.values()]
        return {"parameters": size(params), "gradients": size(p.grad for p in params), "optimizer_state": size(state)}

    def end_step(self) -> dict:
        """The step's metrics (empty when not measuring): ``peak_memory_bytes`` and ``memory`` (bytes per
        category at the peak), ``memory_category_peaks`` (each category's own peak, tracker only). Collective
        under emulation (every rank must call it).

        Raises:
            EmulatedOutOfMemoryError: under emulation, some rank's peak exceeded its capacity (on every rank).
        """
        if not self.enabled:
            return {}
        out = {}
        if self.tracker is not None:
            tr = self.tracker
            peak, at_peak, cats = tr.peak, dict(tr.at_peak), dict(tr.category_peaks)
            out["memory_category_peaks"] = cats
            self.category_peaks = {c: max(v, self.category_peaks[c]) for c, v in cats.items()}
        else:
            at_peak, peak = self._static_bytes(), 0
        if self.cuda:
            peak = int(torch.cuda.max_memory_allocated(self.device))
            if self.tracker is None:
                at_peak["activations_and_temporaries"] = max(0, peak - sum(at_peak.values()))
        out.update(peak_memory_bytes=peak, memory=at_peak)
        host_peak = self._host_step(out)
        self.steps += 1
        if peak >= self.peak:
            self.peak, self.at_peak = peak, at_peak
        if self.capacity is not None:
            self._check_capacity(peak, host_peak)
        return out

    def _host_step(self, out: dict) -> int:
        """With offload: the step's host peak and host bytes by category at it, into ``out``; returns the peak."""
        if self.host is None:
            return 0
        if self.tracker is not None:
            peak, at_peak = self.tracker.host_peak, dict(self.tracker.host_at_peak)
        else:
            at_peak = self.host.host_bytes()
            peak = sum(at_peak.values())
        out.update(host_peak_memory_bytes=peak, host_memory=at_peak)
        if peak >= self.host_peak:
            self.host_peak, self.host_at_peak = peak, at_peak
        return peak

    def _check_capacity(self, peak: int, host_peak: int = 0) -> None:
        """All ranks exchange (peak, capacity, host peak, host capacity, node); any rank over its device (else
        host) capacity stops every rank with the same error."""
        t = torch.zeros(5 * self.world_size, dtype=torch.float64)
        host_cap = self.host_capacity if self.host_capacity is not None else float("inf")
        t[5 * self.rank: 5 * self.rank + 5] = torch.tensor([peak, self.capacity, host_peak, host_cap, self.node])
        if self.world_size > 1:
            dist.all_reduce(t)
        rows = t.view(self.world_size, 5).tolist()
        over = [(r, self._name(r), int(need), int(cap), self._predicted(r))
                for r, (need, cap, _, _, _) in enumerate(rows) if need > cap]
        if over:
            raise EmulatedOutOfMemoryError(over)
        host_over = [(r, int(node), int(need), int(cap))
                     for r, (_, _, need, cap, node) in enumerate(rows) if need > cap]
        if host_over:
            raise EmulatedHostOutOfMemoryError(host_over)

    def _name(self, rank: int) -> str:
        return self.names[rank] if rank < len(self.names) else self.device.type

    def _predicted(self, rank: int) -> float | None:
        return self.predicted[rank] if rank < len(self.predicted) else None

    def row(self, stage: int, lane: int) -> dict:
        """This rank's row of the memory table (peak over all measured steps; see :func:`memory_rows`)."""
        return {"rank": self.rank, "stage": stage, "lane": lane, "device": self._name(self.rank),
                "steps": self.steps, "peak_bytes": self.peak, "at_peak": dict(self.at_peak),
                "category_peaks": dict(self.category_peaks) if self.tracker is not None else {},
                "capacity_bytes": self.capacity, "predicted_bytes": self._predicted(self.rank),
                "host_peak_bytes": self.host_peak if self.host is not None else None,
                "host_at_peak": dict(self.host_at_peak), "host_capacity_bytes": self.host_capacity}

    def close(self) -> None:
        """Remove the tracker's hooks (the engine no longer measures)."""
        for h in getattr(self, "_handles", []):
            h.remove()
        self._handles = []


def memory_rows(monitor: MemoryMonitor, stage: int, lane: int) -> list[dict]:
    """Every rank's row (collective: all ranks call it; rows in rank order). Each row: ``rank``, ``stage``,
    ``lane``, ``device``, ``steps`` measured, ``peak_bytes`` (highest step peak), ``at_peak`` (bytes per
    category at that peak), ``category_peaks`` (each category's own peak), ``capacity_bytes`` (emulation, else
    None) and ``predicted_bytes`` (the planner's, or None); with offload ``host_peak_bytes`` (else None),
    ``host_at_peak`` (host bytes per host category at that peak) and ``host_capacity_bytes`` (emulation)."""
    row = monitor.row(stage, lane)
    if monitor.world_size == 1 or not dist.is_initialized():
        return [row]
    rows: list = [None] * monitor.world_size
    dist.all_gather_object(rows, row)
    return rows


def memory_table(engine) -> tuple[list[dict], str]:
    """Every rank's measured memory over the run so far (collective: every rank calls it): the rows of
    :func:`memory_rows` (bytes) and the printable table (:func:`format_memory_table`) of ``engine``
    (a :class:`whale.Engine`)."""
    rows = memory_rows(engine.memory, engine.stage, engine.lane)
    return rows, format_memory_table(rows)


def format_memory_table(rows: list[dict]) -> str:
    """The rows of :func:`memory_rows` as a printable table (MiB = 2**20 bytes); a note when nothing was
    measured. With offload, host columns follow the device's: the host peak, each host category at it (names
    without ``host_``) and the host capacity."""
    if not rows or not any(r["steps"] for r in rows):
        return "memory: not measured (Config(track_memory=True) to measure on CPU)"
    cats = [c for c in CATEGORIES if any(r["at_peak"].get(c) for r in rows)] or ["parameters"]
    cats += ["activations_and_temporaries"] if any("activations_and_temporaries" in r["at_peak"] for r in rows) else []
    head = ["rank", "stage", "lane", "device", "peak MiB"] + [f"{c} MiB" for c in cats]
    head += ["act peak MiB", "capacity MiB", "predicted MiB", "pred/meas"]
    host = any(r.get("host_peak_bytes") is not None for r in rows)
    if host:
        head += ["host peak MiB"] + [f"host {c[5:]} MiB" for c in HOST_CATEGORIES] + ["host capacity MiB"]
    mib = lambda b: f"{b / 2**20:.2f}" if b is not None else "-"  # noqa: E731
    lines = []
    for r in rows:
        pred = r["predicted_bytes"]
        cells = [str(r["rank"]), str(r["stage"]), str(r["lane"]), r["device"], mib(r["peak_bytes"])]
        cells += [mib(r["at_peak"].get(c, 0)) for c in cats]
        cells += [mib(r["category_peaks"].get("activations")), mib(r["capacity_bytes"]), mib(pred),
                  f"{pred / r['peak_bytes']:.2f}" if pred and r["peak_bytes"] else "-"]
        if host:
            cells += [mib(r.get("host_peak_bytes"))] + [mib(r["host_at_peak"].get(c, 0)) for c in HOST_CATEGORIES]
            cells.append(mib(r.get("host_capacity_bytes")))
        lines.append(cells)
    widths = [max(len(h), *(len(c[i]) for c in lines)) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))  # noqa: E731
    title = "measured memory per rank (peak of any step; categories at that peak" + \
        ("; host memory apart from device memory)" if host else ")")
    return "\n".join([title, fmt(head), *map(fmt, lines)])

