"""The anchor's own data (and the mesh's fast replicas'): round r → its batches, a pure function of (seed, r)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._validation import require
from ..boundary.masking import stable_seed

__all__ = ["AnchorBatches"]


class AnchorBatches:
    """The anchor's own data: round r → its microbatches, a pure function of (seed, r).

    Samples are drawn without replacement from a fresh permutation per pass over the dataset, with
    a seed distinct from the fast circuit's sampler; being a function of the round index, a resumed
    run sees exactly the batches an uninterrupted one would. ``tag`` separates samplers that share
    a seed (the mesh's fast replicas draw with another tag).
    """

    def __init__(
        self,
        dataset,
        collate: Callable,
        batch_size: int,
        microbatches: int,
        seed: int,
        prepare: Callable = lambda batch: batch,
        tag: bytes = b"meshtune-anchor",
    ) -> None:
        require(
            hasattr(dataset, "__len__") and len(dataset) > 0,
            "train_dataset",
            type(dataset).__name__,
            "be a non-empty map-style dataset (with __len__) so the anchor can draw its own batches",
        )
        require(isinstance(batch_size, int) and batch_size >= 1, "batch_size", batch_size, "be an int >= 1")
        require(isinstance(microbatches, int) and microbatches >= 1, "microbatches", microbatches, "be an int >= 1")
        self.dataset, self.collate, self.prepare = dataset, collate, prepare
        self.batch_size, self.microbatches, self.seed, self.tag = batch_size, microbatches, seed, tag
        self._perm_cache: tuple[int, torch.Tensor] | None = None

    def _permutation(self, epoch: int) -> torch.Tensor:
        if self._perm_cache is None or self._perm_cache[0] != epoch:
            gen = torch.Generator().manual_seed(stable_seed(self.tag, self.seed, epoch))
            self._perm_cache = (epoch, torch.randperm(len(self.dataset), generator=gen))
        return self._perm_cache[1]

    def indices(self, round_index: int) -> list[int]:
        per_round = self.batch_size * self.microbatches
        out = []
        for k in range(round_index * per_round, (round_index + 1) * per_round):
            epoch, position = divmod(k, len(self.dataset))
            out.append(int(self._permutation(epoch)[position]))
        return out

    def __call__(self, round_index: int) -> list:
        idx = self.indices(round_index)
        chunks = [idx[i : i + self.batch_size] for i in range(0, len(idx), self.batch_size)]
        return [self.prepare(self.collate([self.dataset[i] for i in chunk])) for chunk in chunks]
