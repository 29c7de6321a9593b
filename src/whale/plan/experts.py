"""Hardware-aware expert placement for expert parallelism (an MoE layer under ``split``): how many of the E
experts each device of a split group holds.

Each expert costs its device the same work per token it receives; with tokens spread evenly over experts (what
the load-balancing loss drives routing towards), device i's expert time is ``c_i / speed_i`` for ``c_i`` experts.
:func:`expert_counts` gives whole counts minimizing the slowest device, ``max_i c_i / speed_i``, exactly, with
every device holding at least one expert (experts are not replicated) and, with memory given, each within its
memory: ``mem_fixed_i + c_i * bytes_per_expert <= mem_capacity_i``. It is Whale's one apportionment
(:func:`whale.plan.balance.min_max_shares`, exact for this min-max), so the counts equal the shard sizes the
runtime cuts the stacked expert tensors into (:func:`whale.parallel.split_ops.shard_sizes` of the plan's shard
weights) -- the plan stores the weights, and printing and running derive the same counts from them.

Source: the Whale paper's intra-TaskGraph balancing (Jia et al., USENIX ATC 2022, §3.3) applied to experts as
the units of a split; experts as the unit of expert parallelism as in GShard (Lepikhin et al. 2020).
"""

from __future__ import annotations

from whale.plan.balance import _balance, whole_shares
from whale.plan.plan import PlanError

__all__ = ["expert_counts", "ExpertPlacementError"]


class ExpertPlacementError(PlanError):
    """The experts cannot be placed on the devices (more devices than experts)."""


def expert_counts(num_experts: int, speeds: list[float] | tuple[float, ...],
                  mem_capacity: list[float] | None = None, mem_fixed: list[float] | None = None,
                  bytes_per_expert: float = 0.0) -> list[int]:
    """Experts per device of a split group, minimizing ``max_i counts_i / speeds_i`` exactly (module docstring).

    Args:
        num_experts: E, the experts of the layer.
        speeds: relative speed of each device of the group (FLOP/s or the plan's shard weights; > 0).
        mem_capacity: bytes each device may use (``None``: memory not limiting).
        mem_fixed: bytes each device needs whatever its experts (default 0).
        bytes_per_expert: bytes one expert adds (its parameters, gradients and optimizer state).

    Returns:
        Whole counts, each >= 1, adding up to ``num_experts``, in device order.

    Raises:
        ExpertPlacementError: more devices than experts (naming both and the fix).
        InfeasiblePlanError: the experts do not fit the devices' memory (naming the device and bytes).
        ValueError: bad speeds or memory values.
    """
    n = len(speeds)
    if n > num_experts:
        raise ExpertPlacementError(
            f"cannot place {num_experts} experts on {n} devices: expert parallelism puts at least one whole "
            f"expert on each device; use at most {num_experts} devices for the split (nest it in a "
            f"replicate({num_experts}) so that nested data parallelism copies the group), or more experts")
    if mem_capacity is None:
        return whole_shares(num_experts, list(speeds), min_share=1)
    fixed = [0.0] * n if mem_fixed is None else list(mem_fixed)
    return _balance(num_experts, [float(s) for s in speeds], list(mem_capacity), fixed, float(bytes_per_expert), 1,
                    "expert")
