"""The GPT job's checkpoint run: resume its own run or claim the directory for a fresh one, and what a job that
is already finished says (issue 24). Collective where the library calls are (every rank calls them)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import whale as wh
from examples.gpt.data import TokenBatches
from whale.planner.balance import InfeasiblePlanError
from whale.runtime import ckpt_runs, elastic, failures


def add_resume_args(p) -> None:
    """``--resume`` / ``--overwrite`` (mutually exclusive) on argparse parser ``p``: the example jobs' choice for a
    ``--ckpt-dir`` that holds checkpoints (``wh.claim_checkpoint_dir``)."""
    fresh = p.add_mutually_exclusive_group()
    fresh.add_argument("--resume", action="store_true", help="continue the run in --ckpt-dir from its newest intact "
                       "checkpoint, if any, under this run's plan (another world size, --stages or cluster re-plans "
                       "and reshards it); a job restarted by whale launch --max-restarts resumes its own run by itself")
    fresh.add_argument("--overwrite", action="store_true", help="start afresh in a --ckpt-dir that holds another "
                       "run's checkpoints: they are removed (without it such a directory is refused)")


def maybe_resume(engine: wh.Engine, args, batches: TokenBatches) -> tuple[int, dict]:
    """Restore the newest intact checkpoint of the run in ``--ckpt-dir`` when ``--resume`` (or when torchrun
    restarted this job after a failure, ``TORCHELASTIC_RESTART_COUNT`` > 0, and the run there is this job's), else
    claim the directory for a fresh run: another run's checkpoints there are refused now, before any work; under
    ``--overwrite`` the claim, which removes them, waits for :func:`claim_fresh` after the job's first forward.
    Returns (start step, history)."""
    ckpt_runs.refuse_step_dir(args.ckpt_dir)  # a step directory: new checkpoints would nest inside it
    restarted = ckpt_runs.restarted()
    newest = ckpt_runs.newest(args.ckpt_dir) if restarted else None
    own = newest is not None and ckpt_runs.job_key() is not None and newest.info.get("job") == ckpt_runs.job_key()
    if not ((args.resume or own) and wh.latest_checkpoint(args.ckpt_dir)):
        if restarted and newest is None and engine.rank == 0:
            print(f"restarted with no complete checkpoint in {args.ckpt_dir}: starting from step 0", flush=True)
        elif args.resume and not restarted and engine.rank == 0:  # said, so a mistyped --ckpt-dir is seen at once
            print(f"--resume: no checkpoint in {os.path.abspath(args.ckpt_dir)} yet: starting a new run at step 0",
                  flush=True)
        if not args.overwrite:  # removes nothing: refused or claimed at once
            claim_fresh(engine, args)
        return 0, {}
    extra = engine.load_checkpoint(args.ckpt_dir)
    batches.load_state_dict(extra["data"])
    if engine.rank == 0:
        why = " after a restart" if restarted else ""
        where = Path(args.ckpt_dir) / ckpt_runs.store.step_name(int(extra["step"]))  # the one loaded
        print(f"resumed{why} from {where} at step {extra['step']}", flush=True)
    return int(extra["step"]), {k: v for k, v in extra.items() if k not in ("step", "data")}


def claim_fresh(engine: wh.Engine, args) -> None:
    """Make ``--ckpt-dir`` this fresh run's (``wh.claim_checkpoint_dir``; collective) unless the run already owns
    it (resumed, or claimed by :func:`maybe_resume`); ``--overwrite`` removes another run's checkpoints here, said on
    rank 0. A job calls it after its first forward (the held-out loss at step 0), so that a configuration that
    only the model's forward refuses (a shape a split or sequence-parallel layer cannot cut) loses nothing."""
    if engine.run_id is not None:
        return
    note = wh.claim_checkpoint_dir(engine, args.ckpt_dir, overwrite=args.overwrite)
    if note and engine.rank == 0:
        print(note, flush=True)


def finished_summary(args, step: int, engine: wh.Engine) -> bool:
    """Whether ``--summary`` already holds the summary of the finished run (its ``steps`` is ``step`` and its
    ``run`` the engine's, adopted from the checkpoint); rank 0 says where it is, or that it is written again.
    Every rank reads the file and returns the same answer (one file system)."""
    try:
        old = json.loads(Path(args.summary).read_text())
        done = old.get("steps") == step and old.get("run") == engine.run_id
    except (OSError, ValueError, AttributeError):
        done = False
    if engine.rank == 0:
        print(f"the summary of the finished run is at {args.summary}" if done else
              f"no summary of the finished run at {args.summary}: writing it from the checkpoint", flush=True)
    return done


def note_membership(ctx, state: dict) -> None:
    """An elastic job (``WHALE_NODE`` set, a cluster spec): record the nodes present in ``state`` (saved with every
    checkpoint) and, when they differ from the checkpoint's, rank 0 prints what changed, e.g. "world 4 -> 2: node b
    (2x P100-16GB) left; re-planned" (the plan printed above is the new one)."""
    if ctx.cluster is None or not os.environ.get(elastic.NODE_ENV):
        return
    now = elastic.membership(ctx.cluster)
    note = elastic.change_note(state.get("membership"), now)
    if note and ctx.rank == 0:
        print(f"elastic: {note}", flush=True)
    state["membership"] = now


def add_elastic_args(a) -> None:
    """``--wait-for-nodes SECONDS`` (``a`` is ``add_argument``): how long an elastic job whose nodes cannot hold the
    model waits for another node to join before it stops with the planner's error."""
    a("--wait-for-nodes", type=float, default=300.0, metavar="SECONDS",
      help="elastic job (whale launch --nnodes MIN:MAX) whose nodes cannot hold the model, fewer than MAX present: "
           "print the error, then wait this long in all for a node to join (torchrun re-forms the group and the job "
           "re-plans) before exiting non-zero with the error (0: exit at once)")


def wait_or_raise(exc: InfeasiblePlanError, args, ctx) -> None:
    """The nodes present cannot hold the model: in an elastic job that may still grow, print the error on every
    rank and wait (:func:`whale.runtime.elastic.wait_for_nodes`; torchrun's restart on a join ends the wait); then,
    or at once when no node can join, raise: ``exc`` itself, or after the deadline a PlanError naming it."""
    if elastic.nodes_short() is None or args.wait_for_nodes <= 0:
        raise exc
    failures.report_error(exc, traceback=False)
    if elastic.wait_for_nodes(str(exc), args.wait_for_nodes, ctx.rank, ctx.world_size):
        raise wh.PlanError(f"no node joined within --wait-for-nodes {args.wait_for_nodes:g} s; {exc}") from None
