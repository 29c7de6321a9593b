"""The executed step of every rank as a Chrome / Perfetto trace (the JSON ``torch.profiler`` exports), beside the
schedule simulator's prediction of the same plan.

Format (Chrome Trace Event format, which ``chrome://tracing``, Perfetto and TensorBoard read): ``{"traceEvents":
[{"name", "cat", "ph": "X", "ts", "dur", "pid", "tid", "args"}, ...], "displayTimeUnit": "ms"}`` with ``ts`` and
``dur`` in microseconds. One process per rank (``pid`` = rank, named "rank r: stage s lane l"), one thread for its
compute; the events of one step:

- ``forward`` / ``backward`` / ``weight-gradient``: each action's compute (``F3``, ``B0c1``, ``W2``);
- ``recv`` (idle): the wait before an action for its inputs or output gradients to arrive;
- ``send``: posting the action's sends (asynchronous; the transfer itself overlaps what follows);
  gaps under :data:`MIN_GAP_S` are left out;
- ``all-reduce``: the gradient sync after the schedule (what the backward did not hide), ``optimizer``: the update.

The prediction (:func:`predicted_events`, processes ``1000 + rank`` named "predicted rank r") is the event
simulation of the same schedule (:func:`whale.plan.schedule_sim.simulate_lanes`) fed this step's measured mean
forward and backward seconds per stage, with free communication: the bubble the schedule alone leaves.
"""

from __future__ import annotations

import json
import os

import torch.distributed as dist

from whale.plan.schedule import Schedule
from whale.plan.schedule_sim import simulate_lanes

PREDICTED_PID = 1000
"""Process id offset of the predicted ranks in the trace."""

_CATS = {"F": "forward", "B": "backward", "W": "weight-gradient"}
MIN_GAP_S = 5e-6
"""Gaps shorter than this (Python bookkeeping between actions) get no ``send`` / ``recv`` event."""


def _event(name: str, cat: str, start_s: float, end_s: float, pid: int, args: dict | None = None) -> dict:
    return {"name": name, "cat": cat, "ph": "X", "ts": round(start_s * 1e6, 3),
            "dur": round(max(0.0, end_s - start_s) * 1e6, 3), "pid": pid, "tid": 0, "args": args or {}}


def step_events(timeline: list, phases: list, rank: int, offset_s: float = 0.0) -> list[dict]:
    """One rank's executed step as trace events.

    Args:
        timeline: per action ``(label, start, compute_start, compute_end)`` seconds from the schedule's start
            (:attr:`whale.runtime.engine.Engine.last_timeline`).
        phases: ``[(name, start, end)]`` seconds from the schedule's start of the work after it (gradient sync,
            optimizer).
        rank: the trace process id.
        offset_s: seconds added to every time (this rank's schedule start on a clock shared by the ranks).
    """
    out, prev_end = [], 0.0
    for label, start, c0, c1 in timeline:
        if start - prev_end > MIN_GAP_S:
            out.append(_event("send", "send", offset_s + prev_end, offset_s + start, rank))
        if c0 - start > MIN_GAP_S:
            out.append(_event("recv", "idle", offset_s + start, offset_s + c0, rank, {"waits for": label}))
        out.append(_event(label, _CATS.get(label[:1], "compute"), offset_s + c0, offset_s + c1, rank))
        prev_end = c1
    for name, start, end in phases:
        out.append(_event(name, "all-reduce" if "sync" in name else name, offset_s + start, offset_s + end, rank))
    return out


def predicted_events(schedule: Schedule, fwd: list[float], bwd: list[float], offset_s: float = 0.0,
                     positions: tuple[int, ...] | None = None) -> list[dict]:
    """The simulator's step of ``schedule`` (one lane per stage) as trace events, stage s as process
    ``PREDICTED_PID + s``; ``fwd`` / ``bwd``: seconds of one micro-batch's forward / backward through each stage
    (all its chunks; the W of a split backward counted in ``bwd``); ``positions``: the chunk -> stage map of an
    interleaved plan whose stages hold different chunk counts (``Plan.chunk_positions``)."""
    m = sum(1 for a in schedule[0] if a.kind == "F" and a.chunk == 0)
    sim = simulate_lanes(schedule, [[[f] * m] for f in fwd], [[[b] * m] for b in bwd], [[0.0] for _ in schedule],
                         positions=positions)
    return [_event(f"{label[0]}{mb}{label[1:]}", _CATS.get(label[:1], "compute"), offset_s + start, offset_s + end,
                   PREDICTED_PID + stage) for stage, _lane, label, mb, start, end in sim["events"]]


def measured_costs(timeline: list) -> tuple[float, float]:
    """Per micro-batch forward and backward (B + W) compute seconds of one rank's step (summed over its chunks)."""
    micro = {(lab[1:].split("c")[0]) for lab, *_ in timeline if lab.startswith("F")}
    n = max(1, len(micro))
    fwd = sum(c1 - c0 for lab, _, c0, c1 in timeline if lab.startswith("F")) / n
    bwd = sum(c1 - c0 for lab, _, c0, c1 in timeline if lab[:1] in "BW") / n
    return fwd, bwd


def chrome_trace(per_rank: list[dict], schedule: Schedule | None = None,
                 positions: tuple[int, ...] | None = None) -> dict:
    """The trace of one step from every rank's ``{"rank", "stage", "lane", "wall0", "timeline", "phases"}``
    (:func:`write_step_trace` gathers them), with the predicted step of ``schedule`` (its chunk -> stage map
    ``positions`` when the stages hold different chunk counts) when given (lane 0's measured costs per stage)."""
    t0 = min(r["wall0"] for r in per_rank)
    events: list[dict] = []
    for r in per_rank:
        events.append({"name": "process_name", "ph": "M", "pid": r["rank"], "tid": 0,
                       "args": {"name": f"rank {r['rank']}: stage {r['stage']} lane {r['lane']}"}})
        events += step_events(r["timeline"], r["phases"], r["rank"], r["wall0"] - t0)
    if schedule is not None:
        lane0 = sorted((r for r in per_rank if r["lane"] == 0), key=lambda r: r["stage"])
        if len(lane0) == len(schedule):
            costs = [measured_costs(r["timeline"]) for r in lane0]
            events += [{"name": "process_name", "ph": "M", "pid": PREDICTED_PID + s, "tid": 0,
                        "args": {"name": f"predicted stage {s}"}} for s in range(len(schedule))]
            events += predicted_events(schedule, [c[0] for c in costs], [c[1] for c in costs], 0.0, positions)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_step_trace(engine, path: str) -> str | None:
    """Write the latest step of every rank of ``engine`` as a Chrome trace to ``path`` on rank 0 (collective:
    every rank must call it); returns the path on rank 0, ``None`` elsewhere.

    Raises:
        RuntimeError: no step has run yet.
    """
    if not engine.last_timeline:
        raise RuntimeError("no step has run yet; call write_step_trace after engine.step")
    mine = {"rank": engine.rank, "stage": engine.stage, "lane": engine.lane, "wall0": engine.last_step_wall,
            "timeline": engine.last_timeline, "phases": engine.last_phases}
    gathered = [None] * engine.world_size
    if engine.world_size > 1:
        dist.all_gather_object(gathered, mine)
    else:
        gathered = [mine]
    if engine.rank != 0:
        return None
    trace = chrome_trace(gathered, engine.schedule, engine.plan.chunk_positions or None)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(trace, f)
    return path
