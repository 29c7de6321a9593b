"""The engine's state: its shard as a state dict, the whole model on rank 0, checkpoint save and load.

A mixin of :class:`whale.runtime.engine.Engine` (as :class:`whale.runtime.update.GradientUpdate` is), kept apart so
the step's orchestration and the state's round trip each fit one short file. It uses the engine's ``module``,
``optimizer``, ``plan``, ``rank``, ``steps_done``, ``run_id``, ``precision``, ``zero``, ``offload`` and
``_recheck_local``.
"""

from __future__ import annotations

import contextlib
import dataclasses

from whale.runtime import checkpoint, heartbeat
from whale.runtime.offload import device_keyed


class EngineState:
    """State dicts and checkpoints of an :class:`~whale.runtime.engine.Engine` (see the module docstring)."""

    def state_dict(self) -> dict:
        """This rank's shard: ``{"model": stage state dict (original FQNs), "optimizer": ..., "step": n}``, and
        ``"loss_scale"`` (the scaler's state) under fp16."""
        with self._whole():
            model = self.module.state_dict()
            if self.plan.zero >= 3:  # the gathered storage is freed on leaving
                model = {k: v.clone() for k, v in model.items()}
        out = {"model": model, "optimizer": self.optimizer.state_dict(), "step": self.steps_done}
        if self.precision.scaler is not None:
            out["loss_scale"] = self.precision.scaler.state_dict()
        return out

    def full_state_dict(self) -> dict:
        """The whole model's state dict (original names, CPU tensors) on rank 0; ``{}`` elsewhere.
        Collective: every rank must call it."""
        with self._whole():
            return checkpoint.gather_full_state(self.module, self.plan, self.rank)

    def _whole(self, write_back: bool = False):
        """A context with whole parameters on this rank (ZeRO-3 gathers them: collective over the lanes)."""
        return self.zero.whole(write_back) if self.zero is not None else contextlib.nullcontext()

    def save_checkpoint(self, path: str, extra: dict | None = None) -> str:
        """Save checkpoint ``path/step-N`` (N = :attr:`steps_done`) that loads under any plan, atomically
        (collective; :mod:`whale.runtime.checkpoint`); ``extra``: plain Python (data position, ...). Returns the
        published directory."""
        scaler = self.precision.scaler
        heartbeat.beat("checkpoint save")
        with self._whole(), device_keyed(self.offload):
            return checkpoint.save(path, self, extra or {}, scaler.state_dict() if scaler is not None else None)

    def load_checkpoint(self, path: str) -> dict:
        """Restore the latest complete checkpoint under ``path`` (saved under this plan or any other: weights,
        optimizer state, step, RNG); returns the saved ``extra``. Under an unchanged rank layout the saved lane
        shares come back in a new plan.

        Raises:
            CheckpointError: no complete checkpoint; a damaged file (named); another model or optimizer.
        """
        heartbeat.beat("checkpoint load")
        with self._whole(write_back=True), device_keyed(self.offload):
            restored = checkpoint.load(path, self)
        if self.offload is not None:
            self.offload.refresh()  # the host masters from the loaded parameters
        self.steps_done, self.run_id = restored.step, restored.run
        if self.precision.scaler is not None and restored.loss_scale is not None:
            self.precision.scaler.load_state_dict(restored.loss_scale)
        self.plan = dataclasses.replace(self.plan, lane_weights=restored.lane_weights,
                                        stage_lane_weights=restored.stage_lane_weights)
        self._recheck_local()
        return restored.extra
