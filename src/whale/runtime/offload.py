"""Offload to host memory with the optimizer step on the host, as ZeRO-Offload does (Ren et al., "ZeRO-Offload:
Democratizing Billion-Scale Model Training", USENIX ATC 2021), composing with Whale's ZeRO-1/2/3, pipelines,
split shards, clipping and mixed precision.

What lives where (``Config(offload=...)``, recorded in ``Plan.offload``):

- ``"optimizer"``: for every tensor the rank's optimizer updates (whole parameters, split shards, or under
  ZeRO-1/2/3 only this lane's slices, :mod:`whale.parallel.zero`, :mod:`whale.parallel.zero3`), the host holds
  an fp32 master copy, a gradient buffer and the optimizer state. The device keeps its parameters and gradients
  for forward and backward; it holds no optimizer state.
- ``"optimizer+params"``: as ``"optimizer"``, and every parameter of the stage stays on the host between steps
  (the host master *is* the parameter); :func:`params_on_device` copies them to the device for a step's (or an
  evaluation's) forward and backward and drops the device copies afterwards. Whole stage at a time: the device
  peak during a step is unchanged, the device holds no parameters between steps. With ``zero=0``; with
  ``zero=3`` instead the lane's parameter shards and gradient shards live on the host (an fp32 shard piece *is*
  the master the host optimizer steps, its shard gradient the host gradient buffer), and each ZeRO-3 unit is
  gathered from them for its forward and backward and reduce-scattered back into them
  (:meth:`whale.parallel.zero3.Zero3.shards_to_host`): the device holds one gathered unit at a time, as
  ZeRO-Infinity's CPU offload does. Not with ZeRO-1/2.

Per step, after the gradients are reduced, unscaled (fp16) and clipped on the device (:mod:`whale.runtime.
update`): gradients device -> host, ``optimizer.step()`` on the host, then (``"optimizer"``) the updated values
host -> device, before ZeRO broadcasts every lane's slices. The user's optimizer object stays: its param groups
keep their hyperparameters and LR schedulers, only each group's ``params`` are replaced by the host masters.
On CUDA the host tensors are pinned (``pin_memory()``) and copies are ``non_blocking``, with one stream sync
before the host step reads the gradients; on CPU the "host" tensors are copies in the same RAM, counted apart.

Accounting: the host tensors are counted in the storage tracker's host categories (``host_parameters``,
``host_gradients``, ``host_optimizer_state``: :mod:`whale.memory.tracker`), never as device memory; under an
emulated cluster each rank's host peak is bounded by its share of its node's ``host_memory_bytes``
(:func:`whale.memory.host.host_memory_capacity`, :class:`whale.memory.host.EmulatedHostOutOfMemoryError`).

Only the CPU path runs in this project's tests; the CUDA branches (pinned memory, non-blocking copies, the
stream sync) are written for GPUs but have not been run on one.

Why Whale's own code: PyTorch (2.13) has no ZeRO-Offload-style host optimizer step for state sharded some other
way. FSDP2's ``CPUOffloadPolicy`` (``fully_shard(..., offload_policy=CPUOffloadPolicy())``) does offload
parameters, gradients and optimizer state with the step on CPU, but only for FSDP2's own ZeRO-3 layout: even
``Shard(0)`` DTensor chunks (padded to equal size), parameters all-gathered for every forward. It cannot offload
Whale's uneven, hardware-aware ZeRO-1/2 slices (:mod:`whale.parallel.zero`), a pipeline stage's replicated
parameters without sharding them, or split shards. ``ZeroRedundancyOptimizer`` has no offload; DeepSpeed's
ZeRO-Offload is not part of PyTorch and refuses pipelines with ZeRO-2.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
from torch import nn

from whale.memory.host import host_memory_capacity

CATEGORY_OF_STATE = "host_optimizer_state"


def _host_copy(t: torch.Tensor, pin: bool) -> torch.Tensor:
    """An fp32 copy of ``t`` in host memory (pinned when ``pin``)."""
    h = torch.empty(t.shape, dtype=torch.float32, device="cpu", pin_memory=pin)
    h.copy_(t.detach())
    return h


class HostOffload:
    """One rank's host-resident optimizer: masters, gradient buffers and optimizer state on the host.

    Args:
        optimizer: the rank's optimizer, already bound to what this rank updates (after ZeRO's binding); its
            groups' ``params`` are replaced in place by host masters (same group dicts, same schedulers).
        module: this rank's stage module.
        device: the rank's compute device (``cuda``: pinned host memory and non-blocking copies).
        mode: ``"optimizer"`` or ``"optimizer+params"`` (see the module docstring).
        frozen: ``id`` of optimizer tensors that never get a gradient although they require one (ZeRO pieces of
            a frozen parameter): no host gradient buffer for them.
        zero3: the engine's :class:`~whale.parallel.zero3.Zero3` under ZeRO-3, else ``None``: with
            ``"optimizer+params"`` its shards move to the host and its fp32 pieces are their own masters.

    Attributes:
        pairs: ``(device tensor, host master)`` per tensor the optimizer updates (a parameter, split shard or
            ZeRO piece; the master is an fp32 ``nn.Parameter`` of the same shape on the host).
        grads: the host gradient buffer of each pair whose tensor requires a gradient (fp32, same shape).
        resident: ``"optimizer+params"`` with ``zero=0`` only: ``(parameter, host tensor)`` for every parameter
            of the module.
        on_host: ZeRO-3 shards and shard gradients kept on the host, with their host memory categories.
        device_grads: ZeRO-3 shard gradients left on the device (``"optimizer"``), counted as device gradients.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, module: nn.Module, device: torch.device, mode: str,
                 frozen: frozenset[int] = frozenset(), zero3=None) -> None:
        self.optimizer, self.device, self.mode = optimizer, torch.device(device), mode
        self.pin = self.device.type == "cuda"
        self.pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        sharded = mode == "optimizer+params" and zero3 is not None
        self.on_host = zero3.shards_to_host(self.pin) if sharded else []
        own = {id(pc.param) for pc in zero3.pieces if pc.param.dtype == torch.float32} if sharded else set()
        self.device_grads = list(zero3.shard_grads) if zero3 is not None and not sharded else []
        masters: dict[int, nn.Parameter] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in masters:
                    grad = p.requires_grad and id(p) not in frozen
                    masters[id(p)] = p.requires_grad_(grad) if id(p) in own else \
                        nn.Parameter(_host_copy(p, self.pin), requires_grad=grad)
                    self.pairs.append((p, masters[id(p)]))
            group["params"] = [masters[id(p)] for p in group["params"]]
        self.grads = {id(h): torch.zeros(h.shape, pin_memory=self.pin) for p, h in self.pairs
                      if h.requires_grad and h is not p}
        self.back = [(p, h) for p, h in self.pairs if h is not p] if mode == "optimizer" or sharded else []
        self.resident: list[tuple[nn.Parameter, torch.Tensor, torch.dtype]] = []
        if mode == "optimizer+params" and not sharded:
            self.resident = [(p, masters[id(p)].data if id(p) in masters else _host_copy(p, self.pin), p.dtype)
                             for p in module.parameters()]
            self.release()

    @torch.no_grad()
    def step(self) -> None:
        """Gradients device -> host, ``optimizer.step()`` on the host, and (``"optimizer"``) the updated values
        host -> device. A tensor without a gradient (frozen, unused this step) is skipped by the optimizer as in
        one process."""
        for p, h in self.pairs:
            if h is p:  # a ZeRO-3 shard piece on the host: its gradient is already the host shard gradient's
                continue
            g = self.grads.get(id(h))
            if p.grad is None or g is None:
                h.grad = None
                continue
            g.copy_(p.grad, non_blocking=self.pin)
            h.grad = g
        if self.pin:
            torch.cuda.current_stream(self.device).synchronize()  # the host step reads the copied gradients
        self.optimizer.step()
        for p, h in self.back:
            p.detach().copy_(h, non_blocking=self.pin)

    @torch.no_grad()
    def refresh(self) -> None:
        """The host masters from the device values (after a checkpoint was loaded into the module)."""
        for p, h in self.back:
            h.copy_(p.detach())

    def fetch(self) -> None:
        """``"optimizer+params"``: every parameter gets a device copy of its host value (in its own dtype)."""
        for p, h, dtype in self.resident:
            p.data = h.to(self.device, dtype=dtype, non_blocking=self.pin, copy=True)

    def release(self) -> None:
        """``"optimizer+params"``: every parameter points at its host tensor again; the device copies are dropped
        (the host values are current: the optimizer stepped them)."""
        for p, h, _ in self.resident:
            p.data = h

    def host_tensors(self) -> list[tuple[torch.Tensor, str]]:
        """Every host tensor this rank holds with its memory category (``host_parameters`` for masters and
        resident parameters, ``host_gradients``, ``host_optimizer_state`` for the optimizer's state tensors)."""
        out = [(h, "host_parameters") for _, h in self.pairs]
        out += [(h, "host_parameters") for _, h, _ in self.resident]
        out += [(g, "host_gradients") for g in self.grads.values()] + self.on_host
        out += [(v, CATEGORY_OF_STATE) for st in self.optimizer.state.values() for v in st.values()
                if isinstance(v, torch.Tensor) and v.dim() > 0]
        return out

    def device_tensors(self) -> list[tuple[torch.Tensor | None, str]]:
        """The device tensors the optimizer's host masters stand for (ZeRO pieces, whole parameters) as
        ``parameters`` and their gradients (and ZeRO-3's device shard gradients) as ``gradients``: labelled by
        identity, as without offload, not by the phase that first touches them."""
        out: list[tuple[torch.Tensor | None, str]] = []
        for p, h in self.pairs:
            if h is not p:
                out += [(p, "parameters"), (p.grad, "gradients")]
        return out + [(g, "gradients") for g in self.device_grads]

    def host_bytes(self) -> dict[str, int]:
        """Bytes per host category of the distinct storages of :meth:`host_tensors` (what lives on the host
        now; used where the storage tracker does not run, e.g. CUDA)."""
        seen: set[int] = set()
        out = dict.fromkeys(("host_parameters", "host_gradients", CATEGORY_OF_STATE), 0)
        for t, cat in self.host_tensors():
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                out[cat] += st.nbytes()
        return out


@contextlib.contextmanager
def params_on_device(offload: HostOffload | None):
    """Inside: under ``"optimizer+params"`` the stage's parameters are on the device (fetched on entry, dropped
    on exit); otherwise nothing happens."""
    if offload is None or not offload.resident:
        yield
        return
    offload.fetch()
    try:
        yield
    finally:
        offload.release()


def host_offload(engine) -> HostOffload | None:
    """The offload of ``engine`` (a :class:`whale.Engine`) under ``engine.plan.offload``, or ``None`` for
    ``"none"``; rebinds the engine's optimizer to host masters and registers the host tensors (and, under an
    emulated cluster, the rank's host capacity) with its memory monitor."""
    plan, ctx = engine.plan, engine.ctx
    if plan.offload == "none":
        return None
    zero = engine.zero
    frozen = frozenset(id(pc.param) for pc in zero.pieces if not pc.owner.requires_grad) if zero else frozenset()
    offload = HostOffload(engine.optimizer, engine.module, ctx.device, plan.offload, frozen,
                          zero if plan.zero == 3 else None)
    cluster = ctx.cluster
    emulated = cluster is not None and cluster.emulate
    engine.memory.attach_host(offload, host_memory_capacity(cluster, ctx.rank) if emulated else None,
                              cluster.node_of(ctx.rank) if cluster is not None else 0)
    return offload


@contextlib.contextmanager
def device_keyed(offload: HostOffload | None):
    """Inside: the optimizer as the rest of Whale sees it (checkpoints map its tensors to parameter names): its
    groups hold the device tensors and its state is keyed by them; on exit the host masters come back and any
    state loaded meanwhile moves to the host. Nothing happens without offload."""
    if offload is None:
        yield
        return
    opt = offload.optimizer
    to_dev = {id(h): p for p, h in offload.pairs}
    to_host = {id(p): h for p, h in offload.pairs}
    for g in opt.param_groups:
        g["params"] = [to_dev[id(h)] for h in g["params"]]
    opt.state = defaultdict(dict, {to_dev[id(h)]: s for h, s in opt.state.items()})
    try:
        yield
    finally:
        for g in opt.param_groups:
            g["params"] = [to_host[id(p)] for p in g["params"]]
        opt.state = defaultdict(dict, {
            to_host[id(p)]: {k: v.to(to_host[id(p)].device) if isinstance(v, torch.Tensor) and v.dim() else v
                             for k, v in s.items()} for p, s in opt.state.items()})
