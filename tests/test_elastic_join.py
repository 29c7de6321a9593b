"""Elastic re-expansion (issue 29): a node that joins makes torchrun restart the healthy worker group, whose
workers checkpoint after the current step on SIGTERM (whale.runtime.graceful), and the job re-plans at world 4."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest

from tests import elastic_agents as ea
from tests import elastic_reference as er
from whale.runtime import elastic
from whale.runtime.launch import LaunchError, launch

DATA = str(ea.ROOT / "data/shakespeare")


def test_agent_env_only_for_elastic_jobs_and_keep_alive_checked():
    env = elastic.agent_env("1:2", "c10d", "keep_alive_max_attempt=4", base={})
    assert env == {"WHALE_NNODES": "1:2", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert elastic.agent_env("2", "c10d", None, base={}) == {} and elastic.agent_env("1:2", None, None) == {}
    assert "TORCH_DISABLE" not in str(elastic.agent_env("1:2", "c10d", None, base={elastic.SHARE_STORE_ENV: "0"}))
    with pytest.raises(ValueError, match="keep_alive_max_attempt=2: an elastic job needs >= 3"):
        elastic.check_keep_alive("last_call_timeout=5,keep_alive_max_attempt=2")
    with pytest.raises(LaunchError, match="keep_alive_max_attempt=1"):
        launch(2, str(ea.ROOT / "examples/gpt/train.py"), nnodes="1:2", rdzv_backend="c10d",
               rdzv_conf="keep_alive_max_attempt=1", dry_run=True)


def test_nodes_short_and_wait_returns_at_once_when_no_node_can_join(monkeypatch, tmp_path):
    monkeypatch.setenv("WHALE_NNODES", "1:2")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "1")
    assert elastic.nodes_short() == (1, 2)
    monkeypatch.setenv("WHALE_ERROR_DIR", str(tmp_path))
    assert elastic.wait_for_nodes("too small", 0.2, rank=1, world=2, poll_s=0.05) is True
    assert elastic._waited_s(2) >= 0.2  # the clock survives a restart of the group at the same world
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    assert elastic.nodes_short() is None and elastic.wait_for_nodes("x", 60, 0, 4) is False


def test_sigterm_stops_at_the_step_boundary(tmp_path):
    """One process: SIGTERM in the middle of a 'step' only sets the flag; the loop sees it after the step."""
    code = textwrap.dedent("""
        import os, signal, sys
        from whale.runtime import graceful
        done = 0
        with graceful.on_sigterm(True) as stop:
            for step in range(100):
                if step == 3:
                    os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step
                done = step + 1
                if stop.requested():
                    print("stopped after", done, flush=True)
                    stop.exit()
        """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": f"{ea.ROOT / 'src'}"})
    assert out.returncode == 128 + signal.SIGTERM and out.stdout.strip() == "stopped after 4", out


def _losses(d) -> list[float]:
    return json.loads((d / "summary.json").read_text())["train_loss"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rejoin_replans_at_world_4_with_no_step_lost_and_matches_the_reference(tmp_path):
    """Node a alone (world 2); node b's agent starts after step 6: a's workers checkpoint after their current step
    on torchrun's SIGTERM, the group re-forms at world 4 and resumes from that very step; the losses equal a run
    that trains world 2 to that step and world 4 from there (same rank order), so data position and RNG resumed.
    a's workers are paused while b starts (``rejoin_run(pause=True)``), so the join lands mid-run at any host load
    and 30 steps suffice (with a free-running node a, 300 steps were needed on a loaded host)."""
    steps = 30
    run = ea.rejoin_run(tmp_path / "elastic", steps, 0, join_after=6, data_dir=DATA)
    log = run["log_a"] + run["log_b"]
    assert run["joined"] and run["rc_a"] == 0 and run["rc_b"] == 0, log[-3000:]
    assert "Whale plan: 2 rank(s)" in run["log_a"] and "Whale plan: 4 rank(s)" in log, log[-3000:]
    assert "elastic: world 2 -> 4: node b (2x P100-16GB) joined; re-planned" in log
    stop = run["stopped_at"]
    assert stop is not None and run["resumed_from"] == stop and 6 <= stop < steps, log[-3000:]
    phases = er.phases_ranks(tmp_path / "ref", steps, 0, DATA, [(("a",), stop), (tuple(run["order"]), None)])
    assert [rc for rc, _ in phases] == [0, 0], phases[-1][1][-3000:]
    got, want = _losses(tmp_path / "elastic"), _losses(tmp_path / "ref")
    assert len(got) == len(want) == steps
    assert max(abs(x - y) for x, y in zip(got, want, strict=True)) <= 1e-6
