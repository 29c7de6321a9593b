"""``whale plan`` / ``whale simulate`` flags that used to be silently ignored or rewritten (no processes; the CLI
runs through :func:`whale.cli.main` in this process): described-model flags given with ``--model`` are refused,
``--virtual-stages`` is checked as given, ``--schedule`` takes the GPT job's names, and forced stages x chunks
above the layer count are named before any search."""

from __future__ import annotations

import json
import re

import pytest

from whale.cli import build_parser, main
from whale.planner.desc_cli import DESC_ONLY

MODEL = ["--model", "examples.gpt.model:for_plan", "--world", "2", "--micro-batches", "2"]
TINY = ["--args", "n_layer=4", "n_embd=16", "n_head=2", "vocab_size=64", "seq_len=8", "batch=4", "stages=4"]
DESC = ["--model-desc", "gpt:layers=8,hidden=1024,heads=16", "--world", "8"]
GIVEN = {"--batch": "8", "--dp": "2", "--pp": "2", "--split": "2", "--sequence-parallel": "off", "--recompute": None,
         "--cross-nodes": None, "--device": "V100-32GB", "--gpus-per-node": "4", "--intra-bandwidth": "1e9",
         "--inter-bandwidth": "1e9", "--gemm-efficiency": "0.5"}
"""One value for each described-model flag that a --model run cannot use (None: a switch)."""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err.strip()


def test_every_described_model_flag_but_two_is_listed_as_desc_only():
    """A flag added to the group later must be refused with --model too (or honoured and exempted here)."""
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    group = next(g for g in plan._action_groups if g.title.startswith("described model"))
    flags = {a.option_strings[0] for a in group._group_actions} - {"--model-desc", "--virtual-stages"}
    assert flags == set(GIVEN) == {f"--{k.replace('_', '-')}" for k in DESC_ONLY}


@pytest.mark.parametrize("tool", ["plan", "simulate"])
def test_split_and_sequence_parallel_with_model_are_refused_not_ignored(capsys, tool):
    rc, out, err = run(capsys, tool, *MODEL, "--split", "2", "--sequence-parallel", "on", *TINY)
    assert rc == 2 and out == ""
    assert re.fullmatch(rf"whale {tool}: error: ValueError: --split, --sequence-parallel apply to --model-desc only "
                        r"\(a described model\); --model examples\.gpt\.model:for_plan plans the model's own "
                        r"wh\.stage / wh\.split scopes \(--auto searches stages and data parallelism\): drop them "
                        r"or describe the model with --model-desc gpt:\.\.\.", err), err


@pytest.mark.parametrize("flag", sorted(GIVEN))
def test_each_desc_only_flag_is_refused_with_model(capsys, flag):
    value = [] if GIVEN[flag] is None else [GIVEN[flag]]
    rc, _, err = run(capsys, "plan", *MODEL, flag, *value)
    assert rc == 2 and f"error: ValueError: {flag} applies to --model-desc only" in err and "drop it" in err


def test_desc_flags_keep_their_defaults_and_take_values_with_model_desc(capsys):
    rc, out, _ = run(capsys, "plan", *DESC, "--json")
    assert rc == 0 and json.loads(out)["capacity_bytes"] == 80e9  # A100-80GB without --device
    rc, out, _ = run(capsys, "plan", *DESC, "--device", "V100-32GB", "--gpus-per-node", "4", "--json")
    assert rc == 0 and json.loads(out)["capacity_bytes"] == 32e9


def test_model_and_model_desc_together_are_refused(capsys):
    rc, _, err = run(capsys, "simulate", *MODEL, "--model-desc", "gpt:layers=8,hidden=1024,heads=16")
    assert rc == 2 and err == ("whale simulate: error: give --model examples.gpt.model:for_plan or --model-desc "
                               "gpt:layers=8,hidden=1024,heads=16, not both")


@pytest.mark.parametrize("source", [MODEL + TINY, DESC])
def test_virtual_stages_zero_is_named_as_given(capsys, source):
    rc, _, err = run(capsys, "plan", *source, "--schedule", "Interleaved1F1B", "--virtual-stages", "0")
    assert rc == 2 and err.endswith("ValueError: --virtual-stages 0: interleaved 1F1B needs >= 2 chunks per stage "
                                    "(1: not interleaved); use --virtual-stages 2 or more, or leave it out"), err
    rc, _, err = run(capsys, "plan", *source, "--schedule", "interleaved", "--virtual-stages", "1")
    assert rc == 2 and "--virtual-stages 1 with --schedule Interleaved1F1B: interleaved needs >= 2 chunks" in err
    rc, _, err = run(capsys, "plan", *source, "--schedule", "zb", "--virtual-stages", "2")
    assert rc == 2 and "--virtual-stages 2 needs --schedule Interleaved1F1B (or interleaved), got --schedule ZB-H1" \
        in err


@pytest.mark.parametrize(("text", "name"), [
    ("gpipe", "GPipe"), ("1F1B", "1F1B"), ("Interleaved", "Interleaved1F1B"), ("ZB", "ZB-H1"), ("zb-h1", "ZB-H1"),
    ("Interleaved1F1B", "Interleaved1F1B")])
def test_schedule_takes_the_gpt_jobs_names_in_any_case(text, name):
    for tool in ("plan", "simulate"):
        assert build_parser().parse_args([tool, "--world", "2", "--schedule", text]).schedule == name


def test_an_unknown_schedule_lists_both_spellings(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["plan", "--world", "2", "--schedule", "looped"])
    assert e.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1] == (
        "whale plan: error: argument --schedule: unknown schedule 'looped'; choose one of 1F1B, GPipe, "
        "Interleaved1F1B, ZB-H1 or gpipe, 1f1b, interleaved, zb (any case)")


def test_interleaved_alias_plans_two_chunks_per_stage_as_the_gpt_job(capsys):
    rc, out, _ = run(capsys, "plan", *MODEL, "--schedule", "interleaved", "--json", *TINY)
    plan = json.loads(out)
    assert rc == 0 and (plan["schedule"], plan["virtual_stages"]) == ("Interleaved1F1B", 2)
    rc, out, _ = run(capsys, "plan", *MODEL, "--virtual-stages", "2", "--json", *TINY)  # chunks imply interleaved
    assert rc == 0 and json.loads(out)["virtual_stages"] == 2
    rc, out, _ = run(capsys, "plan", *DESC, "--pp", "2", "--schedule", "ZB", "--json")
    assert rc == 0 and "ZB-H1" in json.loads(out)["plan"]


def test_forced_stages_times_chunks_above_the_layers_are_named_before_the_search(capsys):
    rc, _, err = run(capsys, "simulate", *DESC, "--pp", "4", "--virtual-stages", "3", "--png", "")
    assert rc == 2 and err == ("whale simulate: error: ValueError: interleaved 1F1B with virtual=3: 4 stages x 3 "
                               "chunks = 12 chunks > layers=8 (each chunk holds >= 1 layer); legal chunk counts "
                               "here: [2] (or use 1F1B)")
    rc, out, _ = run(capsys, "simulate", *DESC, "--pp", "4", "--virtual-stages", "2", "--png", "", "--json")
    assert rc == 0 and "Interleaved1F1B v 2" in json.loads(out)["plan"]


def test_help_shows_the_described_defaults():
    plan = build_parser()._subparsers._group_actions[0].choices["plan"]
    text = " ".join(plan.format_help().split())
    assert "(default A100-80GB)" in text and "also as the GPT job names them: gpipe, 1f1b, interleaved, zb" in text
