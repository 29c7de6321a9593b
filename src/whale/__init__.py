"""Whale for PyTorch: hybrid data / operator-sharded / pipeline parallel training from two annotations.

Public API::

    import whale as wh
    ctx = wh.init(wh.Config(num_micro_batch=4))
    with wh.replicate(1):
        ...build the first stage's modules...
    engine = wh.parallelize(model, loss_fn=..., optimizer=lambda ps: torch.optim.AdamW(ps))
    metrics = engine.step((inputs, targets))

Planning names (annotations, ``Config``, ``Plan``, ``plan_model``) load eagerly; the runtime's names (``init``,
``parallelize``, ``Engine``, the split losses) load on first use, so that making or printing a plan never
imports :mod:`whale.runtime` or :mod:`whale.parallel`.
"""

from __future__ import annotations

import importlib

from whale.annotation import AnnotationError, annotate, replicate, set_default_strategy, split
from whale.config import Config, ConfigError, LossScale
from whale.frontend import plan_model
from whale.frontend.graph import StageError
from whale.loss import SumOverCount, token_cross_entropy
from whale.moe import MoE, moe_aux_loss
from whale.plan.plan import Plan, PlanError
from whale.plan.schedule import ScheduleError, make_schedule
from whale.splitrules import SplitError, register_split_rule

_LAZY = {
    "Context": "whale.runtime.context", "init": "whale.runtime.context", "Engine": "whale.runtime.engine",
    "parallelize": "whale.runtime.parallelize", "ShardedLogits": "whale.parallel.bridge",
    "accuracy": "whale.parallel.bridge", "cross_entropy": "whale.parallel.bridge",
    "BatchError": "whale.runtime.batch", "OptimizerError": "whale.runtime.optim",
    "PlanSampler": "whale.runtime.sampler", "local_rows": "whale.runtime.sampler",
    "memory_table": "whale.memory.monitor", "EmulatedOutOfMemoryError": "whale.memory.monitor",
    "CheckpointError": "whale.runtime.ckpt_store", "latest_checkpoint": "whale.runtime.ckpt_store",
    "claim_checkpoint_dir": "whale.runtime.ckpt_runs",
    "NonFiniteError": "whale.runtime.nonfinite", "LossShapeError": "whale.runtime.nonfinite",
    "report_error": "whale.runtime.failures", "write_step_trace": "whale.runtime.trace",
}

__all__ = [
    "AnnotationError", "BatchError", "CheckpointError", "Config", "ConfigError", "Context",
    "EmulatedOutOfMemoryError", "Engine", "LossScale", "LossShapeError", "MoE", "NonFiniteError", "OptimizerError",
    "Plan", "PlanError", "PlanSampler",
    "ScheduleError", "ShardedLogits", "SplitError", "StageError", "SumOverCount", "accuracy", "annotate",
    "claim_checkpoint_dir",
    "cross_entropy", "init", "latest_checkpoint", "local_rows", "make_schedule", "memory_table", "moe_aux_loss",
    "parallelize", "plan_model", "register_split_rule", "replicate", "report_error", "set_default_strategy",
    "split", "token_cross_entropy", "write_step_trace",
]
__version__ = "0.1.0"


_SUBPACKAGES = ("runtime", "parallel")


def __getattr__(name: str):
    """Load a runtime name (or the ``whale.runtime`` / ``whale.parallel`` package) on first use (PEP 562)."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBPACKAGES:
        value = importlib.import_module(f"whale.{name}")
    else:
        raise AttributeError(f"module 'whale' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
