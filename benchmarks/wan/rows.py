"""What the WAN benchmark compares: the rows, the shared mesh shape and the data.

Every row fine-tunes the same pretrained model (the quality benchmark's tiny Llama: 8 layers, H = 256,
a 4,096-token BPE; ``benchmarks/quality/pretrain.py``) from the same weights on the same arithmetic
word problems (``benchmarks/quality/tasks/word_problems.py``) in the same order, with the same fast
replicas (3), pipeline stages (2), batch, lr schedule and steps; rows differ only in what crosses the
links. The rows with an anchor add the anchor replica (2 more nodes), as the paper's mesh does.

Data: the task's train pairs as the quality benchmark tokenizes them (``sft_row``: prompt + answer +
EOS, loss on the answer tokens only), right-padded to the mesh's fixed ``seq_len`` (pad = EOS, label
-100); held-out loss on the first ``n_eval_loss`` eval items, exact match on ``n_eval`` eval items.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch

from hf_meshtune._validation import require
from hf_meshtune.config import DEFAULT_DP_POWERSGD_RANK, DEFAULT_DP_QUANTIZE
from hf_meshtune.ledger import PAPER_POWERSGD_RANK


@dataclass(frozen=True)
class Row:
    label: str
    mask_ratio: float
    anchor: bool
    dp_mode: str  # streaming_diloco | allreduce | powersgd_hook
    powersgd_rank: int | None
    peer: bool = False  # a method a user would otherwise pick, not one of this library's rows
    boundary_codec: str | None = None  # MeshConfig.boundary_codec (None: masks per mask_ratio, or dense)
    anchor_payload: str = "gradient"  # MeshConfig.anchor_payload: "gradient" | "factors"
    spectral_rank: int | None = None  # MeshConfig.spectral_rank (the factors' rank r with "factors")
    sync_every: int | None = None  # MeshConfig.dp_sync_every (None: Shape.sync_every)
    outer_lr: float | None = None  # MeshConfig.dp_outer_lr (None: MeshConfig's default)
    outer_momentum: float | None = None  # MeshConfig.dp_outer_momentum (None: MeshConfig's default)
    anchor_rate_mbit: float | None = None  # MeshConfig.anchor_rate_mbit (None: the anchor link uncapped)
    # microbatches per replica step (None: Shape.microbatches), each of Shape's rows per step / microbatches
    microbatches: int | None = None
    sync_delay: int = 0  # MeshConfig.dp_sync_delay: inner steps a fragment's sync overlaps before it lands
    keep_overlapped: bool = False  # MeshConfig.dp_keep_overlapped: those steps kept on top of the new θ_global
    dp_buckets: bool = True  # False: one DiLoCo all-reduce per tensor, as before buckets (diloco.fragment.BUCKET_BYTES)
    # True: the DiLoCo sync on each node's low-priority address ($MESHTUNE_DP_HOST = netns.node_dp_ip): the links
    # send its packets only while no other packet waits (netns._shape)
    dp_low_priority: bool = False
    # MeshConfig.dp_quantize (the library's default: int8 codes on every DiLoCo all-reduce; None: float32)
    dp_quantize: str | None = DEFAULT_DP_QUANTIZE
    lr: float | None = None  # the inner optimizer's peak lr (None: Shape.lr)

    @property
    def replicas(self) -> int:
        return 4 if self.anchor else 3


# The library's DP (MeshConfig.dp_powersgd_rank, dp_quantize) for its own rows; the paper row keeps the float32
# rank this benchmark always gave it (the paper states 64x for its PowerSGD, not a rank); the PowerSGD hook peer
# keeps torch's usual small rank. The peers and the paper row send float32 (dp_quantize=None).
R_DP = DEFAULT_DP_POWERSGD_RANK
R_PAPER = PAPER_POWERSGD_RANK

ROWS: dict[str, Row] = {
    "dense": Row("Dense", 0.0, False, "allreduce", None, dp_quantize=None),
    "dp": Row("+DP", 0.0, False, "streaming_diloco", R_DP),
    "m95_ap": Row("M95+AP (paper)", 0.95, True, "streaming_diloco", R_PAPER, dp_quantize=None),
    "default": Row("Default: outliers8+int8", 0.0, False, "streaming_diloco", R_DP, boundary_codec="outliers8+int8"),
    "default_ap": Row(
        "Default+AP (factors r=8)",
        0.0,
        True,
        "streaming_diloco",
        R_DP,
        boundary_codec="outliers8+int8",
        anchor_payload="factors",
        spectral_rank=8,  # the ledger's default anchor rank (hf_meshtune.ledger.LedgerSettings.anchor_rank)
    ),
    # benchmarks/wan/anchor_pacing.py: the same with each anchor-link pair capped at a quarter of the committed
    # regime's link rate (5.194 Mbit/s)
    "default_ap_paced": Row(
        "Default+AP (factors r=8), anchor link capped at 1.3 Mbit/s",
        0.0,
        True,
        "streaming_diloco",
        R_DP,
        boundary_codec="outliers8+int8",
        anchor_payload="factors",
        spectral_rank=8,
        anchor_rate_mbit=1.3,
    ),
    "governed": Row("Governed (+anchor)", 0.0, True, "streaming_diloco", R_DP, boundary_codec="governed"),
    # the rotated int4 codec whose bytes the zstd coder shrinks further (issue 46's wire)
    "coded": Row(
        "Rotated int4, zstd: outliers8+rot+int4g64e8m0+zstd",
        0.0,
        False,
        "streaming_diloco",
        R_DP,
        boundary_codec="outliers8+rot+int4g64e8m0+zstd",
    ),
    "codec20": Row(
        "outliers8+spca32+int4", 0.0, False, "streaming_diloco", R_DP, boundary_codec="outliers8+spca32+int4"
    ),
    "torchft_diloco": Row("torchft DiLoCo", 0.0, False, "streaming_diloco", None, peer=True, dp_quantize=None),
    "powersgd_hook": Row("PowerSGD hook (DDP)", 0.0, False, "powersgd_hook", 4, peer=True, dp_quantize=None),
    "int8_dense_dp": Row(
        "int8 activations + DDP", 0.0, False, "allreduce", None, peer=True, boundary_codec="int8", dp_quantize=None
    ),
}


def _at_lr(name: str, lr: float) -> Row:
    """Row ``name`` with its inner optimizer's peak lr at ``lr`` instead of Shape.lr."""
    return replace(ROWS[name], label=f"{ROWS[name].label}, lr {lr:g}", lr=lr)


def _dp_variant(
    rank: int | None,
    sync_every: int = 20,
    outer_lr: float = 0.7,
    momentum: float = 0.9,
    quantize: str | None = None,
    lr: float | None = None,
) -> Row:
    """The default row (outliers8+int8 boundaries, no anchor) with one DP setting changed: PowerSGD rank r (None:
    uncompressed), sync period S, and the outer step: Nesterov SGD with lr η and momentum μ (MeshConfig's
    η = 0.7, μ = 0.9; η = 1, μ = 0 averages the replicas' parameters; η > 1, μ = 0 extrapolates past the
    average); ``quantize`` "int8": the pseudo-gradients that go dense go as int8 codes (MeshConfig.dp_quantize);
    ``lr``: the inner optimizer's peak lr (None: Shape.lr)."""
    outer = "η=1, μ=0 (averaging)" if (outer_lr, momentum) == (1.0, 0.0) else f"η={outer_lr:g}, μ={momentum:g}"
    return Row(
        f"S={sync_every}, r={rank or 'none'}{', ' + quantize if quantize else ''}, {outer}"
        + (f", lr {lr:g}" if lr else ""),
        0.0,
        False,
        "streaming_diloco",
        rank,
        boundary_codec="outliers8+int8",
        sync_every=sync_every,
        dp_quantize=quantize,
        lr=lr,
        **({} if (outer_lr, momentum) == (0.7, 0.9) else {"outer_lr": outer_lr, "outer_momentum": momentum}),
    )


# benchmarks/wan/dp_sweep.py: which DP sync keeps the fine-tune's quality, at what bytes (float32 unless int8)
DP_SWEEP: dict[str, Row] = {
    "dp_r4": _dp_variant(4),
    "dp_r16": _dp_variant(16),
    "dp_r32": _dp_variant(32),
    "dp_r64": _dp_variant(64),
    "dp_none": _dp_variant(None),
    # syncing more often, and other outer steps, uncompressed (the ceiling a rank can reach)
    "dp_s10_none": _dp_variant(None, 10),
    "dp_s4_none": _dp_variant(None, 4),
    "dp_none_avg": _dp_variant(None, outer_lr=1.0, momentum=0.0),
    "dp_none_x15": _dp_variant(None, outer_lr=1.5, momentum=0.0),
    # int8 codes (dp.quantize): a quarter of float32's bytes; PowerSGD's factors too, so 4x the rank for the
    # bytes of float32 factors (rank 128 in int8: the library's default)
    "dp_int8": _dp_variant(None, quantize="int8"),
    "dp_r32_int8": _dp_variant(32, quantize="int8"),
    "dp_r64_int8": _dp_variant(64, quantize="int8"),
    "dp_r128_int8": _dp_variant(128, quantize="int8"),
    # the lr is the quality benchmark's (Shape.lr), tuned for neither Dense nor DiLoCo: both at 2x, 4x and 8x it
    "dense_lr1e-3": _at_lr("dense", 1e-3),
    "dp_r128_int8_lr1e-3": _dp_variant(128, quantize="int8", lr=1e-3),
    "dense_lr2e-3": _at_lr("dense", 2e-3),
    "dp_r128_int8_lr2e-3": _dp_variant(128, quantize="int8", lr=2e-3),
    "dense_lr4e-3": _at_lr("dense", 4e-3),
    "dp_r128_int8_lr4e-3": _dp_variant(128, quantize="int8", lr=4e-3),
    # at the lr that ends both lowest (0.002), where the default's gap to Dense is widest: other outer steps and
    # syncing twice as often, the default's rank-128 int8 pseudo-gradients kept
    "dp_r128_int8_avg_lr2e-3": _dp_variant(128, outer_lr=1.0, momentum=0.0, quantize="int8", lr=2e-3),
    "dp_r128_int8_x15_lr2e-3": _dp_variant(128, outer_lr=1.5, momentum=0.0, quantize="int8", lr=2e-3),
    "dp_r128_int8_eta05_lr2e-3": _dp_variant(128, outer_lr=0.5, momentum=0.9, quantize="int8", lr=2e-3),
    "dp_r128_int8_eta1_lr2e-3": _dp_variant(128, outer_lr=1.0, momentum=0.9, quantize="int8", lr=2e-3),
    "dp_s10_r128_int8_lr2e-3": _dp_variant(128, 10, quantize="int8", lr=2e-3),
    # averaging (the best outer step above at 0.002): twice as often, and at the grid's neighbouring lrs
    "dp_s10_r128_int8_avg_lr2e-3": _dp_variant(128, 10, outer_lr=1.0, momentum=0.0, quantize="int8", lr=2e-3),
    "dp_r128_int8_avg_lr1e-3": _dp_variant(128, outer_lr=1.0, momentum=0.0, quantize="int8", lr=1e-3),
    "dp_r128_int8_avg_lr4e-3": _dp_variant(128, outer_lr=1.0, momentum=0.0, quantize="int8", lr=4e-3),
    # and with the pseudo-gradients whole (int8 codes, no PowerSGD): what rank 128 costs under averaging
    "dp_int8_avg_lr2e-3": _dp_variant(None, outer_lr=1.0, momentum=0.0, quantize="int8", lr=2e-3),
}
ROWS |= DP_SWEEP


# benchmarks/wan/equal_quality.py: the rows it trains for longer budgets, also at the lr of DP_SWEEP's grid that
# ends both Dense and the default lowest after 80 steps (0.002)
EQUAL_QUALITY_ROWS: dict[str, Row] = {f"{name}_lr2e-3": _at_lr(name, 2e-3) for name in ("default", "torchft_diloco")}
# averaging at 0.002 with each sync overlapping the next 5 inner steps (kept) at low priority on the links: what the
# throughput benchmark's default_overlap_keep_low times
_avg = DP_SWEEP["dp_r128_int8_avg_lr2e-3"]
EQUAL_QUALITY_ROWS["dp_r128_int8_avg_lr2e-3_overlap_low"] = replace(
    _avg,
    label=_avg.label + ", syncs overlap 5 steps (kept), DP at low priority",
    sync_delay=5,
    keep_overlapped=True,
    dp_low_priority=True,
)
ROWS |= EQUAL_QUALITY_ROWS


# benchmarks/wan/throughput.py: the default row with its replica step cut into more, smaller microbatches and/or
# its DiLoCo syncs overlapping 5 inner steps (of the 10 between two fragments' syncs)
def _throughput_variant(
    microbatches: int | None, sync_delay: int, keep: bool = False, buckets: bool = True, low: bool = False
) -> Row:
    parts = [
        f"{microbatches} microbatches" if microbatches else "",
        f"syncs overlap {sync_delay} steps" if sync_delay else "",
        "overlapped steps kept" if keep else "",
        "" if buckets else "one DP all-reduce per tensor",
        "DP at low priority" if low else "",
    ]
    return Row(
        "Default, " + ", ".join(p for p in parts if p),
        0.0,
        False,
        "streaming_diloco",
        R_DP,
        boundary_codec="outliers8+int8",
        microbatches=microbatches,
        sync_delay=sync_delay,
        keep_overlapped=keep,
        dp_buckets=buckets,
        dp_low_priority=low,
    )


THROUGHPUT_ROWS: dict[str, Row] = {
    "default_m4": _throughput_variant(4, 0),
    "default_m8": _throughput_variant(8, 0),
    "default_overlap": _throughput_variant(None, 5),
    "default_m8_overlap": _throughput_variant(8, 5),
    "default_overlap_keep": _throughput_variant(None, 5, keep=True),
    "default_unbucketed": _throughput_variant(None, 0, buckets=False),
    "default_low": _throughput_variant(None, 0, low=True),
    "default_overlap_keep_low": _throughput_variant(None, 5, keep=True, low=True),
}
ROWS |= THROUGHPUT_ROWS


QUALITY_EVAL_ITEMS = 200  # benchmarks/quality/run.py's Mode.n_eval: the eval split's size


@dataclass(frozen=True)
class Shape:
    """The mesh, batch and schedule every row shares (the model comes from the data file)."""

    stages: int = 2
    seq_len: int = 104  # the longest train/eval item is 99 tokens with this tokenizer
    microbatch_size: int = 4
    microbatches: int = 2
    lr: float = 5e-4  # the quality benchmark's arithmetic runs
    sync_every: int = 20
    fragments: int = 2
    anchor_every: int = 20
    n_train: int = 1000  # 120 steps x 3 replicas x 8 rows = 2.9 epochs, as the quality benchmark's 3
    n_eval: int = 100  # exact-match items: the first half of the quality benchmark's eval split (200)
    n_eval_loss: int = 64  # held-out loss items (the quality benchmark's)

    @property
    def tokens_per_replica_step(self) -> int:
        """Positions per replica step (padding included: the pipeline carries them)."""
        return self.seq_len * self.microbatch_size * self.microbatches


def build_task(shape: Shape):
    """The quality benchmark's arithmetic task (seed 0): its eval split (200 items), ``n_train`` train pairs
    after it (the quality benchmark's 400 first)."""
    from benchmarks.quality import tasks

    return tasks.arithmetic(0, shape.n_train, QUALITY_EVAL_ITEMS)


def load_pretrained():
    """(model, tokenizer) of the quality benchmark's pretrained tiny Llama (cached; pretrains on first use)."""
    from benchmarks.quality.pretrain import load_tiny_llama

    return load_tiny_llama()


def scratch_model(hidden: int = 128, layers: int = 4, vocab: int = 2048):
    """A small randomly initialised Llama and a BPE trained on the task's own text: for the tests of the
    emulated network, which check links and bytes, not quality (and must not pretrain a model first)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.quality.pretrain import _train_tokenizer

    task = build_task(Shape())
    text = "".join(f"{e.prompt}{e.answer}\n" for e in task.eval + task.train)
    tokenizer = _train_tokenizer(text, vocab)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config), tokenizer


def _padded(tokenizer, examples, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``sft_row`` of every (prompt, answer), right-padded to ``seq_len``: pad = EOS, label -100."""
    from benchmarks.quality.evaluate import sft_row

    rows = [sft_row(tokenizer, e.prompt, e.answer, 10_000) for e in examples]
    longest = max(len(r["input_ids"]) for r in rows)
    require(longest <= seq_len, "seq_len", seq_len, f"hold every item (the longest has {longest} tokens)")
    pad = tokenizer.eos_token_id
    ids = torch.tensor([r["input_ids"] + [pad] * (seq_len - len(r["input_ids"])) for r in rows])
    labels = torch.tensor([r["labels"] + [-100] * (seq_len - len(r["labels"])) for r in rows])
    return ids, labels


def prepare_data(shape: Shape, path: str, load: Callable = load_pretrained) -> dict:
    """Tokenize the task with the model's tokenizer, fix the initial weights (untied: the first and the last
    stage each train their own copy of the embeddings, as on the mesh), save the tokenizer next to ``path``."""
    from hf_meshtune.pipeline.stage import untie_embeddings

    model, tokenizer = load()
    untie_embeddings(model)
    task = build_task(shape)
    train_ids, train_labels = _padded(tokenizer, task.train, shape.seq_len)
    eval_ids, eval_labels = _padded(tokenizer, task.eval[: shape.n_eval_loss], shape.seq_len)
    tokenizer_dir = os.path.splitext(path)[0] + "_tokenizer"
    tokenizer.save_pretrained(tokenizer_dir)
    data = {
        "config": model.config.to_dict(),
        "init": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "train_ids": train_ids,
        "train_labels": train_labels,
        "eval_ids": eval_ids,
        "eval_labels": eval_labels,
        "tokenizer": tokenizer_dir,
        "vocab_size": model.config.vocab_size,
        "parameters": sum(p.numel() for p in model.parameters()),
        "shape": asdict(shape),
    }
    torch.save(data, path)
    return data


def build_model(data: dict):
    """The model of the data file, at its initial weights, fp32."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = dict(data["config"])
    config = AutoConfig.for_model(settings.pop("model_type"), **settings)
    model = AutoModelForCausalLM.from_config(config).float()
    missing, unexpected = model.load_state_dict(data["init"], strict=False)
    require(
        not unexpected and not set(missing) - {"model.rotary_emb.inv_freq"},
        "data init",
        f"missing {missing[:3]}, unexpected {unexpected[:3]}",
        "hold every weight of the model its config builds",
    )
    return model


def batches(
    ids: torch.Tensor, labels: torch.Tensor, rows: int, replica: int, replicas: int, seed: int
) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Replica ``replica``'s ``rows`` rows at step t: its share of the step's global batch, read in order from a
    fresh permutation of the train rows per epoch (a pure function of ``seed`` and the epoch), so every row of
    the benchmark sees the same examples in the same order."""
    n, orders = len(ids), {}

    def order(epoch: int) -> torch.Tensor:
        if epoch not in orders:
            orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
        return orders[epoch]

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = (step * replicas + replica) * rows
        picked = torch.stack([order(p // n)[p % n] for p in range(start, start + rows)])
        return ids[picked], labels[picked]

    return batch
