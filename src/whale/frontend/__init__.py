"""The planning front end: model + annotations + cluster -> :class:`~whale.plan.plan.Plan`.

Imports nothing from :mod:`whale.parallel` or :mod:`whale.runtime`. :func:`plan_model` is the entry point;
:mod:`whale.frontend.graph` holds the ``torch.fx`` mechanics the runtime reuses to rebuild a stage from a plan.
"""

from whale.frontend.planning import plan_model, plan_with_stages, resolve_cluster

__all__ = ["plan_model", "plan_with_stages", "resolve_cluster"]
