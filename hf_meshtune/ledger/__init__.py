"""Analytic byte ledger: bytes per fast-circuit token, by circuit, summed over every link of the mesh.

The mesh is ``num_replicas`` (X) data-parallel replicas × ``num_stages`` (Y) pipeline stages. With the
anchor on, replica X-1 is the dense anchor and X_f = X-1 replicas form the fast circuit (X_f = X
without it). Four circuits carry bytes:

* ``pp_fwd`` / ``pp_bwd``: the masked stage boundaries. A fast token crosses Y-1 boundaries, carrying
  only its K = round((1-p)·H) kept values each way; the keep-set is a shared-seed function, so no
  index travels.
* ``dp``: the fast replicas' data-parallel sync (ring all-reduce; DiLoCo period S, PowerSGD rank r).
* ``anchor``: the anchor's own dense pipeline, keeping its parameters current, and delivering its
  gradient (or low-rank factors) to every fast replica.

Everything is derived from real parameter shapes and dtype sizes; no weights are allocated
(``ledger_for_config`` builds the model on the meta device). ``docs/ledger.md`` states the formulas.

- ``settings``: what the ledger is told (``LedgerSettings``, also from the mesh knobs) and what it says (``Ledger``);
- ``circuits``: the formulas, circuit by circuit, and the dense reference a ledger is compared with;
- ``tables``: offline model configs, the paper's columns and reported totals, and the Markdown table.
"""

from .circuits import (
    anchor_payload_numel,
    compute_ledger,
    dense_reference,
    dp_payload_numel,
    ledger_for_config,
    param_shapes_of,
)
from .settings import DTYPE_BYTES, Ledger, LedgerSettings, measured_ratios, settings_from_knobs
from .tables import (
    PAPER_BYTES_PER_TOKEN,
    PAPER_POWERSGD_RANK,
    PAPER_SYNC_EVERY,
    PRESETS,
    STANDARD_ROWS,
    format_table,
    settings_for_row,
)

__all__ = [
    "DTYPE_BYTES",
    "PAPER_BYTES_PER_TOKEN",
    "PAPER_POWERSGD_RANK",
    "PAPER_SYNC_EVERY",
    "PRESETS",
    "STANDARD_ROWS",
    "Ledger",
    "LedgerSettings",
    "anchor_payload_numel",
    "compute_ledger",
    "dense_reference",
    "dp_payload_numel",
    "format_table",
    "ledger_for_config",
    "param_shapes_of",
    "settings_for_row",
    "measured_ratios",
    "settings_from_knobs",
]
