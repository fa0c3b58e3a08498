"""recipes/cpt.py: continued pre-training on raw text, for real on the embedded SmolLM2 (a couple of steps)."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import transformers

from hf_meshtune.apps.assets import smollm2_checkpoint
from hf_meshtune.boundary.compose.grammar import parse_codec
from hf_meshtune.config import QUALITY_CODEC
from tests.distributed import mesh_launch
from tests.test_recipes import ROOT, load_script

FAST = [
    "--use_cpu",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
    "--per_device_train_batch_size",
    "2",
    "--per_device_eval_batch_size",
    "4",
]


@pytest.fixture(scope="module")
def cpt():
    return load_script("recipes/cpt.py")


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(smollm2_checkpoint())


def _write_text(path, lines: int = 60) -> str:
    """A few KB of plain text (deterministic, varied enough to tokenize into many different tokens)."""
    words = ["apples", "bicycles", "ledgers", "rivers", "lanterns", "pencils", "meadows", "engines"]
    text = (
        "\n".join(
            f"Line {i}: {i * 7 % 13} {words[i % 8]} crossed {i * 3 % 11} {words[(i * 5) % 8]} before noon."
            for i in range(lines)
        )
        + "\n"
    )
    path.write_text(text, encoding="utf-8")
    return text


def _assert_plain_checkpoint(out) -> None:
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info


def test_cpt_recipe_on_the_embedded_corpus_trains_saves_and_reports_perplexity(tmp_path, cpt):
    out = tmp_path / "cpt"
    metrics = cpt.main(
        [
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--train_last_layers",
            "1",
            "--block_size",
            "64",
            "--eval_blocks",
            "8",
            "--num_stages",
            "2",
            "--anchor_every",
            "1",
            "--anchor_delay",
            "1",
            "--logging_steps",
            "1",
            *FAST,
        ]
    )
    assert math.isfinite(metrics["eval_loss"]) and math.isfinite(metrics["perplexity"])
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))
    _assert_plain_checkpoint(out)
    assert (out / "tokenizer_config.json").is_file()
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 2
    assert json.loads((out / "eval_results.json").read_text())["perplexity"] == pytest.approx(metrics["perplexity"])


def test_blocks_are_block_size_long_and_concatenate_to_the_tokenized_text(tmp_path, cpt, tokenizer):
    text = _write_text(tmp_path / "corpus.txt")
    assert 2_000 < len(text.encode()) < 10_000
    stream = cpt.tokenize_documents(tokenizer, [text])
    assert stream == tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    blocks = cpt.group_blocks(stream, 64)
    assert len(blocks) == len(stream) // 64 >= 2
    assert all(len(block) == 64 for block in blocks)
    assert sum(blocks, []) == stream[: len(blocks) * 64]  # in order; only the tail shorter than a block is dropped
    assert cpt.group_blocks(list(range(10)), 3) == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_text_files_glob_trains_on_those_files(tmp_path, cpt, tokenizer, monkeypatch):
    data = tmp_path / "data"
    data.mkdir()
    text = _write_text(data / "corpus.txt")
    splits, cpt_splits = [], cpt.cpt_splits

    def spy(*args, **kwargs):  # records the (train, eval) datasets main() builds
        splits.append(cpt_splits(*args, **kwargs))
        return splits[-1]

    monkeypatch.setattr(cpt, "cpt_splits", spy)
    out = tmp_path / "cpt-files"
    metrics = cpt.main(
        [
            "--output_dir",
            str(out),
            "--text_files",
            str(data / "*.txt"),
            "--max_steps",
            "1",
            "--train_last_layers",
            "1",
            "--block_size",
            "64",
            "--eval_blocks",
            "2",
            "--num_stages",
            "2",
            "--anchor",
            "false",
            *FAST,
        ]
    )
    assert math.isfinite(metrics["eval_loss"]) and math.isfinite(metrics["perplexity"])
    ((train, evaluation),) = splits
    expected = cpt.group_blocks(cpt.tokenize_documents(tokenizer, [text]), 64)
    assert list(train["input_ids"]) + list(evaluation["input_ids"]) == expected
    assert list(train["labels"]) == list(train["input_ids"]) and len(evaluation) == 2
    _assert_plain_checkpoint(out)


def test_bad_input_is_rejected_before_training(tmp_path, cpt):
    small = tmp_path / "small.txt"
    small.write_text("Just a few words of text.", encoding="utf-8")
    _write_text(tmp_path / "corpus.txt")
    cases = [
        (
            ["--text_files", str(tmp_path / "missing" / "*.txt")],
            r"text_files='.*missing.*\*\.txt' is invalid: it must match at least one existing file",
        ),
        (
            ["--text_files", str(tmp_path / "corpus.txt"), "--block_size", "100000"],
            r"block_size=100000 is invalid: it must be <= the model's max_position_embeddings=8192",
        ),
        (
            ["--text_files", str(small), "--block_size", "16"],
            r"block_size=16 is invalid: it must fit at least 2 times into the corpus of \d+ tokens",
        ),
        (
            ["--text_files", str(tmp_path / "corpus.txt"), "--block_size", "64", "--eval_blocks", "1000"],
            r"eval_blocks=1000 is invalid: it must be smaller than the corpus's \d+ blocks",
        ),
        (["--block_size", "1"], r"block_size=1 is invalid: it must be >= 2"),
    ]
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            cpt.main(["--output_dir", str(tmp_path / "never"), *extra, *FAST])
    assert not (tmp_path / "never").exists()


@pytest.mark.slow
def test_cpt_recipe_runs_on_a_launched_3x2_mesh(tmp_path):
    """`meshtune launch` runs the recipe unchanged: fixed-length blocks are the mesh's fixed-shape rows. On an
    empty cache: the six ranks ask for the embedded model at once, one converts it, the others wait for it.
    The terminal shows one training run: the loss rank's step lines and summary table, nothing of the other
    ranks (no warnings here) and none of torchft's INFO chatter."""
    out, cache = tmp_path / "mesh", tmp_path / "cache"
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    env.update(PYTHONPATH=ROOT, HF_MESHTUNE_CACHE=str(cache))
    command = [
        *mesh_launch("3x2"),
        os.path.join(ROOT, "recipes", "cpt.py"),
        "--output_dir",
        str(out),
        "--freeze_embeddings",
        "--num_stages",
        "2",
        "--max_steps",
        "2",
        "--block_size",
        "32",
        "--per_device_train_batch_size",
        "1",
        "--eval_blocks",
        "6",
        "--logging_steps",
        "1",
        "--report_to",
        "none",
        "--save_strategy",
        "no",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=500, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in cache.iterdir()) == ["smollm2-135m-instruct", "smollm2-135m-instruct.lock"]
    steps = [json.loads(line.split("] ", 1)[1]) for line in proc.stdout.splitlines() if line.startswith("[r0s1] {")]
    assert [entry["step"] for entry in steps] == [1, 2]
    assert all(entry["mesh_tokens_per_s"] > 0 and entry["comm/rank_bytes_per_token"] > 0 for entry in steps)
    assert f"[r0s1] full summary: {out / 'mesh_summary.json'}" in proc.stdout
    assert "[r0s1] | on the wire (measured) |" in proc.stdout
    assert "[r0s0] ***** eval metrics *****" in proc.stdout and "[r0s0]   perplexity" in proc.stdout  # process 0's
    assert {line[:6] for line in proc.stdout.splitlines() if line.startswith("[r")} == {"[r0s1]", "[r0s0]"}
    assert {line[:6] for line in proc.stderr.splitlines() if line.startswith("[r")} <= {"[r0s1]"}
    assert "[INFO]" not in proc.stderr
    summary = json.loads((out / "mesh_summary.json").read_text())
    assert summary["mesh"] == "3x2" and summary["steps"] == 2 and summary["seq_len"] == 32
    measured, analytic = summary["measured_bytes_per_token"], summary["analytic_bytes_per_token"]
    # the default boundary (preset quality) on one boundary, fp32: each real token's record (8 outlier dims, the
    # rotated codes' scales and codes) coded by zstd, whose ratio the run measured and the ledger divides by; on
    # the wire each microbatch (one row of 32 tokens) also carries a 24-byte header
    record = parse_codec(QUALITY_CODEC).message_bytes(576, 4)
    forward_ratio = summary["pp_coding_ratios"][0]
    assert forward_ratio > 1.0 and analytic["pp_fwd"] == pytest.approx(record / forward_ratio, rel=1e-9)
    assert measured["pp_fwd"] == pytest.approx(analytic["pp_fwd"] + 24 / 32, rel=1e-9)
    assert summary["fast_replicas"] == 3  # no anchor replica
    assert math.isfinite(json.loads((out / "eval_results.json").read_text())["perplexity"])
    _assert_plain_checkpoint(out)
