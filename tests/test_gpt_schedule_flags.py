"""The GPT job's schedule flags: names, defaults and one-line errors for bad combinations (no processes), and one
interleaved run with a trace through `whale launch`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from examples.gpt.pipeline_flags import check_schedule_args
from examples.gpt.train import parse_args

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("flag,name,v", [("gpipe", "GPipe", 1), ("1F1B", "1F1B", 1), ("zb", "ZB-H1", 1),
                                         ("interleaved", "Interleaved1F1B", 2)])
def test_schedule_names_and_default_virtual_stages(flag, name, v):
    args = parse_args(["--schedule", flag, "--stages", "2", "--micro-batches", "4"])
    assert check_schedule_args(args) is None
    assert (args.schedule, args.virtual_stages) == (name, v)


@pytest.mark.parametrize("argv,match", [
    (["--schedule", "1f1b", "--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
    (["--schedule", "interleaved", "--virtual-stages", "1"], "needs --virtual-stages >= 2"),
    (["--schedule", "interleaved", "--micro-batches", "3"], "multiple of --stages 2, got 3; use 2 or 4"),
    (["--schedule", "interleaved", "--stages", "1"], "needs --stages >= 2"),
    (["--schedule", "interleaved", "--virtual-stages", "3", "--n-layer", "4"], "= 6 chunks but the model has"),
])
def test_bad_combinations_are_one_line(argv, match):
    error = check_schedule_args(parse_args(argv))
    assert error is not None and match in error and "\n" not in error


def test_unknown_schedule_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--schedule", "looped"])
    assert "unknown schedule 'looped'" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_gpt_job_runs_interleaved_and_writes_its_trace(tmp_path):
    texts = tmp_path / "data" / "texts"
    texts.mkdir(parents=True)
    shutil.copy(ROOT / "tests/data/tempest_gut.txt", texts)
    (texts / ".complete").touch()
    cmd = [str(Path(sys.executable).with_name("whale")), "launch", "-n", "2", str(ROOT / "examples/gpt/train.py"),
           "--data-dir", str(tmp_path / "data"), "--vocab-size", "300", "--n-layer", "4", "--n-head", "2",
           "--n-embd", "32", "--seq-len", "32", "--batch-size", "8", "--micro-batches", "4", "--stages", "2",
           "--schedule", "interleaved", "--virtual-stages", "2", "--steps", "3", "--eval-every", "0",
           "--eval-batches", "1", "--ckpt-dir", str(tmp_path / "ckpt"), "--sample-tokens", "0",
           "--summary", str(tmp_path / "s.json"), "--tensorboard", "", "--no-progress",
           "--trace", str(tmp_path / "trace.json")]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "schedule Interleaved1F1B with 2 chunks per stage" in proc.stdout
    names = {e["name"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"] if e["pid"] == 0}
    assert {"F0", "F0c1", "B3", "B3c1", "gradient sync"} <= names
