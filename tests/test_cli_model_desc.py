"""``whale plan`` / ``whale simulate`` on an analytic model description with forced degrees (issue 28, part 4):
the 1T GPT of Megatron-LM SC'21 on 3072 A100-80GB, planned and predicted without building a module or timing
one; the CLI runs through :func:`whale.cli.main` in this process and once as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from whale.cli import main

ONE_T = "gpt:layers=128,hidden=25600,heads=160,seq=2048,vocab=51200"
FORCED = ["--world", "3072", "--batch", "3072", "--dp", "6", "--pp", "64", "--split", "8", "--micro-batches", "512",
          "--recompute", "--schedule", "1F1B", "--sequence-parallel", "off", "--json"]


def run(capsys, *argv: str) -> tuple[int, dict | str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 and "--json" in argv else err)


def test_plan_forced_1t(capsys):
    rc, out = run(capsys, "plan", "--model-desc", ONE_T, *FORCED)
    assert rc == 0
    assert out["plan"].startswith("dp 6 x pp 64 x split 8, 512 micro-batch(es)")
    assert "activation checkpointing" in out["plan"]
    assert out["parameters"] == pytest.approx(1.008e12, rel=1e-3)
    assert out["fits"] and out["peak_bytes_per_device"] < 80e9
    assert 100 < out["tflops_per_device"] < 312  # below the A100's 16-bit peak, near the published 163


def test_simulate_1t_without_timing(capsys, tmp_path):
    rc, out = run(capsys, "simulate", "--model-desc", ONE_T, *FORCED, "--png", "")
    assert rc == 0
    assert len(out["stage_forward_seconds"]) == len(out["stage_peak_bytes"]) == 64
    assert out["pipeline_seconds"] + out["post_seconds"] == pytest.approx(out["step_seconds"])
    desc = tmp_path / "gpt1t.yaml"
    desc.write_text("kind: gpt\nlayers: 128\nhidden: 25600\nheads: 160\nseq: 2048\nvocab: 51200\n")
    rc, same = run(capsys, "simulate", "--model-desc", str(desc), *FORCED, "--png", "")
    assert rc == 0 and same["step_seconds"] == out["step_seconds"]


def test_illegal_split_is_refused(capsys):
    rc, err = run(capsys, "plan", "--model-desc", "gpt:layers=8,hidden=4096,heads=32", "--world", "56", "--split", "7")
    assert rc == 2 and "split degree 7 does not divide heads=32" in err
    rc, err = run(capsys, "plan", "--model-desc", "gpt:layers=8,hidden=4096,heads=32", "--world", "32", "--split", "16")
    assert rc == 2 and "spans nodes of 8 devices" in err
    rc, err = run(capsys, "plan", "--world", "8")
    assert rc == 2 and "--model-desc" in err


def test_auto_search_on_a_described_model(capsys):
    rc, out = run(capsys, "plan", "--model-desc", "gpt:layers=24,hidden=2304,heads=24", "--world", "32",
                  "--batch", "512", "--json")
    assert rc == 0 and out["fits"]
    split = int(out["plan"].split("split ")[1].split(",")[0].split()[0])
    assert 24 % split == 0 and split <= 8


def test_subprocess_plan():
    r = subprocess.run([sys.executable, "-m", "whale.cli", "plan", "--model-desc", ONE_T, *FORCED],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["fits"]
