"""The 10 rows of Megatron-LM SC'21 Table 1, as published (data only).

Sources:

- Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", SC'21
  (arXiv 2104.04473), Table 1 ("Weak-scaling throughput for GPT models ranging from 1 billion to 1 trillion
  parameters"): parameters (billions), attention heads, hidden size, layers, tensor / pipeline / data degrees,
  GPUs, batch size, achieved teraFLOP/s per GPU, percent of the A100's 312 teraFLOP/s peak, aggregate
  petaFLOP/s. Sequence 2048, vocabulary 51,200 (§5.1). Each row's aggregate equals its per-GPU figure times its
  GPUs to the paper's rounding, and its percent of peak equals per-GPU / 312.
- NVIDIA/Megatron-LM, ``examples/sc21/run_table_1.sh`` at commit 79a3bb6bf2c85b748c46749dd0695e23310d4e16
  (the scripts "used to produce the results" of the paper, per ``examples/sc21/README.md``; identical degrees
  at de7dc40f883ceed06344051c3c7ebd57da59cc53, which added them): micro-batch size (MBS), global batch (GBS),
  ``--num-layers-per-virtual-pipeline-stage`` (interleaved schedule; chunks per device v = layers / (PP x it)),
  ``--DDP-impl`` (``torch``: PyTorch DDP, gradient all-reduce overlapped with the backward; ``local``:
  Megatron's, after the backward), full activation recomputation on every row (``--checkpoint-activations``,
  later ``--recompute-method uniform``), ``--fp16``.

Cluster (paper §5): Selene, DGX A100 nodes of 8 A100-80GB GPUs, NVLink/NVSwitch within a node (600 GB/s per
GPU both directions together, 300 GB/s each way) and 8 HDR InfiniBand 200 Gb/s adapters per node (25 GB/s per
GPU each way).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Row:
    """One published row: the model, the plan the runtime ran, and the measured throughput."""

    name: str
    params_b: float
    heads: int
    hidden: int
    layers: int
    tp: int
    pp: int
    dp: int
    gpus: int
    batch: int
    tflops_per_gpu: float
    percent_peak: int
    aggregate_pflops: float
    micro_batch: int
    layers_per_virtual_stage: int  # 0: plain 1F1B
    ddp: str

    @property
    def virtual(self) -> int:
        """Chunks per device of the interleaved schedule (1: plain 1F1B)."""
        per_stage = self.layers // self.pp
        return per_stage // self.layers_per_virtual_stage if self.layers_per_virtual_stage else 1

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step per pipeline: batch / (dp x micro-batch size)."""
        return self.batch // (self.dp * self.micro_batch)


SEQ, VOCAB = 2048, 51200
ROWS = (
    Row("1.7B", 1.7, 24, 2304, 24, 1, 1, 32, 32, 512, 137, 44, 4.4, 16, 0, "torch"),
    Row("3.6B", 3.6, 32, 3072, 30, 2, 1, 32, 64, 512, 138, 44, 8.8, 16, 0, "torch"),
    Row("7.5B", 7.5, 32, 4096, 36, 4, 1, 32, 128, 512, 142, 46, 18.2, 16, 0, "torch"),
    Row("18B", 18.4, 48, 6144, 40, 8, 1, 32, 256, 1024, 135, 43, 34.6, 8, 0, "torch"),
    Row("39B", 39.1, 64, 8192, 48, 8, 2, 32, 512, 1536, 138, 44, 70.8, 4, 0, "local"),
    Row("76B", 76.1, 80, 10240, 60, 8, 4, 32, 1024, 1792, 140, 45, 143.8, 2, 5, "local"),
    Row("145B", 145.6, 96, 12288, 80, 8, 8, 24, 1536, 2304, 148, 47, 227.1, 2, 5, "local"),
    Row("310B", 310.1, 128, 16384, 96, 8, 16, 15, 1920, 2160, 155, 50, 297.4, 1, 3, "local"),
    Row("530B", 529.6, 128, 20480, 105, 8, 35, 9, 2520, 2520, 163, 52, 410.2, 1, 1, "local"),
    Row("1T", 1008.0, 160, 25600, 128, 8, 64, 6, 3072, 3072, 163, 52, 502.0, 1, 0, "local"),
)
"""Table 1 (paper) with micro-batch, interleaving and DDP from run_table_1.sh (see the module docstring)."""
