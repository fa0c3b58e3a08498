"""The model card of a mesh-trained model: which mesh settings produced these weights.

``save_model`` / ``save_pretrained`` outputs of a Mesh trainer carry a ``README.md`` whose metadata
has the ``hf_meshtune`` tag and whose body has a "Trained with hf_meshtune" section: the boundary
compression (p, Y, K of H), the anchor and spectral settings, the DP sync and the byte ledger. A card
written by transformers, TRL or PEFT is kept: the section is added to it (and replaced on a later
save), never duplicated.
"""

from __future__ import annotations

import dataclasses
import os
import re

from huggingface_hub import ModelCard, ModelCardData

from ._version import __version__
from .boundary.masking import keep_count
from .config import MeshConfig, composed_codec

__all__ = ["CARD_TAG", "mesh_card_section", "write_mesh_card"]

CARD_TAG = "hf_meshtune"
_BEGIN, _END = "<!-- hf_meshtune:begin -->", "<!-- hf_meshtune:end -->"
_SECTION = re.compile(re.escape(_BEGIN) + r".*?" + re.escape(_END), re.DOTALL)


def mesh_card_section(config: MeshConfig, hidden_size: int | None, trainer: str, ledger: dict | None = None) -> str:
    """The Markdown section (between markers, so a later save replaces it)."""
    codec = composed_codec(config)
    if codec is not None:
        size = f" ({codec.payload_bytes(hidden_size, 2)} bytes per token on a bf16 wire)" if hidden_size else ""
        boundary = f"every stage boundary carried the `{codec.text}` codec's message{size}"
    else:
        assert config.mask_ratio is not None  # MeshConfig's preset resolves it
        kept = (
            f"K = {keep_count(hidden_size, config.mask_ratio)} of H = {hidden_size}"
            if hidden_size
            else "K = round((1−p)·H)"
        )
        boundary = (
            f"every stage boundary carried {kept} hidden values per token (p = {config.mask_ratio}), chosen by "
            "shared-seed random masks"
        )
    lines = [
        _BEGIN,
        "## Trained with hf_meshtune",
        "",
        f"`{trainer}` (hf_meshtune {__version__}): the model was split into Y = {config.num_stages} pipeline stages "
        f"and {boundary}. Evaluation, generation and these weights are the dense model: load them with "
        "plain transformers (or PEFT for an adapter).",
        "",
        "| setting | value |",
        "|---|---|",
    ]
    lines += [f"| `{f.name}` | {getattr(config, f.name)!r} |" for f in dataclasses.fields(config)]
    if ledger:
        lines += [
            "",
            "Bytes per token by circuit (analytic ledger of this mesh):",
            "",
            "| circuit | bytes/token |",
            "|---|---:|",
        ]
        lines += [f"| {name} | {value:,.1f} |" for name, value in ledger.items()]
    lines.append(_END)
    return "\n".join(lines)


def write_mesh_card(output_dir: str, section: str, base_model: str | None = None) -> str:
    """Add (or replace) the mesh section in ``output_dir/README.md`` and tag it; returns the path."""
    path = os.path.join(output_dir, "README.md")
    if os.path.isfile(path):
        card = ModelCard.load(path)
    else:
        card = ModelCard.from_template(
            ModelCardData(library_name="transformers", base_model=base_model),
            template_str="---\n{{ card_data }}\n---\n\n# Model card\n",
        )
    card.data.tags = sorted({*(card.data.tags or []), CARD_TAG})
    text = _SECTION.sub("", card.text).rstrip()
    card.text = f"{text}\n\n{section}\n"
    tmp = f"{path}.tmp-{os.getpid()}"
    card.save(tmp)
    os.replace(tmp, path)
    return path
