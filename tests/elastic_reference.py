"""The failure-free reference of an elastic run, trained in the test session's forkserver gloo ranks.

:func:`tests.elastic_agents.phases_run` trains the reference through ``whale launch`` (a torchrun job per phase);
:func:`phases_ranks` runs the same phases -- the same GPT script (``examples.gpt.train.main``), the same
arguments, the same spec nodes in the same rank order, each phase resuming from the previous phase's
checkpoint -- on ranks forked from :mod:`tests.distributed`'s forkserver, which has torch and Whale imported
already. The ranks see what a launched worker of that phase sees of Whale's environment (``WHALE_CLUSTER``,
``WHALE_NODE``, ``RANK``/``WORLD_SIZE``); the elastic run's own phases are launched for real. What is compared
(per-step losses, final parameters) does not depend on how a rank was started: a run of both side by side gave
identical losses and parameters.
"""

from __future__ import annotations

import os
from pathlib import Path

from tests import elastic_agents as ea
from tests.distributed import run_ranks

_CLEARED = ("WHALE_NODE", "WHALE_NNODES", "TORCHELASTIC_RESTART_COUNT", "GROUP_WORLD_SIZE")
"""Environment a phase's ranks must not inherit from the test process (they are set per phase where needed)."""


def _phase(rank: int, world: int, env: dict, argv: list[str]) -> int:
    """One rank of one phase: Whale's launch environment, then the GPT script's ``main``; returns its exit code."""
    for key in _CLEARED:
        os.environ.pop(key, None)
    os.environ.update(env)
    from examples.gpt import train  # noqa: PLC0415 - the example is imported in the forked rank, not the forkserver

    try:
        train.main(argv)
    except SystemExit as exc:  # the script's configuration errors exit 2
        return int(exc.code or 0)
    return 0


def phases_ranks(d: Path, steps: int, ckpt_every: int, data_dir: str, phases, timeout: float = 300) -> list:
    """:func:`tests.elastic_agents.phases_run` on forkserver ranks: each phase ``(nodes, stop_after)`` trains on
    those spec nodes (2 ranks per node, numbered in that order; ``stop_after`` None: to ``steps``) from the previous
    phase's checkpoint in ``d``. Returns ``[(exit code, '')]`` by phase (rank 0's code; output goes to the test's
    captured output); a failing rank raises ``RuntimeError`` with its traceback."""
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (names, stop_after) in enumerate(phases):
        spec, node = ea.phase_cluster(d, i, names)
        env = {"WHALE_CLUSTER": str(spec), **({"WHALE_NODE": node} if node else {})}
        argv = ea.job_args(d, steps, ckpt_every, data_dir)[1:]
        argv += ["--stop-after", str(stop_after)] if stop_after is not None else []
        codes = run_ranks(_phase, 2 * len(names), env, argv, timeout=timeout)
        out.append((codes[0], ""))
        if codes[0] != 0:
            break
    return out
