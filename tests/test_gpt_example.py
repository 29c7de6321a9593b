"""End to end: the GPT example through `whale launch` (real torchrun) on the emulated V100/P100 cluster,
then `--resume` from its checkpoint. Uses a committed public-domain slice of The Tempest (Project Gutenberg)
so no download is needed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WHALE = Path(sys.executable).with_name("whale")


def _run(tmp: Path, *extra: str) -> str:
    cmd = [str(WHALE), "launch", "-n", "4", "--cluster", str(ROOT / "examples/clusters/v100_p100.yaml"),
           str(ROOT / "examples/gpt/train.py"), "--data-dir", str(tmp / "data"), "--vocab-size", "300",
           "--n-layer", "4", "--n-head", "2", "--n-embd", "32", "--seq-len", "32", "--batch-size", "8",
           "--eval-every", "3", "--eval-batches", "2", "--ckpt-dir", str(tmp / "ckpt"), "--sample-tokens", "8",
           "--summary", str(tmp / "summary.json"), "--tensorboard", str(tmp / "tb"), "--no-progress", *extra]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)  # two torchrun jobs of 4 ranks on 2 cores: ~60 s on a quiet host, far more under load
def test_gpt_example_trains_on_emulated_cluster_and_resumes(tmp_path):
    texts = tmp_path / "data" / "texts"
    texts.mkdir(parents=True)
    shutil.copy(ROOT / "tests/data/tempest_gut.txt", texts)
    (texts / ".complete").touch()
    out = _run(tmp_path, "--steps", "6")
    assert "Whale plan: 4 rank(s) = 2 pipeline stages of 1 device(s) x 2 replicas" in out
    assert "EMULATED" in out and "V100-32GB" in out
    assert "bubble report" in out and "held-out loss" in out
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0  # TensorBoard scalars beside the JSON summary
    first = json.loads((tmp_path / "summary.json").read_text())
    assert first["steps"] == 6 and first["final_val_loss"] < first["initial_val_loss"]
    out = _run(tmp_path, "--steps", "8", "--resume")
    assert "resum" in out.lower() and "keeps the checkpoint's horizon" in out
    second = json.loads((tmp_path / "summary.json").read_text())
    assert second["steps"] == 8
    assert (tmp_path / "ckpt" / "step-00000008" / "whale.json").exists()
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000008"


def test_a_longer_resumed_run_keeps_the_learning_rate_schedule():
    """A 600-step run resumed to 900 continues at the rate it had (its cosine horizon is saved), never jumping
    back up; a fresh 900-step run has its own, longer horizon."""
    sys.path.insert(0, str(ROOT))
    from examples.gpt.train import lr_at, lr_horizon, parse_args

    short = parse_args(["--steps", "600", "--lr", "1e-3"])
    saved = lr_horizon(short)
    longer = parse_args(["--steps", "900", "--lr", "1e-3", "--resume"])
    resumed = [lr_at(s, longer, lr_horizon(longer, saved)) for s in range(590, 900)]
    assert resumed[:10] == [lr_at(s, short) for s in range(590, 600)]  # the same rates up to the resume point
    assert all(b <= a for a, b in zip(resumed, resumed[1:], strict=False))  # never back up
    assert resumed[-1] == 1e-3 / 10
    assert lr_at(600, longer, lr_horizon(longer)) > 2e-4  # a fresh longer run is still decaying at step 600
