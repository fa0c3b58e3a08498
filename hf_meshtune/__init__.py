"""hf_meshtune: fine-tune Hugging Face LLMs over slow links.

Four mechanisms, four places:
- ``masking`` / ``boundaries``: shared-seed masks on pipeline boundaries (PP compression);
- ``anchor``: the dense anchor circuit whose delayed gradients define a spectral prior;
- ``optim.spectral``: ``SpectralAdamW``, AdamW on masked gradients filtered by that prior;
- ``ledger``: exact bytes per token of every circuit (DP sync arrives with the mesh).
"""

import importlib
import os

# torchft's Rust servers log every connection and quorum poll at INFO, read from RUST_LOG once, when torchft
# is imported (below, through the trainer): keep them at warnings unless the user exported RUST_LOG.
os.environ.setdefault("RUST_LOG", "warn")

from ._version import __version__
from .anchor import AnchorBatches, AnchorCircuit
from .boundary.hooks import BoundaryHandle, attach_boundaries, find_decoder_layers, split_stages
from .boundary.masking import BoundaryMask, compact, expand, keep_count, keep_indices
from .config import SPECTRAL_ADAMW, MeshConfig, MeshTrainingArguments
from .ledger import Ledger, LedgerSettings, compute_ledger, ledger_for_config
from .optim.spectral import SpectralAdamW
from .pipeline.placement import load_causal_lm
from .trainer import MeshTrainer, MeshTrainerMixin

# Integrations whose libraries are optional (TRL, PEFT) or heavy to import load on first use.
_LAZY = {
    "MeshSFTConfig": "trl_trainers",
    "MeshSFTTrainer": "trl_trainers",
    "MeshGRPOConfig": "trl_trainers",
    "MeshGRPOTrainer": "trl_trainers",
    "MeshGSPOConfig": "trl_trainers",
    "MeshAccelerator": "accelerate",
    "MeshPlugin": "accelerate",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "SPECTRAL_ADAMW",
    "__version__",
    "AnchorBatches",
    "AnchorCircuit",
    "BoundaryHandle",
    "BoundaryMask",
    "Ledger",
    "LedgerSettings",
    "MeshAccelerator",
    "MeshConfig",
    "MeshGRPOConfig",
    "MeshGRPOTrainer",
    "MeshGSPOConfig",
    "MeshPlugin",
    "MeshSFTConfig",
    "MeshSFTTrainer",
    "MeshTrainer",
    "MeshTrainerMixin",
    "MeshTrainingArguments",
    "SpectralAdamW",
    "attach_boundaries",
    "compact",
    "compute_ledger",
    "expand",
    "find_decoder_layers",
    "keep_count",
    "keep_indices",
    "ledger_for_config",
    "load_causal_lm",
    "split_stages",
]
