"""Issue 23, examples and docs drift: PlanSampler's mid-epoch resume (process-free), the HF example's flags and
its checkpoint resume (2 gloo ranks), and what ``whale simulate`` prints (progress, plan, disagreement warning,
timeline labels; process-free, on a seeded calibration)."""

from __future__ import annotations

import re

import pytest
import torch

import whale as wh
from tests.models import TinyLM


def _plan(world, layers=(2,), mb=1, shares=None):
    return wh.plan_model(TinyLM(stage_layers=layers), world, wh.Config(num_micro_batch=mb, load_shares=shares))


def _dataset(n: int):
    return torch.utils.data.TensorDataset(torch.arange(n)[:, None], torch.arange(n)[:, None])


# --- PlanSampler.state_dict / load_state_dict (no processes) ---------------------------------------------------

def test_sampler_resumes_mid_epoch_with_the_remaining_batches():
    """k batches taken, state saved, a new sampler (same plan) loaded with it yields exactly the rest."""
    plan = _plan(2, shares=(3, 1))
    for rank in range(2):
        whole = wh.PlanSampler(40, plan, rank, 8, seed=5)
        whole.set_epoch(3)
        want = list(whole)
        first = wh.PlanSampler(40, plan, rank, 8, seed=5)
        first.set_epoch(3)
        it = iter(first)
        taken = [next(it) for _ in range(2)]
        state = first.state_dict()
        assert state == {"epoch": 3, "position": 2, "seed": 5, "global_batch": 8, "dataset_len": 40,
                         "shuffle": True, "drop_last": True}
        again = wh.PlanSampler(40, plan, rank, 8, seed=5)
        again.load_state_dict(state)
        again.set_epoch(3)  # the training loop's set_epoch of the current epoch keeps the loaded position
        assert taken + list(again) == want
        assert again.position == 5 == len(again)
        again.set_epoch(4)  # the next epoch starts at its first batch
        assert again.position == 0 and len(list(again)) == 5


def test_sampler_resumes_under_another_plan_with_the_unseen_samples():
    """Saved under 2 lanes with shares 3:1, resumed under 4 ranks (2 lanes x 2 stages, shares 1:1): every new
    rank yields what an uninterrupted sampler under the new plan yields from there, and the samples before and
    after the resume are the epoch's, each once."""
    old, new = _plan(2, shares=(3, 1)), _plan(4, layers=(1, 1), mb=2)
    before = [wh.PlanSampler(40, old, r, 8, seed=1) for r in range(2)]
    iters = [iter(s) for s in before]
    seen = [i for it in iters for _ in range(3) for i in next(it)]
    states = [s.state_dict() for s in before]
    assert states[0] == states[1] and states[0]["position"] == 3
    after = []
    for r in range(4):
        s = wh.PlanSampler(40, new, r, 8, seed=1)
        s.load_state_dict(states[0])
        after.append(list(s))
        assert after[-1] == list(wh.PlanSampler(40, new, r, 8, seed=1))[3:]
    stage0 = [r for r in range(4) if new.coords(r)[0] == 0]
    rest = [i for r in stage0 for batch in after[r] for i in batch]
    order = before[0].order()
    assert sorted(seen + rest) == sorted(order[:40]) and len(set(seen + rest)) == 40


def test_sampler_refuses_a_state_of_another_order():
    plan = _plan(2, shares=(1, 1))
    s = wh.PlanSampler(40, plan, 0, 8, seed=1)
    next(iter(s))
    state = s.state_dict()
    with pytest.raises(ValueError, match=r"^the sampler state has seed=1 but this PlanSampler has seed=2: the epoch's "
                                         r"order would differ; build the sampler with seed=1 to resume$"):
        wh.PlanSampler(40, plan, 0, 8, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^the sampler state has dataset_len=40 but this PlanSampler has "
                                         r"dataset_len=48"):
        wh.PlanSampler(48, plan, 0, 8, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"^the sampler state is 1 global batch\(es\) of 8 into epoch 0 but this "
                                         r"PlanSampler's global batch is 4: resume mid-epoch with global_batch=8 \(any "
                                         r"plan or world size works\), or change it at an epoch boundary$"):
        wh.PlanSampler(40, plan, 0, 4, seed=1).load_state_dict(state)
    boundary = {**state, "position": 0, "epoch": 2}
    other = wh.PlanSampler(40, plan, 0, 4, seed=1)
    other.load_state_dict(boundary)  # another global batch at an epoch boundary is fine
    assert other.epoch == 2 and len(list(other)) == 10


def test_loader_counts_delivered_batches_not_prefetched_ones():
    """A DataLoader worker draws indices ahead; the sampler's position is the batches the loader delivered, so a
    state saved mid-epoch resumes at the next undelivered batch (one worker process)."""
    plan, ds = _plan(2, shares=(1, 1)), _dataset(48)
    s = wh.PlanSampler(48, plan, 0, 8, seed=3)
    want = list(wh.PlanSampler(48, plan, 0, 8, seed=3))
    it = iter(s.loader(ds, num_workers=1, prefetch_factor=4))
    got = [next(it)[0].flatten().tolist() for _ in range(2)]
    state = s.state_dict()
    del it
    assert state["position"] == 2 and got == want[:2]
    plain = wh.PlanSampler(48, plan, 0, 8, seed=3)  # a DataLoader of its own: the sampler counts what it handed out
    it = iter(torch.utils.data.DataLoader(ds, batch_sampler=plain, num_workers=1, prefetch_factor=4))
    next(it), next(it)
    assert plain.position > 2
    del it
    again = wh.PlanSampler(48, plan, 0, 8, seed=3)
    again.load_state_dict(state)
    assert [x.flatten().tolist() for x, _ in again.loader(ds)] == want[2:]


def test_middle_stage_moves_its_position_with_the_others():
    plan = _plan(4, layers=(1, 1, 1, 1), mb=2)
    middle = wh.PlanSampler(16, plan, plan.rank_of(1, 0), 4)
    loader = middle.loader(_dataset(16))
    it = iter(loader)
    next(it)
    assert middle.state_dict()["position"] == 1
    resumed = wh.PlanSampler(16, plan, plan.rank_of(1, 0), 4)
    resumed.load_state_dict(middle.state_dict())
    assert list(resumed.loader(_dataset(16))) == [None] * 3


# --- examples/hf/train.py: flags, checkpoint and resume ------------------------------------------------------

def _hf_args(*extra: str) -> list[str]:
    """A tiny Llama (2 layers, width 16, GQA 2/1 heads) on 16-token windows, 4 sequences per step."""
    return ["--layers", "2", "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--vocab-size", "300",
            "--seq-len", "16", "--batch-size", "4", "--micro-batches", "2", "--eval-batches", "1", *extra]


@pytest.mark.parametrize("flag,value,message", [
    ("--eval-every", "-1", "argument --eval-every: must be an integer >= 0, got -1"),
    ("--eval-batches", "0", "argument --eval-batches: must be an integer >= 1, got 0"),
    ("--stages", "0", "argument --stages: must be an integer >= 1, got 0"),
    ("--micro-batches", "0", "argument --micro-batches: must be an integer >= 1, got 0"),
    ("--heads", "3", "--hidden 16 is not a multiple of --heads 3: pass --heads dividing it or --hidden a multiple "
                     "of 3"),
    ("--stages", "3", "--layers 2 is not a multiple of --stages 3; pass --stages dividing it or --layers a multiple "
                      "of 3"),
])
def test_hf_example_refuses_bad_int_flags_in_one_line(flag, value, message, capsys):
    """Every rank parses the flags: each prints the one line (no usage block) pointing to --help and exits 2
    before any process group (no processes)."""
    from examples.hf.train import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args(_hf_args(flag, value))
    assert exc.value.code == 2
    assert re.fullmatch(rf"error: ConfigError: {re.escape(message)} \(see \S+ --help\)\n", capsys.readouterr().err)
    assert parse_args(_hf_args("--eval-every", "0")).eval_every == 0  # 0: evaluate at the start and end only


@pytest.mark.parametrize("flag,value,low", [("--log-every", "0", 1), ("--eval-batches", "0", 1), ("--stages", "0", 1),
                                            ("--eval-every", "-1", 0), ("--micro-batches", "0", 1)])
def test_gpt_example_refuses_bad_int_flags_in_one_line(flag, value, low, capsys):
    """The GPT job's int flags have the HF example's lower bounds (``--log-every 0`` and ``--eval-batches 0``
    divided by zero): one line naming the flag, the limit and the value, exit 2 (no processes)."""
    from examples.gpt.train import parse_args

    with pytest.raises(SystemExit) as exc:
        parse_args([flag, value])
    assert exc.value.code == 2
    expected = f"argument {flag}: must be an integer >= {low}, got {value}"
    assert re.fullmatch(rf"error: ConfigError: {re.escape(expected)} \(see \S+ --help\)\n", capsys.readouterr().err)
    assert parse_args(["--eval-every", "0", "--ckpt-every", "0", "--sample-tokens", "0"]).eval_every == 0


def _hf_runs(rank, world, store, *argvs):
    """``examples/hf/train.py``'s ``run`` once per argv on this rank, each in a new gloo group (``run`` ends its
    group); rank 0's summaries."""
    import torch.distributed as dist

    from examples.hf.train import run

    out = []
    for i, argv in enumerate(argvs):
        if not dist.is_initialized():
            dist.init_process_group("gloo", init_method=f"file://{store}{i}", rank=rank, world_size=world)
        out.append(run(argv))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_hf_example_saves_resumes_and_continues_like_an_uninterrupted_run(tmp_path):
    """2 data-parallel ranks, 2 micro-batches, --eval-every 0: 4 steps in one go, and 2 steps stopped with a
    checkpoint then --resume to 4: the resumed run continues the same losses and held-out loss (one run of the
    tiny model takes ~1.2 s; a pipeline would add ~30 s of torch.export per rank on this host)."""
    import shutil
    from pathlib import Path

    from tests.distributed import run_ranks

    texts = tmp_path / "data" / "texts"
    texts.mkdir(parents=True)
    shutil.copy(Path(__file__).parent / "data" / "tempest_gut.txt", texts)
    (texts / ".complete").touch()
    common = _hf_args("--steps", "4", "--eval-every", "0", "--stages", "1", "--data-dir", str(tmp_path / "data"),
                      "--summary", str(tmp_path / "summary.json"))
    ckpt = ["--ckpt-dir", str(tmp_path / "ckpt")]
    whole, first, resumed = run_ranks(_hf_runs, 2, str(tmp_path / "store"), [*common, "--ckpt-dir", str(tmp_path)],
                                      [*common, *ckpt, "--stop-after", "2"], [*common, *ckpt, "--resume"],
                                      timeout=240)[0]
    assert first["steps"] == 2 and len(first["train_loss"]) == 2
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "step-00000004"
    assert resumed["resumed_from"] == 2 and resumed["steps"] == 4
    assert resumed["train_loss"][:2] == first["train_loss"]  # the history came back from the checkpoint
    torch.testing.assert_close(torch.tensor(resumed["train_loss"]), torch.tensor(whole["train_loss"]),
                               rtol=1e-5, atol=0)
    assert [s for s, _ in resumed["val_curve"]] == [0, 2, 4] and [s for s, _ in whole["val_curve"]] == [0, 4]
    torch.testing.assert_close(resumed["val_curve"][-1][1], whole["val_curve"][-1][1], rtol=1e-5, atol=0)


# --- whale simulate: calibration progress, plan, disagreement warning, timeline labels ------------------------

@pytest.mark.slow
def test_first_calibration_says_what_it_measures_before_and_during_the_engine_runs(tmp_path, monkeypatch, capsys):
    """The real engine calibration (one spawned process) on 4 tiny one-rank runs instead of 18 (and none of the
    split runs): a line naming the work, the runs and the estimate first, then one line per run with the time
    left."""
    from whale.calibration import engine as ce
    from whale.calibration.measure import calibration
    from whale.planner.calibration_cache import Calibration, machine_key, save

    path = tmp_path / "cal.json"
    save(Calibration(key=machine_key(), p2p_bandwidth=2e9, optimizer_seconds_per_element=1e-8), path)
    monkeypatch.setenv("WHALE_CALIBRATION", str(path))
    monkeypatch.setattr(ce, "SAMPLES", ((16, 1),))
    monkeypatch.setattr(ce, "MICRO_BATCHES", (1, 2))
    monkeypatch.setattr(ce, "SPLIT_MICRO_BATCHES", ())
    calib = calibration(comm=True, save=True)
    err = capsys.readouterr().err.splitlines()
    from whale.planner.calibration_cache import load

    assert calib.engine is not None and load(machine_key(), path).engine == calib.engine  # fitted, cached
    assert err[0] == (f"whale calibration: measuring this machine's engine fit, once (cached in {path}): 4 one-rank "
                      "and 0 two-rank engine runs of calibration models, about 2 min on 2 cores")
    runs = ["1 micro-batch(es), without waits", "2 micro-batch(es), without waits",
            "1 micro-batch(es), stretched 8x", "2 micro-batch(es), stretched 8x"]
    for i, (line, run) in enumerate(zip(err[1:], runs, strict=True)):
        assert re.fullmatch(rf"whale calibration: machine engine fit, one-rank run \[{i + 1}/4\] CalibrationNet "
                            rf"width 16 x 1 layers, {re.escape(run)}: \d+ s so far, about \d+ s left", line), line
    assert err[-1].endswith("about 0 s left") and len(err) == 5


V100_P100 = {"emulate": True, "nodes": [{"devices": ["V100-32GB", "P100-16GB"]}]}


def _two_stage_plan():
    """TinyLM cut in 2 stages on the emulated V100 + P100 (no profile: the plan counts the stages as equal work,
    the P100 stage 15.7/10.6 slower: busy 100% and 68%)."""
    from whale.cluster import ClusterSpec

    return wh.plan_model(TinyLM(stage_layers=(1, 1)), 2, wh.Config(cluster=ClusterSpec.from_dict(V100_P100)))


def test_simulate_warns_when_plan_and_simulation_disagree_on_busy_shares():
    """No processes: the plan's busy shares against a simulated prediction's, with the stated 10-point limit."""
    from whale.planner.steptime.simulate import Prediction
    from whale.simulate_cli import busy_disagreement, busy_shares

    plan = _two_stage_plan()
    assert [round(u, 4) for u in plan.predicted_utilization] == [0.6752, 1.0]
    pred = Prediction(step=1.0, schedule=0.9, stage_fwd=(0.1, 0.1), stage_bwd=(0.2, 0.2), rank_busy=(0.8, 0.4),
                      rank_idle=(0.2, 0.6))
    assert busy_shares(pred) == [1.0, 0.5]
    assert busy_disagreement(pred, plan, 2) == (
        "warning: the plan and the simulation disagree on the busy share (compute over the busiest rank's) by more "
        "than 10%: stage 0 rank(s) 0 (V100-32GB): plan 68%, simulation 100%; stage 1 rank(s) 1 (P100-16GB): plan "
        "100%, simulation 50%. Likely reason: the plan weighs every stage as equal work (the plan was made without a "
        "profile); the simulation uses this machine's calibrated seconds, with fixed costs per layer call and per "
        "segment that at 2 row(s) per micro-batch weigh most on the stages with the most layers; the plan's stage "
        "cut balances FLOPs, not these seconds")
    close = Prediction(step=1.0, schedule=0.9, stage_fwd=(0.1, 0.1), stage_bwd=(0.2, 0.2), rank_busy=(0.6, 0.85),
                       rank_idle=(0.4, 0.15))
    assert busy_disagreement(close, plan, 2) is None  # 71% vs 68%, 100% vs 100%: within 10 points


def test_timeline_rows_name_rank_device_stage_and_lane(tmp_path):
    from whale.planner.steptime.simulate import Prediction
    from whale.simulate_cli import plot_timeline, row_labels

    plan = _two_stage_plan()
    assert row_labels(plan, 2) == ["rank 0 · V100-32GB · stage 0 lane 0", "rank 1 · P100-16GB · stage 1 lane 0"]
    plain = wh.plan_model(TinyLM(stage_layers=(2,)), 2, wh.Config())
    assert row_labels(plain, 2) == ["rank 0 · stage 0 lane 0", "rank 1 · stage 0 lane 1"]
    pred = Prediction(step=1.0, schedule=0.9, stage_fwd=(0.1, 0.1), stage_bwd=(0.2, 0.2), rank_busy=(0.3, 0.3),
                      rank_idle=(0.7, 0.7), timeline=((0, "F", "F0", 0.0, 0.1), (1, "F", "F0", 0.1, 0.2),
                                                      (1, "B", "B0", 0.2, 0.4), (0, "B", "B0", 0.4, 0.6)))
    png = tmp_path / "t.png"
    assert plot_timeline(pred, str(png), plan=plan) == row_labels(plan, 2)
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_whale_simulate_prints_the_plan_before_the_prediction(tmp_path, monkeypatch, capsys):
    """The CLI on a seeded calibration (every unit type of the model timed, engine fits given: no processes,
    nothing measured): the plan's printout, exactly as whale plan gives it, then the prediction; no progress
    line (nothing is measured)."""
    from examples.gpt.model import for_plan
    from whale.cli import main
    from whale.frontend import hwplan
    from whale.frontend.unit_keys import unit_keys
    from whale.planner.calibration_cache import (
        MODEL_ENGINE_VERSION,
        Calibration,
        EngineTiming,
        UnitTiming,
        machine_key,
        model_signature,
        save,
    )

    kw = dict(n_layer=2, n_embd=16, n_head=2, vocab_size=64, seq_len=8, batch=4)
    model, batch, loss = for_plan(**kw)
    keys = unit_keys(model, batch, hwplan.profile(model, batch, loss_fn=loss), loss, tracked=True)
    units = {k: UnitTiming(1e-4, 2e-4, 1e-3, 2e-3) for k in keys.values()}
    path = tmp_path / "cal.json"
    save(Calibration(key=machine_key(), p2p_bandwidth=2e9, optimizer_seconds_per_element=1e-8, units=units,
                     engine=EngineTiming(),
                     model_engines={model_signature(keys): EngineTiming(version=MODEL_ENGINE_VERSION)}), path)
    monkeypatch.setenv("WHALE_CALIBRATION", str(path))
    args = ["--model", "examples.gpt.model:for_plan", "--world", "2", "--micro-batches", "2", "--cluster",
            "examples/clusters/v100_p100_2.yaml", "--args", *[f"{k}={v}" for k, v in kw.items()]]
    assert main(["plan", *args]) == 0
    plan_text = capsys.readouterr().out.split("\nschedule (per stage):")[0]
    png = tmp_path / "t.png"
    assert main(["simulate", *args, "--png", str(png), "--cores", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(plan_text + "\n\nEMULATED cluster") and err == ""
    assert "\n rank  device           busy s   idle s  idle %  busy*  peak MB\n" in out
    assert out.rstrip().endswith(f"timeline written to {png}")
    # the seeded units cost alike (1 ms + 2 ms fixed per call): the P100 stage runs 4 units (tok_emb, pos_emb,
    # drop, blocks.0, as the cut lists them), the V100 stage 4 with the loss; the plan's FLOPs see blocks alone
    assert ("\nwarning: the plan and the simulation disagree on the busy share (compute over the busiest rank's) "
            "by more than 10%: stage 1 rank(s) 0 (V100-32GB): plan 88%, simulation 68%. Likely reason: the plan "
            "weighs each stage's FLOPs at its devices' peak FLOP/s, linear in the rows;") in out


def test_simulated_stages_hold_the_units_the_cut_gave_them():
    """A unit without parameters (the GPT's dropout after the embeddings) is simulated on the stage the cut put
    it in, not on the last stage (no processes)."""
    from examples.gpt.model import for_plan
    from whale.cluster import ClusterSpec
    from whale.frontend import hwplan
    from whale.frontend.simcost import stage_units

    model, batch, loss = for_plan(n_layer=2, n_embd=16, n_head=2, vocab_size=64, seq_len=8, batch=4)
    plan = wh.plan_model(model, 2, wh.Config(num_micro_batch=2, cluster=ClusterSpec.from_dict(V100_P100)),
                         sample_batch=batch, loss_fn=loss)
    units = [[u.name for u in us] for us in stage_units(hwplan.profile(model, batch, loss_fn=loss), plan, model)]
    assert [list(c.units) for c in plan.stage_cuts] == [["tok_emb", "pos_emb", "drop", "blocks.0"],
                                                        ["blocks.1", "ln_f", "lm_head"]]
    assert units == [["tok_emb", "pos_emb", "drop", "blocks.0"], ["blocks.1", "ln_f", "lm_head", "<rest>"]]
