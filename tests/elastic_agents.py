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
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from whale.cluster import ClusterSpec

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "examples/clusters/v100_p100_elastic.yaml"
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
GPT = ["--batch-size", "8", "--seq-len", "32", "--n-layer", "2", "--n-head", "2", "--n-embd", "32",
       "--micro-batches", "2", "--stages", "2", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0",
       "--tensorboard", "", "--no-progress", "--log-every", "1", "--timeout", "60"]
RDZV_CONF = "last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=2"
"""Rendezvous settings: a survivor waits 5 s for more nodes, a dead agent is dropped after ~2 s of silence."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


def agent(node: str, port: int, d: Path, steps: int, ckpt_every: int, data_dir: str, host: bool) -> Agent:
    """Start the agent of spec node ``node`` (2 workers) in the elastic job at 127.0.0.1:``port``."""
    cmd = [sys.executable, "-m", "whale.cli", "launch", "-n", "2", "--nnodes", "1:2", "--rdzv-backend", "c10d",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "elastic-test", "--max-restarts", "3",
           "--rdzv-conf", f"{RDZV_CONF},is_host={int(host)}", "--cluster", str(SPEC), "--node-name", node,
           *job_args(d, steps, ckpt_every, data_dir)]
    return Agent(cmd, node)


def _steps(lines) -> list[tuple[float, int]]:
    return [(t, int(m.group(1))) for t, line in lines if (m := re.match(r"step (\d+)/", line))]


def elastic_run(d: Path, steps: int, ckpt_every: int, kill_after: int, data_dir: str, timeout: float = 600) -> dict:
    """Two agents; when rank 0 logs step ``kill_after``, agent b is SIGKILLed. Returns the survivor's exit code,
    both logs, the step resumed from, the last step logged before the kill, and the seconds from the kill to the
    first step completed on the new world."""
    port = free_port()
    b = agent("b", port, d, steps, ckpt_every, data_dir, host=False)
    a = agent("a", port, d, steps, ckpt_every, data_dir, host=True)
    deadline, killed_at = time.monotonic() + timeout, None
    while time.monotonic() < deadline and a.proc.poll() is None:
        done = _steps(a.lines + b.lines)
        if killed_at is None and done and done[-1][1] >= kill_after:
            b.kill()
            killed_at, last = time.monotonic(), done[-1][1]
        time.sleep(0.01)
    rc = a.wait(max(1.0, deadline - time.monotonic()))
    b.wait(10)
    out = {"rc": rc, "log_a": a.text(), "log_b": b.text(), "killed": killed_at is not None,
           "order": ["b", "a"] if "Whale plan: 4 rank(s)" in b.text() else ["a", "b"]}  # rank 0's node first
    if killed_at is None:
        return out
    m = re.search(r"resumed after a restart from .* at step (\d+)", out["log_a"])
    resumed = [t for t, line in a.lines if t > killed_at and "resumed after a restart" in line]
    after = [t for t, _ in _steps([x for x in a.lines if resumed and x[0] >= resumed[0]])]  # the new world's
    out.update(last_before_kill=last, resumed_from=int(m.group(1)) if m else None,
               recovery_s=(after[0] - killed_at) if after else None)
    return out


def reference_run(d: Path, steps: int, ckpt_every: int, switch_at: int, data_dir: str, order=("a", "b"),
                  timeout: float = 600) -> dict:
    """The same job without failure: world 4 (both nodes, ranks numbered in node ``order``, as the elastic run's
    rendezvous numbered them) to step ``switch_at`` (a checkpoint), then world 2 on node a from that checkpoint to
    ``steps``. Returns the two exit codes and logs."""
    spec = ClusterSpec.from_yaml(SPEC)
    nodes = {n.name: n for n in spec.nodes}
    d.mkdir(parents=True, exist_ok=True)
    (d / "spec.yaml").write_text(dataclasses.replace(spec, nodes=tuple(nodes[k] for k in order)).to_yaml())
    launch = [sys.executable, "-m", "whale.cli", "launch", "--cluster", str(d / "spec.yaml")]
    first = Agent([*launch, "-n", "4", *job_args(d, steps, ckpt_every, data_dir), "--stop-after", str(switch_at)],
                  "ref4")
    rc4 = first.wait(timeout)
    second = Agent([*launch, "-n", "2", "--node-name", "a", *job_args(d, steps, ckpt_every, data_dir)], "ref2")
    rc2 = second.wait(timeout)
    return {"rc4": rc4, "rc2": rc2, "log4": first.text(), "log2": second.text()}
