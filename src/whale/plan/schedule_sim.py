"""The event simulation of a pipeline schedule: when each action of each (stage, lane) rank starts and ends.

The one home of a schedule's timing: the planner's step-time model (:mod:`whale.planner.steptime`), the
hardware-aware virtual stages (:mod:`whale.planner.virtual`) and the runtime's predicted trace
(:mod:`whale.runtime.trace`) all simulate through here. Kept apart from :mod:`whale.plan.schedule` (the schedules
as data, their validation and completion order), whose completion order it replays with costs.
"""

from __future__ import annotations

from collections.abc import Callable

from whale.plan.schedule import Action, Schedule, chunk_ids, completion_order


def simulate(schedule: Schedule, fwd: list[float], bwd: list[float], comm: float = 0.0,
             chunk_shares: list[list[tuple[float, float]]] | None = None, weight: list[float] | None = None) -> dict:
    """Event simulation of one step: per-stage forward/backward times (seconds per micro-batch through the
    whole stage, all its chunks) and a fixed P2P latency ``comm`` per transfer. Returns ``{"step": t, "busy":
    [..], "idle_share": [..], "events": [(stage, lane, label, mb, start, end)]}``.

    ``chunk_shares`` and ``weight`` (per stage: seconds of a W pass, ``bwd`` then being the B pass) as
    :func:`simulate_lanes`. With equal stages and ``comm = 0`` the idle share of every stage is
    :func:`schedule_bubble`. One lane of :func:`simulate_lanes`.
    """
    m = sum(1 for a in schedule[0] if a.kind == "F" and a.chunk == 0)
    out = simulate_lanes(schedule, [[[f] * m] for f in fwd], [[[b] * m] for b in bwd],
                         [[comm] for _ in schedule], None, chunk_shares,
                         None if weight is None else [[[w] * m] for w in weight])
    step = max(c for lanes in out["end"] for c in lanes)
    busy = [lanes[0] for lanes in out["busy"]]
    return {"step": step, "busy": busy, "idle_share": [1 - b / step for b in busy], "events": out["events"]}


def _action_cost(a: Action, share: tuple[float, float], split: bool, f: float, b: float, w: float | None) -> float:
    """Seconds of one action from a stage's per-micro-batch forward ``f``, backward ``b`` and W pass ``w``: the
    chunk's ``share`` (forward, backward) of them; a split backward without ``w`` gives half to B and half to W
    (Qi et al. take T_B = T_W), with ``w`` B takes ``b`` and W takes ``w``."""
    if a.kind == "F":
        return f * share[0]
    if a.kind == "W":
        return (b / 2 if w is None else w) * share[1]
    return (b / 2 if split and w is None else b) * share[1]


def _arrival(a: Action, g: int, lane: int, last: int, finish: dict[tuple[int, int, str, int], float],
             feeds: list[int], peers: list[int], link: Callable[[int, int], float]) -> float:
    """Seconds at which every transfer into action ``a`` of model chunk ``g`` on ``lane`` has arrived: a forward
    waits for the forwards of chunk g - 1 on the lanes that ``feeds`` it, a backward for the backwards of chunk
    g + 1 on its ``peers`` (``last``: the last model chunk), each plus the hand-off ``link(chunk, lane)``; a W, the
    first chunk's forward and the last chunk's backward wait for nothing (0.0). ``finish``: (model chunk, lane,
    kind, mb) -> seconds that action ended."""
    if a.kind == "F":
        return max((finish[(g - 1, j, "F", a.mb)] + link(g - 1, j) for j in feeds), default=0.0) if g else 0.0
    if a.kind == "B":
        return max((finish[(g + 1, j, "B", a.mb)] + link(g, lane) for j in peers), default=0.0) if g < last else 0.0
    return 0.0


def simulate_lanes(schedule: Schedule, fwd: list[list[list[float]]], bwd: list[list[list[float]]],
                   comm: list[list[float]], peers: list[list[list[int]]] | None = None,
                   chunk_shares: list[list[tuple[float, float]]] | None = None,
                   weight: list[list[list[float]]] | None = None, positions: tuple[int, ...] | None = None,
                   order: list[tuple[int, Action]] | None = None) -> dict:
    """Event simulation of one step's schedule over every (stage, lane) rank.

    Args:
        schedule: one action list per stage (every lane of a stage runs it).
        fwd, bwd: ``[stage][lane][micro-batch]`` seconds of each forward / backward through the whole stage (an
            interleaved rank's chunks each take ``1/v`` of them unless ``chunk_shares`` says otherwise; a split
            backward's B and W half each unless ``weight`` is given).
        comm: ``[stage][lane]`` seconds of one transfer from that lane across the boundary to stage + 1
            (activations forward; the same for their gradients backward; ignored on the last stage; the last
            stage's value is the wrap-around transfer to stage 0 of an interleaved schedule). Interleaved: the
            hand-off from model chunk c to c + 1 costs ``comm`` of c's stage, nothing when both are on one stage.
        peers: ``[stage][lane]`` lanes of stage + 1 the lane exchanges rows with (default: the same lane;
            interleaved schedules need equal lanes and the default).
        chunk_shares: ``[stage][chunk]`` (forward share, backward share) of the stage's seconds that each of its
            chunks takes (each column summing to 1 over a stage's chunks; default 1/v each).
        weight: ``[stage][lane][micro-batch]`` seconds of each W pass of a split-backward schedule; ``bwd`` is then
            the B pass's seconds (default: B and W take half of ``bwd`` each).
        positions: the model chunk -> stage map of an interleaved schedule whose stages hold different chunk
            counts (:mod:`whale.plan.schedule_chunks`; default round-robin, :func:`chunk_ids`).
        order: the schedule's completion order (:func:`completion_order`), for callers that simulate one schedule
            many times (it does not depend on the costs); computed when not given.

    A forward starts when its rank is free and every transfer into it has arrived (receives block; sends are
    asynchronous), a backward likewise from the next virtual stage, a W when its rank is free. Returns ``{"end":
    [stage][lane] seconds the schedule ends on that rank, "busy": [stage][lane] compute seconds, "events":
    [(stage, lane, label, mb, start, end)]}`` (label: the action, e.g. ``"F"``, ``"B"``, ``"W"``, ``"Fc1"``).

    Raises:
        ScheduleError: the schedule deadlocks; ValueError: a cost list of the wrong shape.
    """
    lanes, ids, shares, peers, feeds = _setup(schedule, fwd, bwd, peers, chunk_shares, positions)
    last, owner = sum(map(len, ids)) - 1, {g: s for s, gs in enumerate(ids) for g in gs}
    split = [any(a.kind == "W" for a in acts) for acts in schedule]

    def link(g: int, j: int) -> float:
        """Seconds of the hand-off from model chunk g (lane j) to g + 1: none on one stage."""
        return 0.0 if owner[g] == owner[g + 1] else comm[owner[g]][j]

    finish: dict[tuple[int, int, str, int], float] = {}  # (model chunk, lane, kind, mb)
    clock = [[0.0] * n for n in lanes]
    events = []
    for s, a in order if order is not None else completion_order(schedule, positions):
        g = ids[s][a.chunk]
        for lane in range(lanes[s]):
            w = weight[s][lane][a.mb] if weight is not None else None
            cost = _action_cost(a, shares[s][a.chunk], split[s], fwd[s][lane][a.mb], bwd[s][lane][a.mb], w)
            start = max(clock[s][lane], _arrival(a, g, lane, last, finish, feeds[s][lane], peers[s][lane], link))
            clock[s][lane] = start + cost
            finish[(g, lane, a.kind, a.mb)] = clock[s][lane]
            events.append((s, lane, a.kind + (f"c{a.chunk}" if a.chunk else ""), a.mb, start, clock[s][lane]))
    busy = [[sum(fwd[s][lane]) + sum(bwd[s][lane]) + (sum(weight[s][lane]) if weight is not None and split[s] else 0.0)
             for lane in range(n)] for s, n in enumerate(lanes)]
    return {"end": clock, "busy": busy, "events": events}


def _setup(schedule: Schedule, fwd: list, bwd: list, peers: list | None, chunk_shares: list | None,
           positions: tuple[int, ...] | None) -> tuple:
    """The shapes :func:`simulate_lanes` checks and the defaults it fills: ``(lanes per stage, model chunk ids
    [stage][local chunk], chunk shares, peers, feeds)``; ``feeds[s][lane]``: the lanes of stage s - 1 whose rows
    reach that lane.

    Raises:
        ValueError: a cost list of the wrong shape, unequal lanes under an interleaved schedule, or chunk shares
            that do not match the chunks.
    """
    lanes = [len(f) for f in fwd]
    p, ids = len(schedule), chunk_ids(schedule, positions)
    if len(fwd) != p or len(bwd) != p or [len(b) for b in bwd] != lanes:
        raise ValueError(f"fwd/bwd must be [stage][lane][micro-batch] for {p} stages, got "
                         f"{lanes} and {[len(b) for b in bwd]} lanes")
    if sum(map(len, ids)) > p and (peers is not None or len(set(lanes)) > 1):
        raise ValueError(f"an interleaved schedule needs the same lanes on every stage, got {lanes}")
    if chunk_shares is not None and [len(c) for c in chunk_shares] != [len(gs) for gs in ids]:
        raise ValueError(f"chunk_shares must be [stage][chunk] for {p} stages of {[len(gs) for gs in ids]} chunks")
    shares = chunk_shares or [[(1.0 / len(gs), 1.0 / len(gs))] * len(gs) for gs in ids]
    peers = peers or [[[j] for j in range(n)] for n in lanes]
    feeds = [[[j for j in range(lanes[s - 1]) if lane in peers[s - 1][j]] if s else [lane] for lane in range(lanes[s])]
             for s in range(p)]
    return lanes, ids, shares, peers, feeds
