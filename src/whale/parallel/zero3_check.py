"""ZeRO-3's check that every lane of a stage calls the same units in the same order (the same control flow).

ZeRO-3's collectives follow the module calls: a lane that calls a unit the others skip (``if rank == 0:``, a
branch on data that differs per lane, a loop run a different number of times) posts a gather the others do not.
With units of different sizes that hangs until the collective timeout and ends in the backend's own error; with
equal sizes the collectives pair up with the wrong units and training silently diverges. :class:`LaneAgreement`
turns both into one :class:`Zero3Error` raised on every rank, naming the collective, the step, and what each lane
was doing there:

* During the first :data:`AGREE_STEPS` training steps (and any eval forward before them) every ZeRO-3
  collective (a unit's gather for its forward or backward, its gradients' reduce-scatter) is preceded by one
  fixed-shape all-gather of ``(collective number, unit, phase, count)`` (4 int64 per lane), and so are the end of
  each forward of the stage module and the end of the step, so a lane that called fewer units meets the others
  in a same-shaped collective instead of waiting in a different one. Cost: one latency-bound 32-byte
  all-gather per collective of those steps, and reading its result syncs the device there (a unit's gather
  moves its whole parameters).
* After them, always on: every lane folds each collective's ``(unit, phase)`` into a 61-bit fingerprint (a
  multiply-add in Python per collective) that rides in ZeRO-3's existing used-flags all-reduce at the step's
  end (two more int64 in it, ``MAX`` of ``fp`` and ``-fp``: equal on every lane iff ``max == -max(-fp)``), so
  lanes that diverged in equal-sized collectives raise before the optimizer changes any weight (the lanes then
  exchange their lists of collectives once, to name the first difference). A divergence after those steps in
  collectives of different sizes is not caught first: it fails in the collective itself (bound the wait with
  ``Config(timeout_s=...)``).
"""

from __future__ import annotations

import collections

import torch
import torch.distributed as dist

AGREE_STEPS = 2  # training steps whose every ZeRO-3 collective is checked first (a control-flow bug shows early)
FORWARD, BACKWARD, REDUCE, END_FORWARD, END_STEP = range(5)  # phases
_MOD = (1 << 61) - 1  # the fingerprint's modulus (a Mersenne prime: fp and -fp fit in int64)
_FIX = ("every lane must call the same modules in the same order under ZeRO-3; make control flow depend only "
        "on data all lanes share, or use Config(zero=2)")


class Zero3Error(ValueError):
    """A stage ZeRO-3 cannot shard as asked, or lanes that called different units; the message names the unit
    and the fix."""


class LaneAgreement:
    """The record and check of one lane's ZeRO-3 collectives in a step (see the module docstring).

    Args:
        group: the stage's data-parallel lanes.
        names: the units' names, by unit index.
        ranks: the global rank of each lane (group rank order).
        device: where the check's tensors live (the units' device: NCCL needs it on the GPU).
    """

    def __init__(self, group, names: list[str], ranks: list[int], device: torch.device) -> None:
        self.group, self.names, self.ranks, self.device = group, names, ranks, device
        self.step = 0  # training steps finished
        self.failed = False  # raised once: no more checks (every lane raised at the same collective)
        self.start_step()

    def start_step(self) -> None:
        """Forget the collectives recorded so far (a step starts; eval forwards before it are left out)."""
        self.events: list[tuple[int, int, int]] = []  # (unit, phase, count of that pair so far this step)
        self.counts: collections.Counter = collections.Counter()
        self.fingerprint = 0

    def before(self, unit: int, phase: int) -> None:
        """Record the collective of ``unit`` (index; -1 for the ends) in ``phase`` about to run; during the first
        :data:`AGREE_STEPS` steps check first that every lane is about to run the same one (collective).

        Raises:
            Zero3Error: the lanes are not, on every lane.
        """
        if self.failed:
            return
        self.counts[unit, phase] += 1
        self.events.append((unit, phase, self.counts[unit, phase]))
        self.fingerprint = (self.fingerprint * 1_000_003 + 8 * (unit + 1) + phase + 1) % _MOD
        if self.step < AGREE_STEPS:
            mine = torch.tensor([len(self.events), unit, phase, self.counts[unit, phase]], dtype=torch.int64,
                                device=self.device)
            rows = mine.new_empty(4 * len(self.ranks))
            dist.all_gather_single(rows, mine, group=self.group)
            rows = rows.view(-1, 4).tolist()
            if any(r[1:3] != rows[0][1:3] for r in rows):
                self._raise(len(self.events), [tuple(r[1:]) for r in rows])

    def fingerprint_pair(self) -> list[int]:
        """``[fp, -fp]`` for the step-end ``MAX`` all-reduce (:meth:`check_fingerprints`)."""
        return [self.fingerprint, -self.fingerprint]

    def check_fingerprints(self, reduced: list[int]) -> None:
        """After the step-end ``MAX`` all-reduce of :meth:`fingerprint_pair`: when the lanes' fingerprints differ,
        exchange the step's collectives (collective, rare) and raise.

        Raises:
            Zero3Error: the lanes ran different collectives this step, on every lane.
        """
        if self.failed or reduced[0] == -reduced[1]:
            return
        lists: list = [None] * len(self.ranks)
        dist.all_gather_object(lists, self.events, group=self.group)
        at = next((i for i, e in enumerate(zip(*lists, strict=False)) if len(set(e)) > 1),
                  min(len(x) for x in lists))
        self._raise(at + 1, [x[at] if at < len(x) else (-1, END_STEP, 1) for x in lists])

    def _raise(self, number: int, rows: list[tuple[int, int, int]]) -> None:
        """Raise the error for collective ``number`` of this step, each lane doing ``rows[lane]``."""
        self.failed = True
        doing = ", ".join(f"lane {g} (rank {self.ranks[g]}) {self._what(*r)}" for g, r in enumerate(rows))
        raise Zero3Error(f"ZeRO-3: lanes called different units at collective #{number} of step "
                         f"{self.step + 1}: {doing}; {_FIX}")

    def _what(self, unit: int, phase: int, count: int) -> str:
        """One lane's collective in words."""
        if phase == END_FORWARD:
            return "<end of forward>"
        if phase == END_STEP:
            return "<end of step>"
        verb = {FORWARD: "gathers {} for its forward", BACKWARD: "gathers {} for its backward",
                REDUCE: "reduce-scatters {}'s gradients"}[phase]
        return verb.format(repr(self.names[unit])) + f" (#{count} this step)"
