"""Stable row ids for change coding: every training row carries its index in the training dataset.

``boundary_change_codec`` keys each boundary's cache by row (``boundary.compose.change``), so the
Trainer's training dataloader hands every batch a ``ROW_ID`` tensor beside the model's inputs: the
dataset is wrapped (``RowIds``: row i is ``{**dataset[i], ROW_ID: i}``) and so is the collator
(``RowIdCollator``: it takes the ids out, collates the rest as before and puts them back as one int64
tensor). The sampler draws the same indices from the wrapped dataset as from the plain one, so the data
order is unchanged; ``MeshTrainer.compute_loss`` hands the ids to the boundaries before each forward.
``require_cache_budget`` predicts the caches' size from the rows' token counts and refuses a run that
would exceed ``change_cache_gb`` before it trains.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset

from ._validation import require
from .boundary.compose.change import ROW_ID

__all__ = ["ROW_ID", "RowIdCollator", "RowIds", "require_cache_budget", "require_row_ids"]


def require_row_ids(dataset: Any) -> None:
    """Change coding needs rows that keep their index: a map-style dataset with a length."""
    require(
        dataset is not None
        and not isinstance(dataset, IterableDataset)
        and hasattr(dataset, "__len__")
        and hasattr(dataset, "__getitem__"),
        "train_dataset",
        type(dataset).__name__,
        "be a map-style dataset (with __len__ and __getitem__: a datasets.Dataset or a torch Dataset) when "
        "boundary_change_codec is set: its rows are keyed by their index, which a streamed dataset does not give",
    )


class RowIds(Dataset):
    """``dataset`` with each row's index added under ``ROW_ID``."""

    def __init__(self, dataset: Any) -> None:
        require_row_ids(dataset)
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> dict:
        row = self.dataset[index]
        require(isinstance(row, dict), "train_dataset row", type(row).__name__, "be a dict of features")
        require(ROW_ID not in row, "train_dataset column", ROW_ID, "not be a column of the dataset (it is reserved)")
        return {**row, ROW_ID: int(index)}


class RowIdCollator:
    """``collate`` on the rows without their ids, the ids added back as one int64 tensor [B]."""

    def __init__(self, collate: Callable[[list[dict]], Any]) -> None:
        self.collate = collate

    def __call__(self, features: Sequence[dict]) -> Any:
        ids = [feature[ROW_ID] for feature in features]
        batch = self.collate([{k: v for k, v in feature.items() if k != ROW_ID} for feature in features])
        batch[ROW_ID] = torch.tensor(ids, dtype=torch.int64)
        return batch


def _row_tokens(dataset: Any) -> list[int]:
    """Each row's token count (its ``input_ids``), without the rows' other features where the dataset
    has columns."""
    if hasattr(dataset, "column_names") and "input_ids" in dataset.column_names:
        return [len(ids) for ids in dataset["input_ids"]]
    counts = []
    for index in range(len(dataset)):
        row = dataset[index]
        require(
            isinstance(row, dict) and "input_ids" in row,
            "train_dataset",
            f"row {index} without input_ids",
            "be tokenized (input_ids per row) when boundary_change_codec is set, so the caches can be sized",
        )
        counts.append(len(row["input_ids"]))
    return counts


def require_cache_budget(dataset: Any, hidden_size: int, boundaries: int, dtype_bytes: int, budget_gb: float) -> int:
    """The change caches' predicted bytes after a full epoch, or a ValueError with the numbers when they exceed
    ``budget_gb``. A model: every row's tokens × H × the boundaries × the model dtype's bytes (one cache per
    boundary on one process; a padded position is not held, so this is an upper bound where rows carry padding
    in input_ids)."""
    tokens = sum(_row_tokens(dataset))
    need = tokens * hidden_size * boundaries * dtype_bytes
    require(
        need <= budget_gb * 1e9,
        "change_cache_gb",
        budget_gb,
        f"be at least the change caches' predicted size, {need / 1e9:.6g} GB ({len(dataset)} rows, "
        f"{tokens} tokens × H={hidden_size} × {boundaries} boundaries × {dtype_bytes} bytes): "
        "raise it, train on fewer rows, or leave boundary_change_codec unset",
    )
    return need
