"""A valid 3+1-width pipeline that trains and then simply ends (benchmarks/exit_teardown.py).

Usage: ``whale launch -n 4 benchmarks/_width_exit_job.py``. Stage 0 has 3 data-parallel lanes, stage 1 one
(``tests/models.py::TinyLM`` with ``stage_widths=(3, 1)``, as tests/test_widths.py's WidthLM); 3 training steps, an
evaluation at another batch size, the gathered state dict, then the script ends without
``destroy_process_group`` (Whale's context tears the groups down at exit). Prints one line per rank.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import whale as wh  # noqa: E402
from tests.models import TinyLM, lm_batches, lm_loss  # noqa: E402

ctx = wh.init(wh.Config(num_micro_batch=2, seed=0))
engine = wh.parallelize(TinyLM(stage_layers=(1, 1), stage_widths=(3, 1)), lm_loss,
                        lambda ps: torch.optim.AdamW(ps, lr=1e-3), ctx=ctx)
for b in lm_batches(3, 6):
    m = engine.step(b)
ev = engine.eval_step(lm_batches(1, 12, seed=9)[0])
full = engine.full_state_dict()  # the last collective: gather_object to rank 0
print(f"rank {ctx.rank} stage {engine.stage} lane {engine.lane}: loss {m['loss']:.4f} eval {ev['loss']:.4f}",
      flush=True)
