"""Real elastic runs of the GPT example for tests/test_elastic.py and benchmarks/elastic.py: two ``whale launch``
agents (torchrun's elastic agent, c10d rendezvous on 127.0.0.1), each one node of
examples/clusters/v100_p100_elastic.yaml (node a: 2x V100, node b: 2x P100), one of them killed mid-run; and the
reference run that switches from world 4 to world 2 at a given step without any failure (train to the step at
world 4, checkpoint, resume on node a).

Agent a hosts the rendezvous store (``is_host=1``): torchrun's c10d backend keeps its TCPStore in one agent, so
that agent must survive; b is the one killed.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests.ports import free_port
from whale.cluster import ClusterSpec
from whale.runtime.ckpt_store import step_name

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples/clusters/v100_p100_elastic.yaml"
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
GPT = ["--batch-size", "8", "--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
       "--micro-batches", "2", "--stages", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
       "--tensorboard", "", "--no-progress", "--log-every", "1", "--timeout", "60"]
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=4"
"""Rendezvous settings: a survivor waits 5 s for more nodes, a dead agent is dropped after 4 s of silence (at
keep_alive_max_attempt=2 a live agent can look dead: whale launch refuses < 3)."""


def job_args(d: Path, steps: int, ckpt_every: int, data_dir: str) -> list[str]:
    """The GPT script and its arguments, with checkpoints and summary under ``d``."""
    return [str(ROOT / "examples/gpt/train.py"), *GPT, "--data-dir", data_dir, "--steps", str(steps),
            "--ckpt-every", str(ckpt_every), "--ckpt-dir", str(d / "ckpt"), "--summary", str(d / "summary.json"),
            "--resume"]


class Agent:
    """One ``whale launch`` agent in its own session; its output lines are kept with their arrival times."""

    def __init__(self, cmd: list[str], name: str):
        self.name, self.lines = name, []  # lines: (time.monotonic(), text)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def kill(self) -> None:
        """SIGKILL the agent's workers (each in a session of its own) and the agent's process group."""
        out = subprocess.run(["pgrep", "-P", str(self.proc.pid)], capture_output=True, text=True).stdout
        for pid in [int(x) for x in out.split()]:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout: float) -> int:
        """The exit code; on timeout the agent is killed and -9 returned."""
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            rc = -9
        self._reader.join(5)
        return rc

    def text(self) -> str:
        return "".join(t for _, t in self.lines)


def agent(node: str, port: int, d: Path, steps: int, ckpt_every: int, data_dir: str, host: bool, spec=SPEC,
          extra=(), max_restarts: int = 3, rdzv_conf: str = RDZV_CONF) -> Agent:
    """Start the agent of spec node ``node`` (2 workers) in the elastic job at 127.0.0.1:``port``; ``extra``: more
    arguments for the GPT script; ``rdzv_conf``: the rendezvous settings (``is_host`` is added)."""
    cmd = [sys.executable, "-m", "whale.cli", "launch", "-n", "2", "--nnodes", "1:2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--max-restarts", str(max_restarts),
           "--rdzv-conf", f"{rdzv_conf},is_host={int(host)}", "--cluster", str(spec), "--node-name", node,
           *job_args(d, steps, ckpt_every, data_dir), *extra]
    return Agent(cmd, node)


RESUMED = r"resumed (?:after a restart )?from .* at step (\d+)"
"""A resumed job's line, with the step it resumed from."""


def _steps(lines) -> list[tuple[float, int]]:
    return [(t, int(m.group(1))) for t, line in lines if (m := re.match(r"step (\d+)/", line))]


def _ckpt_state(ckpt: Path, step: int) -> dict:
    """Whether the save of ``step`` is in flight (its temporary directory exists) and whether it is published."""
    return {"tmp_exists": (ckpt / f".tmp-{step_name(step)}").exists(), "published": (ckpt / step_name(step)).exists()}


def _kill_due(kill_after, save_step, ckpt: Path, done) -> tuple[bool, dict | None]:
    """Whether to kill now, and (with ``save_step``) what the checkpoint directory holds."""
    if save_step is None:
        return bool(done and done[-1][1] >= kill_after), None
    before = _ckpt_state(ckpt, save_step)
    fire = before["tmp_exists"] and not before["published"]
    return fire or bool(done and done[-1][1] > save_step), before  # a missed save: kill anyway, and say so


def elastic_run(d: Path, steps: int, ckpt_every: int, kill_after: int | None, data_dir: str, timeout: float = 600,
                save_step: int | None = None, poll_s: float = 0.002) -> dict:
    """Two agents (b, then a hosting the store); agent b and its workers are SIGKILLed when rank 0 logs step
    ``kill_after`` or, with ``save_step``, while the save of that step is in flight (its temporary directory
    ``ckpt/.tmp-step-N`` exists and ``ckpt/step-N`` does not; polled every ``poll_s``). Returns the survivor's exit
    code, both logs, ``trigger`` (how the kill was timed; with ``save_step`` what the checkpoint directory held
    just before and just after the kill), the step resumed from, the last step logged before the kill, the seconds
    from the kill to the first step completed on the new world (``recovery_s``) and node a's timestamped lines
    from the kill on (``after``: (seconds after the kill, line))."""
    port = free_port()
    b = agent("b", port, d, steps, ckpt_every, data_dir, host=False)
    a = agent("a", port, d, steps, ckpt_every, data_dir, host=True)
    ckpt, deadline, killed_at, trigger, last = d / "ckpt", time.monotonic() + timeout, None, {}, None
    while time.monotonic() < deadline and a.proc.poll() is None:
        if killed_at is None:
            done = _steps(a.lines + b.lines)
            fire, before = _kill_due(kill_after, save_step, ckpt, done)
            if fire:
                b.kill()
                killed_at, last = time.monotonic(), (done[-1][1] if done else 0)
                if before is not None and before["tmp_exists"]:  # the save of a step follows the step on every
                    last = max(last, save_step)  # rank; its log line may not have been read yet
                trigger = {"kind": "after_step_logged", "step": kill_after} if save_step is None else \
                    {"kind": "during_save", "step": save_step, "before_kill": before,
                     "after_kill": _ckpt_state(ckpt, save_step)}
        time.sleep(poll_s if save_step is not None else 0.01)
    rc = a.wait(max(1.0, deadline - time.monotonic()))
    b.wait(10)
    out = {"rc": rc, "log_a": a.text(), "log_b": b.text(), "killed": killed_at is not None, "trigger": trigger,
           "order": ["b", "a"] if "Whale plan: 4 rank(s)" in b.text() else ["a", "b"]}  # rank 0's node first
    if killed_at is None:
        return out
    after = [x for x in a.lines if x[0] > killed_at]
    res = [(t, int(m.group(1))) for t, line in after if (m := re.search(RESUMED, line))]
    first = [t for t, _ in _steps([x for x in after if res and x[0] >= res[0][0]])]  # the new world's
    out.update(last_before_kill=last, resumed_from=res[0][1] if res else None,
               recovery_s=(first[0] - killed_at) if first else None,
               after=[(t - killed_at, line) for t, line in after])
    return out


def reference_run(d: Path, steps: int, ckpt_every: int, switch_at: int, data_dir: str, order=("a", "b"),
                  timeout: float = 600, after=("a",)) -> dict:
    """The same job without failure: world 4 (both nodes, ranks numbered in node ``order``, as the elastic run's
    rendezvous numbered them) to step ``switch_at`` (a checkpoint), then the nodes ``after`` (default: node a,
    world 2) from that checkpoint to ``steps``. Returns the two exit codes and logs (``rc4``/``log4`` the first
    phase, ``rc2``/``log2`` the second, whatever their world sizes)."""
    first, second = phases_run(d, steps, ckpt_every, data_dir, [(tuple(order), switch_at), (tuple(after), None)],
                               timeout)
    return {"rc4": first[0], "rc2": second[0], "log4": first[1], "log2": second[1]}


def phase_cluster(d: Path, i: int, names) -> tuple[Path, str | None]:
    """The cluster spec and node name of phase ``i`` on spec nodes ``names`` (ranks numbered in that order): one
    node is the full spec cut to it by ``WHALE_NODE``; several are a spec of those nodes written under ``d``."""
    if len(names) == 1:
        return SPEC, names[0]
    spec = ClusterSpec.from_yaml(SPEC)
    nodes = {n.name: n for n in spec.nodes}
    path = d / f"spec{i}.yaml"
    path.write_text(dataclasses.replace(spec, nodes=tuple(nodes[k] for k in names)).to_yaml())
    return path, None


def phases_run(d: Path, steps: int, ckpt_every: int, data_dir: str, phases, timeout: float = 600) -> list:
    """A run without failure through fixed memberships: each phase ``(nodes, stop_after)`` trains on those spec
    nodes (ranks numbered in that order; ``stop_after`` None: to ``steps``) from the previous phase's checkpoint.
    Returns ``[(exit code, log)]`` by phase; stops at the first failing phase."""
    d.mkdir(parents=True, exist_ok=True)
    out = []
    for i, (names, stop_after) in enumerate(phases):
        spec, node = phase_cluster(d, i, names)
        launch = [sys.executable, "-m", "whale.cli", "launch", "-n", str(2 * len(names)), "--cluster", str(spec),
                  *(["--node-name", node] if node else [])]
        stop = ["--stop-after", str(stop_after)] if stop_after is not None else []
        job = Agent([*launch, *job_args(d, steps, ckpt_every, data_dir), *stop], f"phase{i}")
        out.append((job.wait(timeout), job.text()))
        if out[-1][0] != 0:
            break
    return out


def _merged(*agents: Agent) -> list[tuple[float, str]]:
    return sorted(x for a in agents for x in a.lines)


RESTART_LINE = "closing signal"
"""What torchrun's agent logs (a warning) as it sends SIGTERM to each worker of a group it stops or restarts."""


def signal_workers(a: Agent, sig: int) -> None:
    """Send ``sig`` to every worker of agent ``a`` (the agent runs torchrun in-process: its children)."""
    out = subprocess.run(["pgrep", "-P", str(a.proc.pid)], capture_output=True, text=True).stdout
    for pid in [int(x) for x in out.split()]:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def rejoin_run(d: Path, steps: int, ckpt_every: int, join_after: int, data_dir: str, timeout: float = 600,
               pause: bool = True, pause_limit: float = 120.0) -> dict:
    """Node a alone (world 2) until rank 0 logs step ``join_after``, then node b's agent starts: torchrun restarts
    a's healthy group (SIGTERM: a's workers checkpoint after the current step) and re-forms it at world 4. Returns
    both exit codes and logs, ``stopped_at`` (the step a's workers checkpointed on SIGTERM), ``resumed_from``,
    ``order`` (world 4's nodes in rank order) and ``rejoin_s``: b's agent start to the first step logged at world 4.

    ``pause``: a's workers are stopped (SIGSTOP) from the moment b's agent starts until a's agent logs that it is
    signalling them (:data:`RESTART_LINE`), or ``pause_limit`` seconds, then continued (SIGCONT), so the join lands
    mid-run however long b takes to start on a loaded host, and a short run suffices; the SIGTERM waits, pending,
    until the workers run again, as it would for a node too busy to be scheduled. ``pause=False`` measures an
    undisturbed rejoin (benchmarks/elastic.py): node a trains on while b starts."""
    port = free_port()
    a = agent("a", port, d, steps, ckpt_every, data_dir, host=True)
    b, joined_at, last, deadline, paused = None, None, None, time.monotonic() + timeout, False
    while time.monotonic() < deadline and a.proc.poll() is None:
        done = _steps(a.lines)
        if b is None and done and done[-1][1] >= join_after:
            if pause:
                signal_workers(a, signal.SIGSTOP)
                paused = True
            joined_at, last = time.monotonic(), _steps(a.lines)[-1][1]
            b = agent("b", port, d, steps, ckpt_every, data_dir, host=False)
        if paused and (time.monotonic() - joined_at > pause_limit
                       or any(RESTART_LINE in line for t, line in a.lines if t >= joined_at)):
            signal_workers(a, signal.SIGCONT)
            paused = False
        time.sleep(0.01)
    rc_a = a.wait(max(1.0, deadline - time.monotonic()))
    rc_b = b.wait(max(10.0, deadline - time.monotonic())) if b is not None else None
    out = {"rc_a": rc_a, "rc_b": rc_b, "log_a": a.text(), "log_b": b.text() if b else "", "joined": b is not None}
    if b is None:
        return out
    lines = _merged(a, b)
    stop = re.search(r"elastic: SIGTERM: stopped after step (\d+)", out["log_a"])
    res = [(t, int(m.group(1))) for t, line in lines
           if t > joined_at and (m := re.search(r"resumed (?:after a restart )?from .* at step (\d+)", line))]
    after = [t for t, _ in _steps([x for x in lines if res and x[0] >= res[0][0]])]
    out.update(stopped_at=int(stop.group(1)) if stop else None, resumed_from=res[0][1] if res else None,
               order=["b", "a"] if "Whale plan: 4 rank(s)" in out["log_b"] else ["a", "b"],
               last_before_join=last,
               rejoin_s=(after[0] - joined_at) if after else None,
               timeline=[(round(t - joined_at, 2), line.rstrip()) for t, line in lines if t >= joined_at])
    return out
