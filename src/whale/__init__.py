"""Whale for PyTorch: hybrid data / operator-sharded / pipeline parallel training from two annotations.

Public API::

    import whale as wh
    ctx = wh.init(wh.Config(num_micro_batch=4))
    with wh.replicate(1):
        ...build the first stage's modules...
    engine = wh.parallelize(model, loss_fn=..., optimizer=lambda ps: torch.optim.AdamW(ps))
    metrics = engine.step((inputs, targets))
"""

from whale.annotation import AnnotationError, annotate, replicate, set_default_strategy, split
from whale.config import Config, ConfigError
from whale.parallel.bridge import ShardedLogits, accuracy, cross_entropy
from whale.parallel.schedule import ScheduleError, make_schedule
from whale.parallel.split import SplitError, register_split_rule
from whale.parallel.stages import StageError
from whale.plan.plan import Plan, PlanError
from whale.runtime.context import Context, init
from whale.runtime.engine import Engine
from whale.runtime.parallelize import parallelize, plan_model

__all__ = [
    "AnnotationError", "Config", "ConfigError", "Context", "Engine", "Plan", "PlanError", "ScheduleError",
    "ShardedLogits", "SplitError", "StageError", "accuracy", "annotate", "cross_entropy", "init", "make_schedule",
    "parallelize", "plan_model", "register_split_rule", "replicate", "set_default_strategy", "split",
]
__version__ = "0.1.0"
