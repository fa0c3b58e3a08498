"""DiLoCo fragments of one pipeline stage: its trainable parameters in contiguous, balanced groups."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from .._validation import require

__all__ = ["stage_fragments"]


class _ParamSet(nn.Module):
    """A DiLoCo fragment: some of a stage's trainable parameters (shared, not copied)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(list(params))


def stage_fragments(module: nn.Module, count: int) -> list[nn.Module]:
    """Split a pipeline stage's (``pipeline.StageModule``) trainable parameters into ``count`` contiguous fragments.

    Embeddings go with the first layers, the final norm and the head with the last ones; every
    fragment gets at least one parameter tensor and they are balanced by element count.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    require(
        len(params) >= count,
        "dp_fragments",
        count,
        f"be <= the {len(params)} trainable parameter tensors of stage {module.stage}",
    )
    total = sum(p.numel() for p in params)
    fragments: list[list[nn.Parameter]] = [[] for _ in range(count)]
    seen, index = 0, 0
    for i, p in enumerate(params):
        left_params, left_frags = len(params) - i, count - index
        if fragments[index] and (seen >= total * (index + 1) / count or left_params <= left_frags - 1):
            index += 1
        fragments[index].append(p)
        seen += p.numel()
    return [_ParamSet(f) for f in fragments]
