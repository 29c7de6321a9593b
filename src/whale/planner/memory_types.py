"""The memory model's inputs as plain data: what a pipeline stage needs (:class:`StageMemory`) and one combination
of memory techniques (:class:`MemoryOptions`). Their own module so that both the memory model
(:mod:`whale.planner.memory`) and the step-time model (:mod:`whale.planner.steptime.memory_time`) import them
without importing each other."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StageMemory:
    """What one pipeline stage needs for one whole (unsharded) copy, fp32, from the profile.

    Attributes:
        trainable_elements: parameter elements with gradients the stage holds (a weight tied across stages
            counts in every stage holding it).
        frozen_bytes: frozen parameters + buffers, bytes (never sharded).
        activation_bytes: bytes per sample a micro-batch keeps alive until its backward.
        checkpointed_bytes: the same with every repeated layer checkpointed.
        backward_bytes: the most bytes per sample alive for the micro-batch whose backward runs: its
            activations not yet freed plus the backward's temporaries (gradients of activations, the loss's
            gradient of the logits), at the worst moment (>= ``activation_bytes`` when profiled).
        checkpointed_backward_bytes: the same with every repeated layer checkpointed (the layer in backward
            holds its recomputed activations).
        tied_elements: of those, elements of weights tied across stages (an input embedding and LM head);
            ZeRO slices their state over every stage holding them (:mod:`whale.parallel.zero`).
        tie_stages: how many stages hold those weights (their state share is ``f / tie_stages``).
        gather_elements: parameter elements ZeRO-3 holds gathered at once (:mod:`whale.parallel.zero3`): a
            pipeline stage is gathered whole per micro-batch; one stage gathers each repeated layer in turn
            and keeps the rest (embeddings, head) gathered from its forward to its backward.
        reduce_elements: outside a pipeline, elements of the largest repeated layer: ZeRO-3 copies a layer's
            gradients into one flat buffer that waits for its reduce-scatter during the next layer's backward
            (``4 *`` this many bytes of temporaries more at the peak; 0 in a pipeline stage).
        recompute_flops: forward FLOPs per sample of the checkpointable layers (what recomputation repeats).
        train_flops: forward + backward FLOPs per sample of the whole stage (to compare the options' compute
            time on the lane shares each option's placement gives).
        pipelined: the stage is one of several pipeline stages (ZeRO-3 gathers it whole; its tied weights stay
            whole, their gradients and state sliced as under ZeRO-2).
        p2p_bytes: bytes per sample of the pipeline's point-to-point buffers the stage holds: per boundary
            with a neighbouring stage, three messages of the boundary's size (a receive posted ahead, the
            message being consumed, a send not yet complete: :mod:`whale.parallel.p2p`; measured in
            ``benchmarks/memory.py``).
        frontier_bytes: bytes per sample of the outputs of the stage's modules holding parameters: the
            gradients a zero-bubble B pass keeps for its W pass, per micro-batch whose W waits
            (:func:`whale.frontend.memplan.with_weight_passes` adds them to ``backward_bytes``).
    """

    trainable_elements: int
    tied_elements: int = 0
    tie_stages: int = 1
    frozen_bytes: float = 0.0
    activation_bytes: float = 0.0
    checkpointed_bytes: float = 0.0
    backward_bytes: float = 0.0
    checkpointed_backward_bytes: float = 0.0
    gather_elements: int = 0
    reduce_elements: int = 0
    recompute_flops: float = 0.0
    train_flops: float = 0.0
    pipelined: bool = False
    p2p_bytes: float = 0.0
    frontier_bytes: float = 0.0


@dataclass(frozen=True, order=True)
class MemoryOptions:
    """One combination of memory techniques (see the module docstring)."""

    activation_checkpoint: bool = False
    zero: int = 0
    offload: str = "none"

    def describe(self) -> str:
        """Human-readable, e.g. ``"activation checkpointing + ZeRO-2 + offload optimizer"``."""
        parts = (["activation checkpointing"] if self.activation_checkpoint else []) + \
            ([f"ZeRO-{self.zero}"] if self.zero else []) + \
            ([f"offload {self.offload}"] if self.offload != "none" else [])
        return " + ".join(parts) or "no memory techniques"


def merge_chunks(chunks: list[StageMemory]) -> StageMemory:
    """One pipeline stage's memory from those of the model chunks it runs (an interleaved plan's stage cuts):
    static bytes and elements add up, as do the bytes per sample a micro-batch keeps through the whole stage
    (the in-flight count is in whole-stage micro-batches, :func:`whale.plan.schedule.in_flight_micro_batches`);
    the backward's excess over what is kept is the worst chunk's (one chunk runs backward at a time), ZeRO-3's
    gathered elements the largest chunk's (each chunk is gathered around its own segments)."""
    if len(chunks) == 1:
        return chunks[0]
    act, ckpt = sum(c.activation_bytes for c in chunks), sum(c.checkpointed_bytes for c in chunks)
    return StageMemory(
        trainable_elements=sum(c.trainable_elements for c in chunks),
        tied_elements=sum(c.tied_elements for c in chunks), tie_stages=max(c.tie_stages for c in chunks),
        frozen_bytes=sum(c.frozen_bytes for c in chunks), activation_bytes=act, checkpointed_bytes=ckpt,
        backward_bytes=act + max(max(0.0, c.backward_bytes - c.activation_bytes) for c in chunks),
        checkpointed_backward_bytes=ckpt + max(max(0.0, c.checkpointed_backward_bytes - c.checkpointed_bytes)
                                               for c in chunks),
        gather_elements=max(c.gather_elements for c in chunks), reduce_elements=max(c.reduce_elements for c in chunks),
        recompute_flops=sum(c.recompute_flops for c in chunks), train_flops=sum(c.train_flops for c in chunks),
        pipelined=any(c.pipelined for c in chunks), p2p_bytes=sum(c.p2p_bytes for c in chunks),
        frontier_bytes=sum(c.frontier_bytes for c in chunks))
