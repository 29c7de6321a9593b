"""The search over a described transformer's plans with the pipeline schedule and sequence parallelism as
search dimensions (issue 27 item 5, issue 28 part 3).

:func:`transformer_candidates` takes :func:`whale.planner.search.enumerate_candidates`' space (degrees, stage
cuts, device mixes, micro-batch counts bounded by the batch, memory options) at schedule 1F1B and adds, per
point, what the runtime can also run (:func:`whale.planner.legality.schedule_legal`):

- ZB-H1 (zero-bubble, Qi et al. ICLR'24) on every pipelined point;
- interleaved 1F1B with every legal chunk count v (:func:`whale.planner.legality.legal_virtual_stages`: the blocks
  in p·v equal chunks, m a multiple of p) on Megatron-LM's cut (:func:`megatron_cut`: l/p blocks per stage, the
  embedding on the first, the head on the last), which is added to the cuts tried for every schedule;
- sequence parallelism on and off at every split degree t >= 2 that divides the sequence.

GPipe is left out: in :class:`~whale.planner.transformer_estimate.TransformerEstimator` its time equals 1F1B's
and its memory is at least 1F1B's, so it never wins (a tie goes to 1F1B). :func:`transformer_search` ranks the
space with the estimator by :func:`whale.planner.search.search` (branch and bound on the estimator's memory and
lower bound: the slowest stage's m·(F + B + W) plus the post-step work).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from whale.planner.legality import legal_virtual_stages, schedule_legal, sequence_parallel_legal
from whale.planner.search import Candidate, Constraints, SearchResult, enumerate_candidates, search
from whale.planner.transformer_estimate import TransformerEstimator


def megatron_cut(layers: int, stages: int) -> tuple[int, ...] | None:
    """Units per stage of Megatron-LM's cut of a GPT description (embedding, 2·l halves, head: 2l + 2 units):
    2·l/p halves per stage, the embedding on the first and the head on the last; None when p does not divide
    the blocks."""
    if layers % stages:
        return None
    cut = [2 * layers // stages] * stages
    cut[0] += 1
    cut[-1] += 1
    return tuple(cut)


def _variants(c: Candidate, est: TransformerEstimator, cons: Constraints, virtual: int | None,
              sequence_parallel: bool | None, split_interleaved: bool) -> Iterator[Candidate]:
    """The schedules (and v) and sequence-parallel settings of one 1F1B point (see the module docstring)."""
    blocks, p, m, t = est.shape.layers, c.stages, c.num_micro_batch, c.split
    scheds = [(cons.schedule, 1)] if cons.schedule and cons.schedule != "Interleaved1F1B" else \
        [] if cons.schedule else [("1F1B", 1), ("ZB-H1", 1)]
    if (cons.schedule in (None, "Interleaved1F1B")) and c.stage_layers == megatron_cut(blocks, p):
        scheds += [("Interleaved1F1B", v) for v in legal_virtual_stages(blocks, p, m) if virtual in (None, v)]
    if virtual not in (None, 1):
        scheds = [x for x in scheds if x[1] == virtual]
    sps = [False, True] if sequence_parallel_legal(est.shape, t) else [False]
    for sched, v in scheds:
        if not schedule_legal(sched, p, m, t, v, blocks, split_interleaved):
            continue
        for sp in sps if sequence_parallel is None else [sequence_parallel] if sequence_parallel in sps else []:
            yield dataclasses.replace(c, schedule=sched, virtual=v, sequence_parallel=sp)


def transformer_candidates(est: TransformerEstimator, constraints: Constraints | None = None,
                           virtual: int | None = None, sequence_parallel: bool | None = None,
                           split_interleaved: bool = False) -> Iterator[Candidate]:
    """The space of :func:`transformer_search` (the module docstring). ``constraints.schedule``, ``virtual`` and
    ``sequence_parallel`` fix those dimensions when given; ``split_interleaved``: interleave split stages too
    (Megatron-LM does; Whale's runtime does not, so off by default)."""
    cons = constraints or Constraints(stage_order="memory")
    blocks = est.shape.layers

    def cuts(p: int, mix: tuple) -> list[tuple[int, ...]]:
        """Stage cuts (layers per stage, length ``p``) to try for device mix ``mix``: the estimator's own cuts
        plus Megatron-LM's even cut (embedding first, head last) when ``blocks`` divides by ``p``."""
        extra = megatron_cut(blocks, p)
        return est.cuts(p, mix) + ([extra] if extra else [])

    base = dataclasses.replace(cons, schedule="1F1B")
    for c in enumerate_candidates(len(est.model.layers), est.pool.counts, est.batch, base, cuts, est.split_ok,
                                  [t.memory_bytes for t in est.pool.types], 0, est.pool.rank_types):
        yield from _variants(c, est, cons, virtual, sequence_parallel, split_interleaved)


def transformer_search(est: TransformerEstimator, constraints: Constraints | None = None, keep: int = 5,
                       **space) -> SearchResult:
    """The best plan of :func:`transformer_candidates` (``space``: its keyword arguments) by ``est``.

    Raises:
        NoFeasiblePlanError: nothing fits; ValueError: an empty space."""
    return search(transformer_candidates(est, constraints, **space), est, keep)
