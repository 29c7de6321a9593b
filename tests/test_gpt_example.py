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
import torch

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


def _moe_gpt_vs_one_process(rank, world):
    """3 AdamW steps on one batch of the main job's MoE GPT (one stage, its experts split over the ranks, the
    job's loss with the aux loss) and of a one-process ``deepcopy``; returns both loss lists."""
    import copy

    import torch

    import whale as wh
    from examples.gpt.model import GPT, GPTConfig
    from examples.gpt.moe import moe_loss_fn

    ctx = wh.init(wh.Config(seed=0, num_micro_batch=2))
    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, moe_experts=4, moe_top_k=2)
    model = GPT(cfg)
    ref = copy.deepcopy(model)
    data = [torch.randint(0, 64, (8, 9), generator=torch.Generator().manual_seed(0))] * 3
    engine = wh.parallelize(model, moe_loss_fn(model, wh.token_cross_entropy()),
                            lambda ps: torch.optim.AdamW(ps, lr=1e-2), ctx=ctx,
                            sample_batch=(data[0][:, :-1], data[0][:, 1:]))
    ref_opt, ref_loss = torch.optim.AdamW(ref.parameters(), lr=1e-2), moe_loss_fn(ref, wh.token_cross_entropy())
    losses, ref_losses = [], []
    for ids in data:
        x, y = ids[:, :-1], ids[:, 1:]
        losses.append(engine.step((x, y))["loss"])
        ref_opt.zero_grad()
        loss = ref_loss(ref(x), y) / y.numel()
        loss.backward()
        ref_opt.step()
        ref_losses.append(loss.item())
    return losses, ref_losses, engine.plan.moe_layers


def test_moe_gpt_expert_parallel_trains_as_one_process():
    """The main job's MoE variant (`--moe-experts 4 --stages 1` on 2 ranks): each block's MLP a wh.MoE whose
    experts are split over the 2 devices; the loss (cross-entropy + aux loss) of every step equals a
    one-process copy's (fp32), so it trains the same model, and drops."""
    from tests.distributed import run_ranks

    losses, ref_losses, moe_layers = run_ranks(_moe_gpt_vs_one_process, 2, timeout=120)[0]
    assert [m.module for m in moe_layers] == ["blocks.0.mlp", "blocks.1.mlp"]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-5)
    assert losses[-1] < losses[0]


def test_moe_gpt_pipeline_stages_are_expert_parallel_with_the_aux_loss_in_the_last():
    """`--moe-experts 4 --stages 2` on 4 ranks plans 2 stages of 2 devices, each MoE split over its stage's 2
    devices; the first stage's layers carry no aux loss (the loss runs on the last stage)."""
    sys.path.insert(0, str(ROOT))
    import whale as wh
    from examples.gpt.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=8, n_layer=2, n_head=2, n_embd=16, moe_experts=4)
    model = GPT(cfg, stages=2, stage_width=2)
    x = torch.zeros(8, 8, dtype=torch.long)
    plan = wh.plan_model(model, 4, wh.Config(num_micro_batch=2), sample_batch=(x, x))
    assert plan.num_stages == 2 and plan.stage_width == 2 and plan.capture == "export"
    assert [m.module for m in plan.moe_layers] == ["blocks.0.mlp", "blocks.1.mlp"]
    assert [m.aux_loss_coef for m in model.modules() if isinstance(m, wh.MoE)] == [0.0, 0.01]


@pytest.mark.timeout(120)
def test_moe_gpt_job_trains_in_one_process(tmp_path):
    """`train.py --moe-experts 4 --moe-top-k 1 --stages 1` (one process): the held-out loss drops and the
    summary and the generated sample come out (the gathered experts load into a plain GPT)."""
    sys.path.insert(0, str(ROOT))
    from examples.gpt.train import run

    texts = tmp_path / "data" / "texts"
    texts.mkdir(parents=True)
    shutil.copy(ROOT / "tests/data/tempest_gut.txt", texts)
    (texts / ".complete").touch()
    run(["--data-dir", str(tmp_path / "data"), "--vocab-size", "300", "--n-layer", "2", "--n-head", "2",
         "--n-embd", "32", "--seq-len", "32", "--batch-size", "8", "--micro-batches", "1", "--stages", "1",
         "--steps", "12", "--eval-every", "0", "--eval-batches", "2", "--ckpt-dir", str(tmp_path / "ckpt"),
         "--sample-tokens", "4", "--summary", str(tmp_path / "s.json"), "--tensorboard", "", "--no-progress",
         "--moe-experts", "4", "--moe-top-k", "1"])
    summary = json.loads((tmp_path / "s.json").read_text())
    assert summary["config"]["moe_experts"] == 4 and summary["steps"] == 12
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.2
