"""``whale plan``: print (or write as JSON) the plan Whale would run a model with, without any process.

The model comes from a factory ``package.module:function`` that returns a model, ``(model, sample_batch)`` or
``(model, sample_batch, loss_fn)`` so that the planner can profile it, the loss too (memory-aware shares and
techniques, speed-balanced pipeline cuts on a mixed cluster).
``key=value`` arguments after ``--args`` are passed to the factory (ints and floats are converted; a value
that does not match the parameter's annotation or default type is refused naming the argument and the type).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import sys

from whale.config import FORBIDDEN, Config
from whale.frontend.planning import plan_model
from whale.plan.plan import OFFLOADS
from whale.plan.schedule import RUNNABLE_SCHEDULES, format_schedule
from whale.plan.schedule_chunks import schedule_for
from whale.planner.desc_cli import add_desc_args, check_virtual_flags, desc_only_flags, run_desc

SCHEDULE_ALIASES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved": "Interleaved1F1B", "zb": "ZB-H1"}
"""The GPT job's ``--schedule`` names (``examples/gpt/pipeline_flags.py``) -> Whale's schedule names; ``--schedule``
takes these and the names of :data:`RUNNABLE_SCHEDULES`, in any case."""
_SCHEDULES = {**{s.lower(): s for s in RUNNABLE_SCHEDULES}, **SCHEDULE_ALIASES}


def schedule_name(text: str) -> str:
    """``--schedule``'s value as a :data:`RUNNABLE_SCHEDULES` name (:data:`SCHEDULE_ALIASES`, any case)."""
    name = _SCHEDULES.get(text.lower())
    if name is None:
        raise argparse.ArgumentTypeError(f"unknown schedule {text!r}; choose one of {', '.join(RUNNABLE_SCHEDULES)} "
                                         "or gpipe, 1f1b, interleaved, zb (any case)")
    return name


def input_error(ns: argparse.Namespace) -> str | None:
    """The one-line error when ``ns`` names no model or two (``--model`` and ``--model-desc``), else ``None``."""
    if ns.model and ns.model_desc:
        return f"give --model {ns.model} or --model-desc {ns.model_desc}, not both"
    if not ns.model and not ns.model_desc:
        return "give --model MODULE:FACTORY or --model-desc gpt:..."
    return None


def _value(text: str):
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def _expected(param: inspect.Parameter) -> type | None:
    """The type a factory parameter takes: its annotation (int, float, bool or str, also as a string) or,
    without one, its default's type; ``None`` when neither says."""
    ann = param.annotation
    ann = _TYPES.get(ann, None) if isinstance(ann, str) else ann
    if ann in _TYPES.values():
        return ann
    default = param.default
    return type(default) if default is not inspect.Parameter.empty and type(default) in _TYPES.values() else None


def factory_kwargs(factory, pairs: list[list[str]], spec: str) -> dict:
    """``--args`` KEY=VALUE pairs as the factory's keyword arguments: ints and floats converted, each checked
    against the parameter's annotation or default type.

    Raises:
        ValueError: one line naming the argument, the value, the type it expects (and the factory's
            parameters for an unknown name).
    """
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    open_kwargs = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    out = {}
    for key, text in pairs:
        value = _value(text)
        if params and key not in params and not open_kwargs:
            raise ValueError(f"--args {key}={text}: {spec} takes no argument {key!r}; it takes "
                             f"{', '.join(params) or 'none'}")
        want = _expected(params[key]) if key in params else None
        if want is bool and text.lower() in ("true", "false", "1", "0"):
            value = text.lower() in ("true", "1")
        elif want is float and isinstance(value, int):
            value = float(value)
        elif want is str:
            value = text
        if want is not None and not isinstance(value, want):
            raise ValueError(f"--args {key}={text}: {key} takes {_EXAMPLE[want][0]} (e.g. {key}={_EXAMPLE[want][1]}),"
                             f" got {text!r}")
        out[key] = value
    return out


_EXAMPLE = {int: ("an int", "4"), float: ("a float", "0.1"), bool: ("a bool", "true"), str: ("a string", "name")}


def load_factory(spec: str):
    """Import ``package.module:function``; a clear ``SystemExit`` message when it is not there."""
    module, _, name = spec.partition(":")
    if not name:
        raise SystemExit(f"whale plan: --model must look like package.module:function, got {spec!r}")
    sys.path.insert(0, "")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"whale plan: cannot load {spec!r}: {exc}") from None


def check_flags(ns: argparse.Namespace) -> None:
    """Refuse what a ``--model`` run would otherwise ignore or change: described-model flags and a bad
    ``--virtual-stages``.

    Raises:
        ValueError: one line naming the flags or the value, and the fix.
    """
    given = desc_only_flags(ns)
    if given:
        raise ValueError(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --model-desc only (a "
                         f"described model); --model {ns.model} plans the model's own wh.stage / wh.split scopes "
                         "(--auto searches stages and data parallelism): drop "
                         f"{'it' if len(given) == 1 else 'them'} or describe the model with --model-desc gpt:...")
    check_virtual_flags(ns)


def _make_plan(ns: argparse.Namespace):
    check_flags(ns)
    pairs = [kv.split("=", 1) for kv in ns.args]
    if any(len(p) != 2 for p in pairs):
        raise ValueError(f"--args takes KEY=VALUE pairs, got {ns.args}")
    factory = load_factory(ns.model)
    made = factory(**factory_kwargs(factory, pairs, ns.model))
    model, sample, loss = (tuple(made) + (None, None))[:3] if isinstance(made, tuple) else (made, None, None)
    forbid = FORBIDDEN if ns.forbid == "all" else tuple(f for f in ns.forbid.split(",") if f)
    schedule, v = ns.schedule, ns.virtual_stages  # as given, checked by check_flags
    if schedule is None:
        schedule = "Interleaved1F1B" if v is not None and v > 1 else "1F1B"
    if v is None:
        v = 2 if schedule == "Interleaved1F1B" else 1  # 2 chunks per stage, as the GPT job's default
    config = Config(num_micro_batch=ns.micro_batches, schedule=schedule, cluster=ns.cluster,
                    virtual_stages=v, hardware_aware=not ns.no_hardware_aware,
                    precision=ns.precision, offload=ns.offload, zero=ns.zero, forbid=forbid, auto=ns.auto)
    return plan_model(model, ns.world, config, sample_batch=sample, loss_fn=loss)


def add_plan(sub: argparse._SubParsersAction) -> None:
    """Register ``whale plan``."""
    p = sub.add_parser("plan", help="print the plan for a model on a world size / cluster (no processes)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", metavar="MODULE:FACTORY",
                   help="factory returning a model, (model, sample_batch) or (model, sample_batch, loss_fn), "
                        "e.g. examples.gpt.model:for_plan")
    p.add_argument("--world", type=int, required=True, help="number of ranks")
    p.add_argument("--cluster", help="cluster spec YAML (makes the plan hardware-aware)")
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--schedule", type=schedule_name, metavar="{GPipe,1F1B,Interleaved1F1B,ZB-H1}",
                   help="pipeline schedule, also as the GPT job names them: gpipe, 1f1b, interleaved, zb (any case; "
                        "default 1F1B, Interleaved1F1B with --virtual-stages >= 2; with --model-desc: searched "
                        "among 1F1B, ZB-H1, interleaved)")
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16", "fp16"),
                   help="autocast dtype of the forward (fp16: with dynamic loss scaling)")
    p.add_argument("--offload", default="none", choices=OFFLOADS,
                   help="optimizer state (and parameters) in host memory, the optimizer step on the host")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage (the planner may raise it)")
    p.add_argument("--forbid", default="", metavar="NAMES",
                   help="memory techniques the planner must not add (comma list of activation_checkpoint, zero, "
                        "zero3, offload, offload_params; 'all')")
    p.add_argument("--no-hardware-aware", action="store_true")
    p.add_argument("--auto", action="store_true",
                   help="search stage count and cut, data-parallel degree, micro-batches, schedule and memory "
                        "techniques (needs a factory returning a sample batch); prints the runner-ups")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    p.add_argument("--out", metavar="PLAN.json",
                   help="also write the plan as JSON (train from it: wh.parallelize(..., plan=Plan.from_json(text)))")
    p.add_argument("--args", nargs="*", default=[], metavar="KEY=VALUE", help="keyword arguments for the factory")
    add_desc_args(p)
    p.set_defaults(func=run_plan)


def run_plan(ns: argparse.Namespace) -> int:
    """Build the model, plan it, print it; a bad input prints one line and returns 2."""
    error = input_error(ns)
    if error:
        print(f"whale plan: error: {error}", file=sys.stderr)
        return 2
    if ns.model_desc:
        return run_desc(ns)
    try:
        plan = _make_plan(ns)
    except (ValueError, TypeError) as exc:
        print(f"whale plan: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(plan.to_json(indent=2) if ns.json else plan)
    if not ns.json and plan.is_pipeline:
        print("schedule (per stage):")
        print(format_schedule(schedule_for(plan.schedule, plan.num_stages, plan.num_micro_batch, plan.virtual_stages,
                                           plan.chunk_positions)))
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(plan.to_json(indent=2) + "\n")
        if not ns.json:
            print(f"plan written to {ns.out}")
    return 0
