"""The runs behind benchmarks/elastic.py: a node killed at a chosen moment, a node joining, their no-failure
references, and the split of each recovery into parts read from the logs' arrival times.

The agents, the reference runs and the rejoin run are tests/elastic_agents.py's (``agent``, ``reference_run``,
``phases_run``, ``rejoin_run``). :func:`kill_run` is ``elastic_run`` (a kill after rank 0 logs a step, or while a
checkpoint save is in flight: the save's temporary directory ``ckpt/.tmp-step-N`` exists and ``ckpt/step-N`` does
not, checked just before the SIGKILL and again just after it, and the JSON says what was seen) with the recovery
split into parts from the timestamped log.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tests import elastic_agents as ea
from whale.runtime.checkpoint import read_model_state

RESUMED = ea.RESUMED
KILL_PARTS = (  # (part, the log line that ends it); each searched after the previous part's end
    ("failure_detected_s", r"^error: \[rank \d+\]"),
    ("group_stopped_s", r"closing signal SIGTERM|failed \(exitcode"),
    ("rendezvous_and_worker_startup_s", r"^\[data\] "),
    ("plan_and_capture_s", r"^GPT: [\d,]+ parameters"),
    ("load_checkpoint_s", RESUMED),
    ("first_step_s", r"^step \d+/"),
)
REJOIN_PARTS = (
    ("detect_s", r"closing signal SIGTERM"),
    ("graceful_stop_s", r"elastic: SIGTERM: stopped after step"),
    ("rendezvous_and_worker_startup_s", r"^\[data\] "),
    ("plan_and_capture_s", r"^GPT: [\d,]+ parameters"),
    ("load_checkpoint_s", RESUMED),
    ("first_step_s", r"^step \d+/"),
)
PART_NOTES = {
    "failure_detected_s": "kill -> a survivor rank's 'error: [rank N] ... a collective failed' line (its gloo "
                          "collective with a dead peer fails)",
    "group_stopped_s": "-> node a's agent stops the failed group ('closing signal SIGTERM' / 'failed (exitcode')",
    "detect_s": "node b's agent start -> node a's agent sends SIGTERM to its healthy group (b's imports, b on the "
                "rendezvous wait list, a's monitor seeing it)",
    "graceful_stop_s": "-> 'elastic: SIGTERM: stopped after step N' (the step finished, the checkpoint saved)",
    "rendezvous_and_worker_startup_s": "-> '[data] ...' (the re-rendezvous with last_call_timeout=5, the new "
                                       "workers spawned, their imports, wh.init and its process group, the data)",
    "plan_and_capture_s": "-> 'GPT: N parameters' (building the engine: planning for the new world, torch.export "
                          "graph capture, the local stage)",
    "load_checkpoint_s": "-> 'resumed ... at step N' (the checkpoint resharded into the new plan)",
    "first_step_s": "-> the first 'step N/...' line on the new world",
    "_": "each part ends at the first matching line after the previous part's end, timed by when the benchmark "
         "read the line from the agent's pipe; a part whose line is missing is null and its time falls into the "
         "next part",
}


def split_parts(lines: list[tuple[float, str]], t0: float, parts) -> dict:
    """Seconds of each part: part i ends at the first line (at or after the previous part's end) matching its
    pattern; a part whose line is missing is None and the next part starts where the last found one ended."""
    out, prev, i = {}, t0, 0
    for name, pattern in parts:
        hit = next(((j, t) for j, (t, line) in enumerate(lines) if j >= i and t >= prev
                    and re.search(pattern, line)), None)
        if hit is None:
            out[name] = None
            continue
        i, end = hit
        out[name], prev = round(end - prev, 3), end
    return out


def kill_run(d: Path, steps: int, every: int, data_dir: str, kill_after: int | None = None,
             save_step: int | None = None, timeout: float = 600) -> dict:
    """:func:`tests.elastic_agents.elastic_run` (kill after rank 0 logs step ``kill_after``, or while the save of
    ``save_step`` is in flight) plus ``timeline`` (node a's lines from the kill on, seconds after it) and the
    recovery's ``parts``."""
    out = ea.elastic_run(d, steps, every, kill_after, data_dir, timeout, save_step=save_step)
    after = out.pop("after", None)
    if after is None:
        return out
    return {**out, "parts": split_parts(after, 0.0, KILL_PARTS),
            "timeline": [(round(t, 2), line.rstrip()[:160]) for t, line in after][:60]}


def losses(d: Path) -> list[float]:
    return json.loads((d / "summary.json").read_text())["train_loss"]


def diffs(run_dir: Path, ref_dir: Path) -> tuple[float, float]:
    """Max abs difference of the per-step losses and of the final parameters (inf when the lengths or the
    parameter names differ)."""
    a, b = losses(run_dir), losses(ref_dir)
    loss = max(abs(x - y) for x, y in zip(a, b, strict=True)) if len(a) == len(b) else float("inf")
    pa, pb = read_model_state(str(run_dir / "ckpt")), read_model_state(str(ref_dir / "ckpt"))
    param = max((pa[k] - pb[k]).abs().max().item() for k in pa) if pa.keys() == pb.keys() else float("inf")
    return loss, param


def rejoin_row(tmp: Path, i: int, steps: int, join_after: int, data_dir: str) -> dict:
    """One rejoin (``rejoin_run``, no periodic checkpoint) and its reference (``phases_run``: node a to the step
    the graceful stop saved, then world 4 in the same rank order); returns the run's numbers."""
    run = ea.rejoin_run(tmp / f"join{i}", steps, 0, join_after, data_dir, pause=False)  # node a trains on
    row = {"join_after_step": join_after, "rc_a": run["rc_a"], "rc_b": run["rc_b"], "joined": run["joined"],
           "last_before_join": run.get("last_before_join"), "stopped_at": run.get("stopped_at"),
           "resumed_from": run.get("resumed_from"), "rejoin_s": run.get("rejoin_s"), "order": run.get("order"),
           "replan_note": "elastic: world 2 -> 4: node b (2x P100-16GB) joined; re-planned" in run["log_a"]
           + run["log_b"]}
    if run["rc_a"] != 0 or run["rc_b"] != 0 or row["stopped_at"] is None or row["resumed_from"] is None:
        (tmp / f"join{i}.log").write_text(run["log_a"] + run["log_b"])
        return row
    row["steps_lost"] = row["stopped_at"] - row["resumed_from"]
    timeline = [(t, line) for t, line in run["timeline"]]
    row["parts"] = split_parts(timeline, 0.0, REJOIN_PARTS)
    ref = ea.phases_run(tmp / f"joinref{i}", steps, 0, data_dir,
                        [(("a",), row["stopped_at"]), (tuple(row["order"]), None)])
    if [rc for rc, _ in ref] == [0, 0]:
        row["loss_diff"], row["param_diff"] = diffs(tmp / f"join{i}", tmp / f"joinref{i}")
    else:
        row["reference_rc"] = [rc for rc, _ in ref]
    return row
