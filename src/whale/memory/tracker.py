"""Measured memory on any device: a tracker of live tensor storage, by category.

:class:`StorageTracker` is a ``TorchDispatchMode``: it sees the output of every operation, registers each new
untyped storage (its bytes, its category) with a ``weakref.finalize`` that takes it off when the storage dies,
and keeps the live bytes per category, their total, the peak total (with the breakdown at that moment) and
each category's own peak. Nothing is estimated: bytes are ``UntypedStorage.nbytes()`` of storages that exist.

Categories (:data:`CATEGORIES`), by identity where identity is known, else by when the storage was made:

- ``parameters``, ``buffers``: the module's own tensors (registered with :meth:`StorageTracker.label`);
- ``gradients``: every parameter's ``.grad`` (labelled when registered and after each accumulation);
- ``optimizer_state``: storages made inside ``optimizer.step()`` (the step's transient temporaries too, while
  they live) and the optimizer's ``state`` tensors;
- ``activations``: storages made outside backward and the optimizer step: the forward's saved and transient
  tensors, received stage inputs, the loss, and activations recomputed by checkpointing in backward
  (:func:`recomputing`);
- ``temporaries``: storages made in backward (gradients of activations, workspaces).

Host memory (:data:`HOST_CATEGORIES`, with offload: :mod:`whale.runtime.offload`) is counted apart from the
device: ``host_parameters``, ``host_gradients`` and ``host_optimizer_state`` (the host copies, labelled by
identity, and storages made inside a host ``optimizer.step()``) add to :attr:`StorageTracker.host_total` and its
own peak, never to the device's ``total``/``peak``, even on CPU where both live in the same RAM.

Why not ``torch.distributed._tools.mem_tracker.MemTracker`` (it does run on CPU in torch 2.13): it raises
``NotImplementedError`` when a root module is called twice in one iteration, which every micro-batch of
gradient accumulation and every pipeline schedule does; it deep-copies per-module snapshots at every new peak
of every operation and installs global module hooks; and its docstring notes misattribution in checkpointed
regions. This tracker keeps only category totals (a few dict updates per new storage) and works the same
whatever calls the model how often.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

CATEGORIES: tuple[str, ...] = ("parameters", "buffers", "gradients", "optimizer_state", "activations", "temporaries")
"""The device categories live storage is counted in (see the module docstring)."""
HOST_CATEGORIES: tuple[str, ...] = ("host_parameters", "host_gradients", "host_optimizer_state")
"""The host-memory categories (offload), counted apart from the device's."""

_LOCAL = threading.local()


@contextmanager
def recomputing():
    """Mark the storages made inside as ``activations`` although in backward (checkpoint recompute)."""
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        yield
    finally:
        _LOCAL.depth -= 1


def _storage(t: torch.Tensor):
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, or a tensor without storage
        return None


class StorageTracker(TorchDispatchMode):
    """Live storage bytes per category, with peaks (see the module docstring). Enter it (``with tracker:``)
    around the work to measure; storages made outside it are counted only if :meth:`label` -led.

    Attributes:
        current: live bytes per category now (device and host categories).
        total: live device bytes now (sum of ``current`` over :data:`CATEGORIES`).
        peak: the highest ``total`` since :meth:`reset_peak`, bytes.
        at_peak: ``current`` of the device categories at that moment (bytes per category).
        host_total, host_peak, host_at_peak: the same for the host categories (:data:`HOST_CATEGORIES`).
        category_peaks: per category, its own highest live bytes since :meth:`reset_peak`.
        in_optimizer: set while the optimizer steps (new storages are optimizer state).
        optimizer_category: the category of storages made while ``in_optimizer`` (``"host_optimizer_state"``
            when the optimizer steps on the host).
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, list] = {}  # id(storage) -> [nbytes, category]
        self.current = dict.fromkeys(CATEGORIES + HOST_CATEGORIES, 0)
        self.total = self.host_total = 0
        self.in_optimizer = False
        self.optimizer_category = "optimizer_state"
        self.reset_peak()

    def reset_peak(self) -> None:
        """Start a new measurement window: peaks become the live bytes now."""
        self.peak, self.host_peak = self.total, self.host_total
        self.at_peak = {c: self.current[c] for c in CATEGORIES}
        self.host_at_peak = {c: self.current[c] for c in HOST_CATEGORIES}
        self.category_peaks = dict(self.current)

    def _new_category(self) -> str:
        if self.in_optimizer:
            return self.optimizer_category
        if torch._C._current_graph_task_id() != -1 and not getattr(_LOCAL, "depth", 0):
            return "temporaries"
        return "activations"

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self._grow(entry[1], -entry[0])

    def _grow(self, category: str, nbytes: int) -> None:
        """Add ``nbytes`` (may be negative) to ``category`` and its total (device or host); update the peaks."""
        self.current[category] += nbytes
        if self.current[category] > self.category_peaks[category]:
            self.category_peaks[category] = self.current[category]
        if category in HOST_CATEGORIES:
            self.host_total += nbytes
            if self.host_total > self.host_peak:
                self.host_peak = self.host_total
                self.host_at_peak = {c: self.current[c] for c in HOST_CATEGORIES}
            return
        self.total += nbytes
        if self.total > self.peak:
            self.peak = self.total
            self.at_peak = {c: self.current[c] for c in CATEGORIES}

    def _see(self, t: torch.Tensor, category: str | None) -> None:
        """Register ``t``'s storage (as ``category``, or the phase's when None) or update its size/category. A
        wrapper subclass (a ``DTensor``) owns no memory of its own: its inner tensors' storages count."""
        if is_traceable_wrapper_subclass(t):
            for name in t.__tensor_flatten__()[0]:
                inner = getattr(t, name)
                if isinstance(inner, torch.Tensor):  # a DTensor also lists its device mesh
                    self._see(inner, category)
            return
        st = _storage(t)
        if st is None:
            return
        key, nbytes = id(st), st.nbytes()
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = [0, category or self._new_category()]
            weakref.finalize(st, self._free, key)
            entry = self._live[key]
        elif category is not None and entry[1] != category:
            self._grow(entry[1], -entry[0])
            entry[0], entry[1] = 0, category
        if nbytes != entry[0]:
            grow, entry[0] = nbytes - entry[0], nbytes
            self._grow(entry[1], grow)

    def resized(self, storage) -> None:
        """A counted storage changed size outside the dispatcher (``UntypedStorage.resize_``, with which ZeRO-3
        and FSDP2 free and re-allocate gathered parameters): count its new bytes (nothing if not counted)."""
        entry = self._live.get(id(storage))
        if entry is not None and storage.nbytes() != entry[0]:
            grow, entry[0] = storage.nbytes() - entry[0], storage.nbytes()
            self._grow(entry[1], grow)

    def seen(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s storage is counted (a wrapper subclass: its first inner tensor's; no storage: True)."""
        if is_traceable_wrapper_subclass(t):
            inner = [getattr(t, n) for n in t.__tensor_flatten__()[0]]
            return all(self.seen(i) for i in inner if isinstance(i, torch.Tensor))
        st = _storage(t)
        return st is None or id(st) in self._live

    def category(self, t: torch.Tensor) -> str | None:
        """The category ``t``'s storage is counted as now (``None``: not counted)."""
        st = _storage(t)
        entry = self._live.get(id(st)) if st is not None else None
        return entry[1] if entry is not None else None

    def label(self, t: torch.Tensor | None, category: str) -> None:
        """Count ``t``'s storage (made inside the tracker or not) as ``category`` from now on.

        Raises:
            ValueError: ``category`` is not one of :data:`CATEGORIES` or :data:`HOST_CATEGORIES`.
        """
        if category not in self.current:
            raise ValueError(f"unknown memory category {category!r}; choose one of {CATEGORIES + HOST_CATEGORIES}")
        if isinstance(t, torch.Tensor):
            self._see(t, category)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        """Run ``func``; register the storages of its tensor outputs."""
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._see(t, None)
        return out
