"""Fast tests of the WAN benchmark scripts (benchmarks/wan): they run end to end, write the keys the
reports read, agree with ``meshtune ledger --json``, and the GPU check refuses to run without CUDA."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from benchmarks.wan import gpu_check, ledger_1b, micro
from hf_meshtune.boundary.masking import keep_count
from hf_meshtune.cli import main as cli_main

_CIRCUIT_KEYS = (
    "pp_fwd_bytes_per_token",
    "pp_bwd_bytes_per_token",
    "dp_bytes_per_token",
    "anchor_bytes_per_token",
    "total_bytes_per_token",
    "compression_vs_dense",
)


def test_micro_smoke_writes_the_expected_keys(tmp_path):
    assert micro.main(["--smoke", "--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "micro.json").read_text())
    assert data["smoke"] is True
    assert {"torch", "cpu_count", "torch_threads", "date"} <= set(data["machine"])

    tiny = data["masking"]["models"]["tiny-llama"]
    assert {"step", "masking_work", "share_of_step", "index_generation_share", "meets_target"} <= set(tiny)
    step = tiny["step"]
    assert {"masked_step", "dense_step"} <= set(step) and step["num_boundaries"] == 3
    # the boundaries really masked: 3 boundaries × K kept fp32 values per token went forward
    assert step["fwd_boundary_bytes_per_token"] == 3 * keep_count(step["hidden"], micro.MASK_RATIO) * 4
    assert {"index_generation", "mask_fwd_bwd"} <= set(tiny["masking_work"])
    assert "skipped" in data["masking"]["models"]["smollm2-135m"]
    assert "per_boundary_per_microbatch" in data["masking"]["index_generation_at_1b_shape"]

    assert data["optimizer"]["sets"], "no optimizer shape set was timed"
    for result in data["optimizer"]["sets"].values():
        assert result["adamw"]["state_over_params"] == pytest.approx(2.0, rel=1e-2)  # exp_avg, exp_avg_sq
        assert set(result["spectral"]) == {
            "full",
            "rank32",
            "rank8",
            "rank32 trainer path",
            "rank8 trainer path",
            "rank32 factors, trainer path",
            "rank8 factors, trainer path",
        }
        # the factors path holds U, d, V but no M_anc: less state than the path that folds the gradient itself
        spectral = result["spectral"]
        assert spectral["rank8 factors, trainer path"]["state_over_params"] < spectral["rank8"]["state_over_params"]
        for spec in spectral.values():
            assert {
                "no_basis_step",
                "cached_step",
                "svd_step",
                "amortised_s",
                "amortised_over_adamw",
                "meets_target",
                "state_over_params",
            } <= set(spec)
            assert spec["state_over_params"] > 2.0  # + M_anc and the cached basis
    md = (tmp_path / "micro.md").read_text()
    assert "(a) Masking as a share" in md and "(b, c) SpectralAdamW vs AdamW" in md


def _cli_json(capsys, *flags: str) -> dict:
    capsys.readouterr()
    assert cli_main(["ledger", "--json", *flags]) == 0
    return json.loads(capsys.readouterr().out)


def test_ledger_1b_rows_equal_the_cli(tmp_path, capsys):
    assert ledger_1b.main(["--out-dir", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "ledger_1b.json").read_text())
    for payload in ("gradient", "factors"):
        cli = _cli_json(capsys, "--anchor-payload", payload)
        assert list(data["tables"][payload]) == list(cli) == list(ledger_1b.ROWS)
        for row, expected in cli.items():
            for key in _CIRCUIT_KEYS:
                assert data["tables"][payload][row][key] == pytest.approx(expected[key], rel=1e-12), (payload, row, key)
        target = data["targets"][payload]
        assert target["m95_ap_met"] == (cli["M95+AP"]["total_bytes_per_token"] <= ledger_1b.TARGET_BYTES)
        assert target["dense_over_m95_ap"] == pytest.approx(cli["M95+AP"]["compression_vs_dense"])
    # the sweep's compute_ledger path reproduces the table's ledger_for_config path
    paper_row = data["sensitivity"]["one_at_a_time"][0]
    assert paper_row["total"] == pytest.approx(data["tables"]["gradient"]["M95+AP"]["total_bytes_per_token"])
    # the fit of the paper's rows is recomputed, not typed in: it must reproduce the paper's totals
    assert data["paper_fit"]["max_abs_residual"] < 0.01 * min(ledger_1b.L.PAPER_BYTES_PER_TOKEN.values())
    md = (tmp_path / "ledger_1b.md").read_text()
    assert "## Why the numbers differ" in md and "## Sensitivity" in md


def test_gpu_check_refuses_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu_check.json"
    assert gpu_check.main(["--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "torch.cuda.is_available()=False is invalid: it must be True" in err
    assert "CUDA device" in err and "never falls back to the CPU" in err
    assert not out.exists()


def test_gpu_check_shares_micro_timing_code():
    for name in ("time_masking_work", "time_masked_step", "compare_optimizers", "decoder_layer_shapes", "machine_info"):
        assert getattr(gpu_check, name) is getattr(micro, name)


def test_gpu_check_renders_the_committed_h200_run(tmp_path):
    # the committed JSON is a real run on the lent H200; re-rendering it must give the committed table
    committed = os.path.join(micro.RESULTS, "gpu_check.json")
    copy = tmp_path / "gpu_check.json"
    shutil.copy(committed, copy)
    assert gpu_check.main(["--render", str(copy)]) == 0
    md = (tmp_path / "gpu_check.md").read_text()
    with open(os.path.join(micro.RESULTS, "gpu_check.md")) as fh:
        assert md == fh.read()
    assert "NVIDIA H200" in md and "| rank8 factors, trainer path |" not in md  # no profile rows for trainer paths
    assert "SpectralAdamW rank8 factors, trainer path | 2.2 |" in md
