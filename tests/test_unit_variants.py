"""Unit types timed as a plan runs them: under CPU autocast (bf16) and under the checkpoint wrapper."""

import torch
from torch import nn

from whale.calibration.units import calibrate_units
from whale.frontend.hwplan import profile
from whale.frontend.simcost import stage_costs
from whale.frontend.unit_keys import variant_keys
from whale.plan.plan import Plan, TaskGraph


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_variant_keys_mark_precision_and_checkpointed_units_only():
    keys = {"layers.0": "L|1", "layers.1": "L|1", "<rest>": "loss"}
    got = variant_keys(keys, "bf16", ("layers.1",))
    assert got == {"layers.0": "L|1|bf16", "layers.1": "L|1|bf16|ckpt", "<rest>": "loss"}
    assert variant_keys(keys) == keys


def test_units_timed_under_autocast_and_checkpoint_get_their_own_keys_and_costs():
    torch.manual_seed(0)
    model, x = Net(), torch.randn(16, 64)
    batch = (x, x)
    loss = nn.MSELoss()
    plain, keys = calibrate_units(model, batch, loss, repeats=3)
    ck, ck_keys = calibrate_units(model, batch, loss, repeats=3, known=plain, precision="bf16",
                                  checkpointed=("layers.0",))
    assert ck_keys["layers.0.0"].endswith("|bf16|ckpt") and ck_keys["layers.1.0"].endswith("Linear|4160|((64,),)|bf16")
    assert set(ck) == {k for n, k in ck_keys.items() if n != "<rest>"}  # the loss's fp32 timing is kept, not re-timed
    t_plain, t_ck = plain[keys["layers.0.0"]], ck[ck_keys["layers.0.0"]]
    # the checkpointed unit's backward holds its recompute: more than its plain backward
    assert t_ck.bwd_overhead + 16 * t_ck.bwd_per_row > t_plain.bwd_overhead + 16 * t_plain.bwd_per_row

    from whale.planner.calibration_cache import Calibration

    calib = Calibration(units={**plain, **ck})
    prof = profile(model, batch, loss_fn=loss)
    plan = Plan(world_size=1, task_graphs=(TaskGraph(0, "replicate", 1),), num_replicas=1, num_micro_batch=1,
                precision="bf16", activation_checkpoint=("layers.0",))
    (st,) = stage_costs(prof, plan, model, keys, calib)
    want = sum(calib.units[k].bwd_per_row for n, k in variant_keys(keys, "bf16", ("layers.0",)).items())
    assert abs(st.bwd_per_row - want) < 1e-12
    assert st.recompute_per_row == 0.0  # layers.0's recompute is in its checkpointed timing already
