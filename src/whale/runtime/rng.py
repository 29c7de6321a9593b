"""Random streams of one rank: which draws must differ between ranks, which must agree, all from ``Config.seed``.

:func:`whale.init` seeds torch's default generators with ``Config.seed`` on every rank, so a model built next is
identical everywhere (and the engine broadcasts parameters anyway). Were the ranks to train on that one stream,
every data-parallel lane and every shard of a split layer would draw the same dropout masks. The rule:

- **Outside the engine's forward** (model construction, data sampling, your own code) the default generators are
  the *user's streams*: Whale never reseeds them after :func:`whale.init`, so they stay identical on every rank
  (a global batch drawn with ``torch.randn`` after ``parallelize`` is the same everywhere). Checkpoints save
  and restore them (``torch.get_rng_state``).
- **The stage's forward** (every micro-batch, train and eval) draws from the *lane stream*, seeded from
  ``(seed, stage, lane)``: each lane draws its own masks for its own rows, and each pipeline stage its own. An
  interleaved stage's model chunks share it, in the order the schedule runs their forwards.
- **A split region's forward** runs on the rows gathered from its whole split group, the same on each of its n
  ranks, so it draws from the *group stream*, seeded from ``(seed, stage, replica, region)``: identical on the
  ranks of one split group, different between replicas (nested data parallelism: replica = lane // n; the
  colocated split head has one replica). A dropout on replicated values (after a row-parallel Linear, an
  embedding, a gathered output) thus applies one mask over the group, as one process would apply one.
- **Random modules on sharded activations** (``nn.Dropout``, ``nn.Dropout1d/2d/3d``, ``nn.AlphaDropout``,
  ``nn.RReLU``, ... between a column- and a row-parallel Linear, or after a column-parallel output kept
  sharded, in the ``nn.Sequential`` the split rules build) draw from the *shard stream*, seeded from
  ``(seed, stage, replica, shard position, region)``: each shard its own mask, as one process draws
  independent values for every column. Randomness on sharded values anywhere else (a functional dropout in a
  custom split rule's module) draws from the group stream: the same mask on every shard.

Every stream is re-derived at the start of each step from its key plus ``(step, training)`` (the engine's
``steps_done``, and the module's mode) and then runs on through the step's micro-batches. So a resumed run draws
exactly what an uninterrupted one would, with no generator to save; the same seed gives the same masks and
another seed other ones; eval forwards never shift training masks. Seeds are 63-bit BLAKE2b hashes of the key.

The streams are swapped in and out of torch's default CPU generator (and this rank's CUDA generator) by
forward pre-hooks and ``always_call`` forward hooks (nested LIFO, exceptions included), so ``nn.Dropout``,
``F.dropout`` and every other op drawing from the default generator follow the rule unchanged. Why not
``torch.random.fork_rng``: it restores the outer state on exit and so discards the inner draws; a stream here
must resume where it left off at the next micro-batch.
"""

from __future__ import annotations

import hashlib
import weakref
from collections.abc import Callable

import torch
from torch import nn

from whale.parallel.split import ColumnParallelLinear
from whale.plan.plan import Plan

RANDOM_MODULES: tuple[type, ...] = (nn.modules.dropout._DropoutNd, nn.RReLU)
"""Module types that draw random numbers in forward (the shard stream applies to them on sharded values)."""

_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> hook handles of the latest engine


def derive_seed(*key) -> int:
    """A 63-bit seed from ``key`` (plain values), the same in every process (unlike ``hash``)."""
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


class Stream:
    """One named random stream, swapped into ``generators`` around a module's forward.

    Args:
        generators: the generators to swap (torch's default CPU generator, and a CUDA one on GPU ranks).
        key: what distinguishes the stream (plain values, hashed with the step into the seed).
        step_of: returns the current step number (the engine's ``steps_done``).
    """

    def __init__(self, generators: list[torch.Generator], key: tuple, step_of: Callable[[], int]) -> None:
        self.generators, self.key, self.step_of = generators, key, step_of
        self.at: tuple | None = None
        self.states: list[torch.Tensor] = []
        self._saved: list[list[torch.Tensor]] = []

    def enter(self, training: bool) -> None:
        """Save the generators' states and switch them to this stream (re-seeded at a new step or mode)."""
        self._saved.append([g.get_state() for g in self.generators])
        at = (self.step_of(), bool(training))
        if at != self.at:
            seed = derive_seed(*self.key, *at)
            for g in self.generators:
                g.manual_seed(seed)
            self.at = at
        else:
            for g, s in zip(self.generators, self.states, strict=True):
                g.set_state(s)

    def exit(self) -> None:
        """Keep this stream's state and give the generators back theirs."""
        self.states = [g.get_state() for g in self.generators]
        for g, s in zip(self.generators, self._saved.pop(), strict=True):
            g.set_state(s)


def sharded_random_modules(module: nn.Module) -> list[nn.Module]:
    """The :data:`RANDOM_MODULES` in a split shard that act on sharded activations: after a
    :class:`~whale.parallel.split.ColumnParallelLinear` that keeps its output sharded, until a module with
    parameters (a row-parallel Linear gives replicated output), walking ``nn.Sequential`` s in order. Inside
    other containers, inputs are taken as replicated (the split rules give their children full outputs)."""
    found: list[nn.Module] = []

    def walk(m: nn.Module, sharded: bool) -> bool:
        """Collect random modules acting on sharded values under ``m``; returns whether its output is sharded."""
        if isinstance(m, nn.Sequential):
            for child in m:
                sharded = walk(child, sharded)
            return sharded
        if isinstance(m, ColumnParallelLinear):
            return not m.gather_output
        if isinstance(m, RANDOM_MODULES):
            if sharded:
                found.append(m)
            return sharded
        if next(m.parameters(), None) is not None or next(m.children(), None) is not None:
            for child in m.children():
                walk(child, False)
            return False
        return sharded  # parameter-free elementwise module: the layout passes through

    walk(module, False)
    return found


def _hook(module: nn.Module, stream: Stream, fresh: set[int]) -> list:
    """Run ``module``'s forward on ``stream`` (pre-hook in, always-called forward hook out, LIFO); the first
    time an engine hooks a module, a previous engine's hooks on it are removed. Returns the handles."""
    if id(module) not in fresh:
        for old in _HOOKS.pop(module, []):
            old.remove()
        fresh.add(id(module))
    handles = [module.register_forward_pre_hook(lambda m, args: stream.enter(m.training)),
               module.register_forward_hook(lambda m, args, out: stream.exit(), prepend=True, always_call=True)]
    _HOOKS.setdefault(module, []).extend(handles)
    return handles


class RankStreams:
    """Installs this rank's lane, group and shard streams on its stage module (see the module docstring).

    Args:
        module: the stage module (split regions installed).
        regions: the installed :class:`~whale.parallel.bridge.SplitRegion` s, in the order the split runtime
            made them (the same on every rank of a split group).
        plan, stage, lane: the plan and this rank's coordinates.
        seed: ``Config.seed``.
        device: this rank's compute device (a CUDA device's generator is swapped too).
        step_of: returns the engine's completed steps (streams are re-derived per step).

    Attributes:
        lane, groups, shards: the streams (``lane`` is ``None`` when the whole model is one split region).
    """

    def __init__(self, module: nn.Module, regions: list, plan: Plan, stage: int, lane: int, seed: int,
                 device: torch.device, step_of: Callable[[], int]) -> None:
        generators = [torch.default_generator]
        if device.type == "cuda":
            generators.append(torch.cuda.default_generators[device.index if device.index is not None
                                                            else torch.cuda.current_device()])
        replica, position = divmod(lane, plan.width_of(stage))
        fresh: set[int] = set()
        self.handles: list = []
        self.lane = None
        if not any(module is r for r in regions):
            self.lane = Stream(generators, ("lane", seed, stage, lane), step_of)
            for part in getattr(module, "chunks", [module]):  # interleaved: the schedule calls each chunk
                self.handles += _hook(part, self.lane, fresh)
        self.groups, self.shards = [], []
        for i, region in enumerate(regions):
            group = Stream(generators, ("group", seed, stage, replica, i), step_of)
            shard = Stream(generators, ("shard", seed, stage, replica, position, i), step_of)
            self.handles += _hook(region, group, fresh)
            for m in sharded_random_modules(region):
                self.handles += _hook(m, shard, fresh)
            self.groups.append(group)
            self.shards.append(shard)

    def remove(self) -> None:
        """Take the streams off the modules (the default generators then serve every forward)."""
        for h in self.handles:
            h.remove()
        self.handles = []
