"""The seconds the memory techniques add to a step, and the step-time measure the memory planner compares
options with (:func:`whale.planner.memory.choose_memory_options`); pure functions of plain data.

Step time per option (seconds on the slowest rank, :func:`step_seconds`; compared, not predicted to the
millisecond): each rank's rows x its stage's training FLOPs at its device's speed (the lane shares are those
each option's placement gives: a device relieved of memory may take its full speed share again);
recomputation costs the checkpointed layers' forward FLOPs again at the device's speed; ZeRO-1 adds one
broadcast of the parameters (``4E`` bytes over the lanes' link); ZeRO-2 none (reduce-scatter + broadcast
replace the all-reduce); ZeRO-3 one more all-gather (``4E``) in backward; offload moves gradients
down and parameters up over PCIe (``8fE`` bytes; parameters offloaded: ``8E`` more per step) and steps Adam
on the host (``32 fE`` bytes of host memory traffic).

The per-rank memory these options hold is :mod:`whale.planner.memory`'s; both take their inputs
(:class:`~whale.planner.memory_types.StageMemory`, :class:`~whale.planner.memory_types.MemoryOptions`) from
:mod:`whale.planner.memory_types`, so neither imports the other.
"""

from __future__ import annotations

from whale.plan.plan import Plan
from whale.planner.memory_types import MemoryOptions, StageMemory
from whale.planner.zero import zero_shard_weights

PCIE_BANDWIDTH = 16e9  # bytes/s, PCIe 3.0 x16: device <-> host
HOST_MEMORY_BANDWIDTH = 50e9  # bytes/s, host DRAM, for the host optimizer step


def step_seconds(plan: Plan, stages: list[StageMemory], global_batch: int, options: MemoryOptions,
                 speeds: list[float], lane_bandwidth: float) -> float:
    """Seconds per step of the slowest rank: its rows' compute (``train_flops``) at its device's speed plus what
    ``options`` add (see the module docstring). A measure to compare options and the lane shares their
    placements give, not the full step-time model (no pipeline bubbles or overlap). A lane's share of the
    sharded state is its fraction of the plan's ZeRO weights (the whole elements the runtime cuts differ by at
    most a few elements).

    Args:
        speeds: FLOP/s per rank; lane_bandwidth: bytes/s of the links between a stage's lanes.
    """
    worst = 0.0
    for s, st in enumerate(stages):
        lanes = plan.lanes_of(s)
        weights = zero_shard_weights(plan, s)
        shares = [w / sum(weights) for w in weights]
        for lane, ranges in enumerate(plan.micro_batch_rows(global_batch, s)):
            rows = sum(b - a for a, b in ranges)
            flops = st.train_flops + (st.recompute_flops if options.activation_checkpoint else 0.0)
            t = rows * flops / speeds[plan.rank_of(s, lane)]
            t += technique_seconds(st.trainable_elements, shares[lane], lanes, options, lane_bandwidth)
            worst = max(worst, t)
    return worst


def technique_seconds(elements: float, share: float, lanes: int, options: MemoryOptions,
                      lane_bandwidth: float) -> float:
    """Seconds per step one rank spends on what ``options`` add beyond compute and recomputation (the module
    docstring's rules): ZeRO-1 and ZeRO-3 one ring pass of the stage's ``4 * elements`` bytes over its
    ``lanes`` (``lane_bandwidth`` bytes/s), offload ``8 f E`` bytes over PCIe plus ``32 f E`` bytes of host
    memory traffic (``f = share`` of the sharded state under ZeRO, else 1), and ``8 E`` more over PCIe when the
    parameters are offloaded too (under ZeRO-3 each unit's shard is fetched for forward and backward and its
    gradient shard comes back: ``12 f E``)."""
    ring = 4 * elements * (lanes - 1) / lanes / lane_bandwidth if lanes > 1 else 0.0
    t = {0: 0.0, 1: ring, 2: 0.0, 3: ring}[options.zero]
    f = share if options.zero else 1.0
    if options.offload != "none":
        t += 8 * f * elements / PCIE_BANDWIDTH + 32 * f * elements / HOST_MEMORY_BANDWIDTH
    if options.offload == "optimizer+params":
        t += (12 * f if options.zero == 3 else 8) * elements / PCIE_BANDWIDTH
    return t
