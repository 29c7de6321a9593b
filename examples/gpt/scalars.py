"""TensorBoard scalars of the GPT example (rank 0 writes them beside the JSON summary).

Tags: ``train/loss``, ``train/tokens_per_s``, ``train/lr`` every step; ``eval/loss`` at every evaluation;
``stage/<s>/busy_share`` and ``stage/<s>/idle_share`` from the bubble report; ``memory/peak_rss_mib`` of rank 0
(this process's peak resident memory, MiB). View them with ``.venv/bin/tensorboard --logdir runs/tb``.
"""

from __future__ import annotations

import resource


class Scalars:
    """A ``torch.utils.tensorboard.SummaryWriter`` on rank 0 (no-op elsewhere, or when ``logdir`` is empty).

    Args:
        logdir: directory of the event files ("" to write none).
        rank: this process's global rank.
    """

    def __init__(self, logdir: str, rank: int) -> None:
        self.writer = None
        if logdir and rank == 0:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(logdir)

    def step(self, step: int, loss: float, tokens_per_s: float, lr: float) -> None:
        """One training step's scalars (``step`` = optimizer steps done)."""
        if self.writer is not None:
            self.writer.add_scalar("train/loss", loss, step)
            self.writer.add_scalar("train/tokens_per_s", tokens_per_s, step)
            self.writer.add_scalar("train/lr", lr, step)

    def eval(self, step: int, loss: float) -> None:
        """A held-out loss."""
        if self.writer is not None:
            self.writer.add_scalar("eval/loss", loss, step)

    def close(self, step: int, bubble: list[dict]) -> None:
        """The per-stage busy/idle shares of the bubble report, rank 0's peak memory, and flush."""
        if self.writer is None:
            return
        for row in bubble:
            self.writer.add_scalar(f"stage/{row['stage']}/busy_share", 1 - row["idle_share"], step)
            self.writer.add_scalar(f"stage/{row['stage']}/idle_share", row["idle_share"], step)
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        self.writer.add_scalar("memory/peak_rss_mib", peak_kib / 1024, step)
        self.writer.close()
