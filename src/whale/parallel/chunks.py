"""An interleaved pipeline rank's model chunks as one module (Narayanan et al. SC'21 §2.2: virtual stages).

A rank of stage r of an interleaved plan runs the chunks ``r, r + p, r + 2p, ...`` of the cut, each a stage module
of its own (:func:`whale.parallel.stages.build_stage`). :class:`Chunks` holds them in :attr:`Chunks.chunks` and
merges their module trees under the original names, so the rest of the runtime (optimizer, gradient sync, ZeRO,
checkpoints, memory tracking) sees one module with this rank's parameters once each, named as in the model; a
parameter two chunks share (a tie within one rank) is one tensor, its gradient the sum of both uses.
"""

from __future__ import annotations

from torch import nn


class ChunkError(RuntimeError):
    """Two chunks hold different objects under one name (a cut that does not come from one model)."""


def _merge(dst: nn.Module, src: nn.Module, path: str) -> None:
    """Register ``src``'s parameters, buffers and modules on ``dst`` under the same names: a real module
    (any type but a plain ``nn.Module``, which stage graphs make as a path holder) is shared as it is, a plain
    holder is merged into ``dst``'s holder of that name."""
    for name, p in src._parameters.items():
        if name in dst._parameters and dst._parameters[name] is not p:
            raise ChunkError(f"two chunks hold different parameters named {path + name!r}; re-plan the model")
        dst._parameters[name] = p
    for name, b in src._buffers.items():
        dst._buffers[name] = b
    for name, child in src.named_children():
        have = dst._modules.get(name)
        if type(child) is nn.Module:  # a path holder of the stage graph: merge its contents
            if have is None:
                have = nn.Module()
                dst.add_module(name, have)
            _merge(have, child, f"{path}{name}.")
        elif have is None:
            dst.add_module(name, child)
        elif have is not child:
            raise ChunkError(f"two chunks hold different modules named {path + name!r}; re-plan the model")


class Chunks(nn.Module):
    """This rank's model chunks (virtual stages), in chunk order; ``named_parameters()`` gives the model's names.

    Attributes:
        chunks: the chunk modules (not registered as children: their tensors appear once, under the original
            names); ``chunks[c](*inputs)`` runs chunk c.
    """

    def __init__(self, chunks: list[nn.Module]) -> None:
        super().__init__()
        object.__setattr__(self, "chunks", list(chunks))  # a plain list: not a child, its tensors named once
        for c in chunks:
            _merge(self, c, "")

    def forward(self, *args, **kwargs):
        """Not callable as a whole: the schedule runs each chunk.

        Raises:
            TypeError: always."""
        raise TypeError("an interleaved rank's Chunks run one chunk at a time (chunks[c](...)), not as one module")
