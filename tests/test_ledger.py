"""Tests of the analytic byte ledger (hf_meshtune.ledger) and the ``meshtune ledger`` CLI."""

from __future__ import annotations

import json
import resource
from dataclasses import replace

import pytest
import torch
import transformers

from hf_meshtune.cli import main
from hf_meshtune.ledger import (
    PAPER_BYTES_PER_TOKEN,
    PRESETS,
    STANDARD_ROWS,
    Ledger,
    LedgerSettings,
    compute_ledger,
    format_table,
    ledger_for_config,
    param_shapes_of,
    settings_for_row,
)

# A tiny model: two matrices and one vector, 72 trainable elements, hidden size H = 10.
SHAPES = [(8, 4), (4,), (6, 6)]
H = 10


def tiny(**overrides) -> LedgerSettings:
    """X = 3, Y = 3, p = 0.5, T = 10, bf16 everywhere (2 bytes), dense DP, no anchor."""
    base = dict(num_replicas=3, num_stages=3, mask_ratio=0.5, tokens_per_step=10, anchor=False)
    return LedgerSettings(**{**base, **overrides})


# ------------------------------------------------------------------ hand-computed numbers


def test_dense_dp_by_hand():
    led = compute_ledger(SHAPES, H, tiny())
    # K = round(0.5 * 10) = 5; pp = (Y-1) * K * 2 B = 2 * 5 * 2 = 20 each way.
    assert led.keep == 5
    assert led.pp_fwd == pytest.approx(20.0) and led.pp_bwd == pytest.approx(20.0)
    # P = 32 + 4 + 36 = 72 elements; ring: 2 * (3-1) * 72 * 2 B / (X_f=3 * T=10 * S=1) = 576 / 30.
    assert led.dp == pytest.approx(19.2)
    assert led.anchor == 0.0
    assert led.total == pytest.approx(59.2)
    # Dense reference (p = 0 -> K = 10): pp = 2 * 10 * 2 = 40 each way, same dp: 99.2.
    assert led.dense_total == pytest.approx(99.2)
    assert led.compression == pytest.approx(99.2 / 59.2)


def test_diloco_powersgd_by_hand():
    led = compute_ledger(SHAPES, H, tiny(sync_every=4, powersgd_rank=2))
    # r = 2: [8,4] -> 2*(8+4) = 24 < 32; [4] stays 4; [6,6] -> 2*12 = 24 < 36: P = 52.
    # dp = 2 * 2 * 52 * 2 B / (3 * 10 * 4) = 416 / 120.
    assert led.dp == pytest.approx(416 / 120)
    # r = 3: [8,4] -> 36 >= 32 and [6,6] -> 36 >= 36 both fall back to dense: P = 72 again.
    led3 = compute_ledger(SHAPES, H, tiny(sync_every=4, powersgd_rank=3))
    assert led3.dp == pytest.approx(2 * 2 * 72 * 2 / 120)
    # the dense reference drops S and r: same as the plain ledger's dp.
    assert led.dense_total == pytest.approx(99.2)


def test_int8_dp_by_hand():
    """int8 codes: a byte per value of every DP all-reduce (PowerSGD's factors too) plus a float32 maximum per
    256 values."""
    led = compute_ledger(SHAPES, H, tiny(sync_every=4, dp_quantize="int8"))
    # P = 72 dense elements at 1 + 4/256 B: dp = 2 * 2 * 72 * (1 + 1/64) / (3 * 10 * 4)
    assert led.dp == pytest.approx(2 * 2 * 72 * (1 + 1 / 64) / 120)
    # r = 2: factors 24 + 24 and the vector's 4, all at 1 + 1/64 B
    led2 = compute_ledger(SHAPES, H, tiny(sync_every=4, powersgd_rank=2, dp_quantize="int8"))
    assert led2.dp == pytest.approx(2 * 2 * 52 * (1 + 1 / 64) / 120)
    assert led.dense_total == pytest.approx(99.2)  # the dense reference sends float gradients


def anchored(**overrides) -> LedgerSettings:
    """X = 4 with the anchor (X_f = 3), S = 4, r = 2, A = 5; T_anc defaults to T = 10."""
    return tiny(num_replicas=4, anchor=True, sync_every=4, powersgd_rank=2, anchor_every=5, **overrides)


# Per anchor round the fast circuit processes X_f * T * A = 3 * 10 * 5 = 150 tokens.
# (i) anchor pipeline: T_anc * 2 * (Y-1) * H * 2 B = 10 * 2 * 2 * 10 * 2 = 800 B / 150.
# (ii) DiLoCo mode: outer update P * 2 B per sync / (X_f * T * S) = 104 / 120.
PIPELINE, PARAMS = 800 / 150, 104 / 120


def test_anchor_gradient_payload_by_hand():
    led = compute_ledger(SHAPES, H, anchored(anchor_payload="gradient"))
    # (iii) full gradients of the 2-D params, 32 + 36 = 68 elements, to 3 replicas: 68 * 3 * 2 B / 150.
    assert led.anchor == pytest.approx(PIPELINE + PARAMS + 408 / 150)
    assert led.dp == pytest.approx(416 / 120)  # X_f = 3 fast replicas sync, the anchor does not
    assert led.pp_fwd == pytest.approx(20.0)
    # Dense reference: same 4 x 3 mesh and global batch, X_f * T = 30 tokens over 4 replicas:
    # T_ref = round(7.5) = 8; pp = 2 * 10 * 2 = 40 each way; dp = 2 * 3 * 72 * 2 / (4 * 8) = 27.
    assert led.dense_total == pytest.approx(107.0)


def test_the_anchor_is_forwarded_int8_outer_updates_in_their_codes():
    led = compute_ledger(SHAPES, H, anchored(anchor_payload="gradient", dp_quantize="int8"))
    # (ii) the outer update as the ring carried it: P = 52 values at 1 + 4/256 B per sync / (X_f * T * S)
    assert led.anchor == pytest.approx(PIPELINE + 52 * (1 + 1 / 64) / 120 + 408 / 150)


def test_anchor_factor_payload_by_hand():
    led = compute_ledger(SHAPES, H, anchored(anchor_payload="factors", anchor_rank=1))
    # (iii) rank 1: [8,4] -> 1 * (8+4+1) = 13, [6,6] -> 13: 26 elements * 3 replicas * 2 B / 150.
    assert led.anchor == pytest.approx(PIPELINE + PARAMS + 156 / 150)
    # rank 3: 3 * 13 = 39 per matrix, more than the gradients' 32 and 36: factors are what is sent, so booked.
    led3 = compute_ledger(SHAPES, H, anchored(anchor_payload="factors", anchor_rank=3))
    assert led3.anchor == pytest.approx(PIPELINE + PARAMS + 78 * 3 * 2 / 150)
    # rank 10: k = min(10, m, n) = 4 and 6: 4 * 13 + 6 * 13 = 130 elements
    led10 = compute_ledger(SHAPES, H, anchored(anchor_payload="factors", anchor_rank=10))
    assert led10.anchor == pytest.approx(PIPELINE + PARAMS + 130 * 3 * 2 / 150)


def test_anchor_plain_allreduce_pulls_snapshots():
    settings = tiny(num_replicas=4, anchor=True, anchor_every=5, anchor_tokens_per_round=30)
    led = compute_ledger(SHAPES, H, settings)
    # (i) 30 * 2 * 2 * 10 * 2 = 2400 B; (ii) snapshot of N = 72 params * 2 B = 144 B; (iii) 408 B.
    assert led.anchor == pytest.approx((2400 + 144 + 408) / 150)
    assert led.dp == pytest.approx(19.2)


def test_single_fast_replica_has_no_dp_traffic():
    led = compute_ledger(SHAPES, H, tiny(num_replicas=2, anchor=True))
    assert led.dp == 0.0
    assert led.anchor > 0.0


def test_dicts_carry_units_and_settings():
    led = compute_ledger(SHAPES, H, tiny())
    d = led.to_dict()
    assert d["pp_fwd_bytes_per_token"] == pytest.approx(20.0)
    assert d["total_bytes_per_token"] == pytest.approx(59.2)
    assert d["settings"]["num_replicas"] == 3
    json.dumps(d)
    logs = led.log_dict()
    assert logs["comm/dp_bytes_per_token"] == pytest.approx(19.2)
    assert set(logs) >= {f"comm/{c}_bytes_per_token" for c in ("pp_fwd", "pp_bwd", "anchor", "total")}
    assert all(isinstance(v, float) for v in logs.values())


def test_format_table_ratio_and_reference():
    dense = compute_ledger(SHAPES, H, tiny(mask_ratio=0.0))
    masked = compute_ledger(SHAPES, H, tiny())
    table = format_table({"A": dense, "B": masked}, reference={"A": 1.0})
    lines = table.splitlines()
    assert len(lines) == 4 and lines[0].startswith("| config")
    assert f"{99.2 / 59.2:,.2f}×" in lines[3]
    assert lines[3].rstrip(" |").endswith("—")  # no reference for B


# ------------------------------------------------------------------ real model shapes


@pytest.fixture(scope="module")
def meta_models():
    """Capture the models ledger_for_config builds, with the peak-memory growth it took."""
    original = transformers.AutoModelForCausalLM.from_config
    built = {}
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    with pytest.MonkeyPatch.context() as mp:
        for name, config in PRESETS.items():
            mp.setattr(
                transformers.AutoModelForCausalLM,
                "from_config",
                lambda cfg, **kw: built.setdefault(name, original(cfg, **kw)),
            )
            built[name + "/ledger"] = ledger_for_config(config, LedgerSettings())
    built["peak_growth_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak_before) / 1024
    return built


@pytest.mark.parametrize("name, params", [("llama-3.2-1b", 1.2358e9), ("smollm2-135m", 134.5e6)])
def test_presets_on_meta_count_tied_params_once(meta_models, name, params):
    model = meta_models[name]
    assert {p.device.type for p in model.parameters()} == {"meta"}  # no weights: the memory test bounds them
    total = sum(torch.Size(s).numel() for s in param_shapes_of(model))
    assert total == pytest.approx(params, rel=1e-3)  # an untied lm_head would add vocab * H
    assert meta_models[name + "/ledger"].hidden_size == PRESETS[name].hidden_size


def test_presets_allocate_no_weights(meta_models):
    assert meta_models["peak_growth_mib"] < 1024  # llama-3.2-1b in fp32 would be ~4.7 GiB


def test_keep_zero_names_mask_ratio():
    with pytest.raises(ValueError, match=r"^mask_ratio=0\.9995 is invalid: it must .*hidden_size=576"):
        ledger_for_config(PRESETS["smollm2-135m"], LedgerSettings(mask_ratio=0.9995))


@pytest.fixture(scope="module")
def llama_shapes():
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(PRESETS["llama-3.2-1b"])
    return param_shapes_of(model)


def test_standard_rows_compress_and_ratio_grows_with_p(llama_shapes):
    dense = compute_ledger(llama_shapes, 2048, settings_for_row("Dense"))
    best = compute_ledger(llama_shapes, 2048, settings_for_row("M95+AP"))
    assert dense.total / best.total > 1
    assert dense.compression == pytest.approx(1.0)
    assert best.compression == pytest.approx(dense.total / best.total)  # same global batch
    ratios = [
        compute_ledger(llama_shapes, 2048, replace(settings_for_row("M95+AP"), mask_ratio=p)).compression
        for p in (0.0, 0.5, 0.8, 0.9, 0.95, 0.99)
    ]
    assert all(a < b for a, b in zip(ratios, ratios[1:])), ratios


def test_settings_for_row_shares_the_global_batch():
    assert settings_for_row("Dense").tokens_per_step == 32 * 2048 // 8
    anchored_row = settings_for_row("M95+AP", sync_every=10, powersgd_rank=None)
    assert anchored_row.tokens_per_step == 32 * 2048 // 7
    assert (anchored_row.sync_every, anchored_row.powersgd_rank) == (10, None)
    assert settings_for_row("Dense", sync_every=10).sync_every == 1  # Dense stays dense
    with pytest.raises(ValueError, match=r"^mask_ratio=0\.5 is invalid: it must be left to the row"):
        settings_for_row("M95", mask_ratio=0.5)


# ------------------------------------------------------------------ validation


@pytest.mark.parametrize(
    "field, value",
    [
        ("num_replicas", 0),
        ("num_stages", 0),
        ("mask_ratio", 1.0),
        ("mask_ratio", -0.1),
        ("tokens_per_step", 0),
        ("activation_dtype", "bf17"),
        ("grad_dtype", "int8"),
        ("param_dtype", "float"),
        ("sync_every", 0),
        ("powersgd_rank", 0),
        ("anchor_every", 0),
        ("anchor_payload", "svd"),
        ("anchor_rank", 0),
        ("anchor_tokens_per_round", 0),
        ("dp_quantize", "int4"),
    ],
)
def test_settings_errors_name_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"^{field}={value!r} is invalid: it must ".replace(".", r"\.")):
        LedgerSettings(**{field: value})


def test_anchor_needs_two_replicas():
    with pytest.raises(ValueError, match=r"^num_replicas=1 is invalid: it must be >= 2 when anchor"):
        LedgerSettings(num_replicas=1)
    LedgerSettings(num_replicas=1, anchor=False)


# ------------------------------------------------------------------ CLI


def test_cli_json_has_all_rows(capsys):
    assert main(["ledger", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert list(out) == list(STANDARD_ROWS)
    assert all(row["total_bytes_per_token"] > 0 for row in out.values())
    assert out["M95+AP"]["settings"]["num_replicas"] == 8


def test_cli_boundary_codec_adds_its_rows_with_the_codec_message(capsys):
    assert main(["ledger", "--json", "--preset", "smollm2-135m", "--boundary-codec", "outliers8+int4g71"]) == 0
    out = json.loads(capsys.readouterr().out)
    codec, with_anchor, paper = out["outliers8+int4g71"], out["outliers8+int4g71+AP"], out["M95+AP"]
    assert codec["pp_fwd_bytes_per_token"] == codec["pp_bwd_bytes_per_token"] == 3 * 316  # Y-1 = 3 boundaries
    # the anchor also refits the codec's 576 geometry values (outlier and other dims, float32) every round for
    # stages b and b+1 of the 7 fast replicas at each of the 3 boundaries, and the stages agree on it every step
    T = 32 * 2048 // 7
    refit = 3 * 2 * 7 * 576 * 4 / (7 * T * 20) + 2 * 3 * 8 / T
    assert with_anchor["settings"]["codec_refit_every"] == 1
    assert with_anchor["anchor_bytes_per_token"] == pytest.approx(paper["anchor_bytes_per_token"] + refit, rel=1e-12)
    assert with_anchor["dp_bytes_per_token"] == paper["dp_bytes_per_token"]
    assert codec["anchor_bytes_per_token"] == 0 and codec["settings"]["boundary_codec"] == "outliers8+int4g71"


def test_cli_default_table_has_paper_column(capsys):
    assert main(["ledger", "--rows", "Dense,M95+AP"]) == 0
    out = capsys.readouterr().out
    assert "paper" in out.splitlines()[0]
    assert f"{PAPER_BYTES_PER_TOKEN['M95+AP']:,.1f}" in out.splitlines()[-1]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--mesh", "0x4"], "--mesh='0x4' is invalid: it must"),
        (["--mesh", "1x4"], "num_replicas=1 is invalid: it must"),
        (["--anchor-payload", "svd"], "--anchor-payload='svd' is invalid: it must"),
        (["--rows", "Dense,M99"], "--rows='M99' is invalid: it must"),
        (["--preset", "gpt-5"], "--preset='gpt-5' is invalid: it must"),
        (["--rows", ","], "--rows=',' is invalid: it must name at least one of"),
        (["--dp-quantize", "int4"], "--dp-quantize='int4' is invalid: it must be None or one of ['int8']"),
        (["--memory", "--dp-quantize", "int4"], "--dp-quantize='int4' is invalid: it must be None or one of ['int8']"),
        (
            ["--config", "/nonexistent/model"],
            "--config='/nonexistent/model' is invalid: it must be an existing config.json",
        ),
    ],
)
def test_cli_bad_values_exit_2_with_message(capsys, argv, message):
    assert main(["ledger", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_cli_smollm_preset_prints_table(capsys):
    assert main(["ledger", "--preset", "smollm2-135m"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("| config") and "paper" not in lines[0]
    assert [line.split("|")[1].strip() for line in lines[2:]] == list(STANDARD_ROWS)


def test_cli_config_dir(tmp_path, capsys):
    PRESETS["smollm2-135m"].save_pretrained(tmp_path)
    assert main(["ledger", "--config", str(tmp_path), "--rows", "M95", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["M95"]["hidden_size"] == 576


def test_ledger_is_frozen():
    led = compute_ledger(SHAPES, H, tiny())
    assert isinstance(led, Ledger)
    with pytest.raises(AttributeError):
        led.dp = 0.0  # type: ignore[misc]
