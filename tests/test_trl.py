"""TRL and PEFT on the mesh: MeshSFTTrainer, MeshGRPOTrainer (GSPO), LoRA, saved adapters and cards.

Tiny Llamas with SmolLM2's tokenizer (its chat template drives TRL's conversational formats).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from transformers import AutoTokenizer

from hf_meshtune import (
    MeshGRPOTrainer,
    MeshGSPOConfig,
    MeshSFTConfig,
    MeshSFTTrainer,
    MeshTrainer,
    MeshTrainingArguments,
)
from hf_meshtune.apps.arithmetic import exact_answer_reward, extract_answer, problems, prompt_dataset, sft_dataset
from hf_meshtune.apps.assets import smollm2_checkpoint
from hf_meshtune.boundary.masking import BoundaryMask
from tests.tiny import make_tiny_causal_lm, pattern_dataset

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MESH = dict(preset="paper", num_stages=2, anchor_every=1, anchor_delay=1, num_replicas=3)
COMMON = dict(use_cpu=True, bf16=False, report_to="none", logging_steps=1, save_strategy="no", seed=0)


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_checkpoint())


def tiny(tokenizer, seed: int = 0):
    return make_tiny_causal_lm(
        "llama",
        hidden=32,
        layers=4,
        seed=seed,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def lora(**kwargs):
    from peft import LoraConfig

    return LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], task_type="CAUSAL_LM", **kwargs
    )


def length_reward(completions, **kwargs) -> list[float]:
    """A reward with spread on a random model (exact answers would all score 0): completion length."""
    return [float(len(c[0]["content"])) for c in completions]


def sft(tokenizer, out, peft_config=None, steps: int = 3, **knobs):
    args = MeshSFTConfig(
        str(out), max_steps=steps, per_device_train_batch_size=4, learning_rate=1e-3, **{**COMMON, **MESH, **knobs}
    )
    return MeshSFTTrainer(
        model=tiny(tokenizer),
        args=args,
        train_dataset=sft_dataset(32),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


def grpo(tokenizer, out, model=None, peft_config=None, reward=length_reward, **knobs):
    args = MeshGSPOConfig(
        str(out),
        max_steps=2,
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=8,
        learning_rate=1e-3,
        **{**COMMON, **MESH, **knobs},
    )
    return MeshGRPOTrainer(
        model=model if model is not None else tiny(tokenizer),
        reward_funcs=reward,
        args=args,
        train_dataset=prompt_dataset(16),
        processing_class=tokenizer,
        peft_config=peft_config,
    )


# --- the arithmetic task ------------------------------------------------------------------------


def test_arithmetic_problems_are_exact_and_the_reward_reads_the_last_integer():
    items = problems(50, seed=3, max_operand=30, operators="+-*")
    for item in items:
        a, op, b = item["question"].removeprefix("What is ").split("?")[0].split()
        assert int(item["answer"]) == eval(f"{a}{op}{b}")  # noqa: S307 - our own digits and operator
    assert problems(5, seed=3) == problems(5, seed=3) and problems(5, seed=3) != problems(5, seed=4)
    assert extract_answer("3 + 4 = 7. The answer is 1,234.") == "1234" and extract_answer("none") is None
    completions = [
        [{"role": "assistant", "content": "The answer is 12."}],
        [{"role": "assistant", "content": "12 + 1 = 13"}],
        "-5",
    ]
    assert exact_answer_reward(completions, answer=["12", "12", "-5"]) == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="operators='/' is invalid"):
        problems(3, operators="/")


class _Scripted(torch.nn.Module):
    """A "model" whose greedy generation is a scripted reply per prompt, in order (for scoring tests)."""

    def __init__(self, tokenizer, replies: list[str]) -> None:
        super().__init__()
        self.tokenizer, self.replies, self.prompts = tokenizer, iter(replies), []
        self.anchor = torch.nn.Parameter(torch.zeros(1))

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    def generate(self, input_ids, attention_mask, max_new_tokens, do_sample, pad_token_id):
        assert not self.training and not do_sample and self.tokenizer.padding_side == "left"
        self.prompts += self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
        replies = [self.tokenizer(next(self.replies), add_special_tokens=False)["input_ids"] for _ in input_ids]
        width = max(map(len, replies))
        tail = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in replies])
        return torch.cat([input_ids, tail], dim=1)


def test_exact_match_scores_each_greedy_answer_against_its_own_problem(tokenizer):
    """3 of 5 right, over batches of 2: 0.6; the model is left as it was (training mode, padding side)."""
    from hf_meshtune.apps.arithmetic import exact_match

    items = problems(5, seed=1)
    assert len({p["answer"] for p in items}) == 5  # distinct: a reply scored against another item shows
    right = {0, 2, 3}
    replies = [f"It is {int(p['answer']) + (0 if i in right else 1000)}." for i, p in enumerate(items)]
    model = _Scripted(tokenizer, replies).train()
    assert exact_match(model, tokenizer, items, batch_size=2) == 3 / 5
    assert model.training and tokenizer.padding_side == "right"
    assert [p["question"] in prompt for p, prompt in zip(items, model.prompts)] == [True] * 5


# --- SFT ------------------------------------------------------------------------------------


def test_mesh_sft_trains_through_masked_boundaries_and_logs_the_mesh(tokenizer, tmp_path):
    trainer = sft(tokenizer, tmp_path / "sft")
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 3 and all(math.isfinite(e["loss"]) for e in logs)
    assert logs[0]["comm/pp_fwd_bytes_per_token"] == 2 * 4  # K = round(0.05·32) = 2 fp32 values, one boundary
    assert logs[-1]["anchor/staleness_steps"] == 1 and "spectral/cos_filtered_vs_anchor" in logs[-1]
    assert trainer.mesh_boundaries.masks and trainer.spectral_optimizer is not None
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_mesh_sft_with_the_mask_off_is_trl_sft_exactly_and_the_anchor_does_not_touch_its_metrics(tokenizer, tmp_path):
    from trl import SFTConfig, SFTTrainer

    plain_args = SFTConfig(
        str(tmp_path / "plain"),
        max_steps=3,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        optim="adamw_torch",
        **COMMON,
    )
    plain = SFTTrainer(
        model=tiny(tokenizer), args=plain_args, train_dataset=sft_dataset(32), processing_class=tokenizer
    )
    plain.train()
    off = sft(tokenizer, tmp_path / "off", mask_ratio=0.0, anchor=False, optim="adamw_torch")
    off.train()
    for (name, p), q in zip(plain.model.named_parameters(), off.model.parameters()):
        assert torch.equal(p, q), name
    masked = sft(tokenizer, tmp_path / "masked")  # anchor every step: its dense passes are not training tokens
    masked.train()
    assert masked._total_train_tokens == off._total_train_tokens
    assert [e.get("num_tokens") for e in masked.state.log_history] == [
        e.get("num_tokens") for e in off.state.log_history
    ]
    assert not torch.equal(next(masked.model.parameters()), next(off.model.parameters()))


def test_lora_sft_filters_the_lora_matrices_and_saves_a_plain_peft_adapter(tokenizer, tmp_path):
    from peft import PeftModel

    out = tmp_path / "lora"
    trainer = sft(tokenizer, out, peft_config=lora())
    trainer.train()
    trainable = {n for n, p in trainer.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert set(trainer.mesh_anchor.params) == trainable  # the anchor sends only trainable matrices
    optimizer = trainer.spectral_optimizer
    filtered = [p for p in trainer.mesh_anchor.params.values() if "anchor_momentum" in optimizer.state[p]]
    assert len(filtered) == len(trainable)
    shapes = {tuple(p.shape) for p in filtered}
    assert {(4, 32), (4, 64), (32, 4), (16, 4)} == shapes  # lora_A [r, in], lora_B [out, r] of q/v/down_proj
    assert trainer.state.log_history[0]["comm/pp_fwd_bytes_per_token"] == 8  # LoRA does not shrink the payload
    trainer.save_model()
    base = tiny(tokenizer)
    loaded = PeftModel.from_pretrained(base, str(out))
    trained = {n: p for n, p in trainer.model.named_parameters() if p.requires_grad}
    for name, param in loaded.named_parameters():
        if "lora_" in name:
            assert torch.equal(param, trained[name]), name
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    card = (out / "README.md").read_text()
    assert "hf_meshtune" in card and "## Trained with hf_meshtune" in card and card.count("hf_meshtune:begin") == 1
    trainer.save_model()  # a second save replaces the section instead of adding another
    assert (out / "README.md").read_text().count("hf_meshtune:begin") == 1


def test_peft_methods_without_weight_matrices_are_refused_with_the_spectral_optimizer(tokenizer, tmp_path):
    from peft import IA3Config

    ia3 = IA3Config(target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"], task_type="CAUSAL_LM")
    with pytest.raises(
        ValueError, match=r"peft_config\['default'\].peft_type='IA3' is invalid: it must be one of \['LORA'\]"
    ):
        sft(tokenizer, tmp_path / "ia3", peft_config=ia3)
    trainer = sft(tokenizer, tmp_path / "ia3-adamw", peft_config=ia3, optim="adamw_torch", anchor=False)
    assert trainer.mesh_boundaries.masks  # another optimizer: the boundaries still compress


def test_trl_configs_are_refused_where_the_mesh_config_is_needed(tokenizer, tmp_path):
    from trl import SFTConfig

    with pytest.raises(ValueError, match="spectral_adamw"):
        SFTConfig(str(tmp_path), optim="spectral_adamw", **COMMON)
    with pytest.raises(ValueError, match="args='SFTConfig' is invalid: it must be a MeshSFTConfig for MeshSFTTrainer"):
        MeshSFTTrainer(
            model=tiny(tokenizer),
            args=SFTConfig(str(tmp_path), **COMMON),
            train_dataset=sft_dataset(8),
            processing_class=tokenizer,
        )
    with pytest.raises(ValueError, match="args='MeshTrainingArguments' is invalid: it must be a MeshGRPOConfig"):
        MeshGRPOTrainer(
            model=tiny(tokenizer),
            reward_funcs=length_reward,
            args=MeshTrainingArguments(str(tmp_path), **COMMON),
            train_dataset=prompt_dataset(8),
            processing_class=tokenizer,
        )


def test_meshtrainer_takes_peft_config_too(tokenizer, tmp_path):
    args = MeshTrainingArguments(str(tmp_path / "mt"), max_steps=2, per_device_train_batch_size=4, **{**COMMON, **MESH})
    model = make_tiny_causal_lm("llama", hidden=32, layers=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    trainer = MeshTrainer(model=model, args=args, train_dataset=pattern_dataset(16), peft_config=lora())
    trainer.train()
    assert all("lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad)
    assert trainer.state.log_history[0]["comm/pp_fwd_bytes_per_token"] == 8


# --- GRPO / GSPO ------------------------------------------------------------------------------


def test_gspo_trains_the_masked_policy_while_generation_stays_dense(tokenizer, tmp_path, monkeypatch):
    applied, forwards = [], []
    original = BoundaryMask.apply

    def spy(self, hidden, step, microbatch):
        applied.append(torch.is_grad_enabled())
        return original(self, hidden, step, microbatch)

    monkeypatch.setattr(BoundaryMask, "apply", spy)
    trainer = grpo(tokenizer, tmp_path / "gspo")
    assert trainer.args.importance_sampling_level == "sequence" and trainer.args.loss_type == "grpo"
    trainer.model.register_forward_pre_hook(lambda module, args: forwards.append(torch.is_grad_enabled()))
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    dense_forwards = forwards.count(False)  # generation (one forward per new token) and π_ref/π_old: no_grad
    assert dense_forwards >= 8 and applied and all(applied)  # masks ran only on grad-enabled training forwards
    assert len(applied) == forwards.count(True) - trainer.mesh_anchor.rounds_done  # anchor passes are dense
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert len(logs) == 2 and logs[0]["comm/pp_fwd_bytes_per_token"] == 8 and "reward" in logs[0]
    assert logs[0]["clip_ratio/region_mean"] == 0.0  # π_old is the detached masked forward: ratio 1
    assert logs[-1]["anchor/staleness_steps"] == 1
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_the_gspo_anchor_gradient_is_the_dense_gradient_of_the_loss_on_the_rollouts(tokenizer, tmp_path):
    trainer = grpo(tokenizer, tmp_path / "anchor", anchor_delay=5)
    trainer.train()  # 2 steps; both rounds are still pending (Δ = 5)
    (_, pending) = trainer.mesh_anchor.pending
    rollouts = trainer._buffered_inputs
    model = trainer.model
    names = list(trainer.mesh_anchor.params)
    grads = dict.fromkeys(names)
    with trainer.mesh_boundaries.disabled():
        for batch in rollouts:
            loss = trainer.compute_loss(model, batch) / len(rollouts)
            for name, grad in zip(names, torch.autograd.grad(loss, [trainer.mesh_anchor.params[n] for n in names])):
                grads[name] = grad if grads[name] is None else grads[name] + grad
    recomputed = trainer.mesh_anchor.dense_gradient(1)  # round 1 = the snapshot at step 1: the same rollouts
    for name in names:
        torch.testing.assert_close(recomputed[name], grads[name], rtol=1e-5, atol=1e-7)
    assert pending.snapshot_step == 1 and set(pending.grads) == set(names)


def test_gspo_fits_a_composed_codec_on_the_first_prompts_and_trains_through_it(tokenizer, tmp_path):
    """Before any rollout, the codec's outlier dims and mean are fitted on a dense forward of the first
    training prompts as TRL renders them: the same geometry as a fit on those prompts done here (with
    ``codec_refit_every=0`` it is still the one after training). With the default refit the anchor's
    rounds on the rollouts replace it."""
    from hf_meshtune.boundary.compose.codec import ComposedCodec, geometry_digest
    from hf_meshtune.boundary.compose.grammar import parse_codec
    from hf_meshtune.trl_trainers import CALIBRATION_PROMPTS

    trainer = grpo(tokenizer, tmp_path / "codec", boundary_codec="outliers2+spca8+int4", codec_refit_every=0)
    batch = trainer._prompt_batch()
    assert batch["input_ids"].shape[0] == min(CALIBRATION_PROMPTS, len(trainer.train_dataset))
    text = tokenizer.decode(batch["input_ids"][0][batch["attention_mask"][0].bool()])
    assert text.startswith("<|im_start|>") and text.rstrip().endswith("<|im_start|>assistant")  # the chat prompt
    reference = ComposedCodec(parse_codec("outliers2+spca8+int4"), 0, 32)
    reference.fit(trainer.mesh_boundaries.dense_boundary_tokens(trainer.model, batch)[0])
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    fitted = trainer.mesh_boundaries.codecs[0].geometry()
    for name, value in reference.geometry().items():
        assert torch.equal(fitted[name].cpu(), value.cpu()), name
    logs = [e for e in trainer.state.log_history if "loss" in e]
    # the record of a real token (fp32 outliers, a bf16 scale, packed codes), not padded to fp32 words
    assert logs and logs[0]["comm/measured_pp_fwd_bytes_per_token"] == parse_codec(
        "outliers2+spca8+int4"
    ).message_bytes(32, 4)
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    refitted = grpo(tokenizer, tmp_path / "refit", boundary_codec="outliers2+spca8+int4")
    refitted.train()
    assert [e["anchor/codec_refits"] for e in refitted.state.log_history if "loss" in e] == [0.0, 1.0]
    assert geometry_digest(refitted.mesh_boundaries.codecs[0].geometry()) != geometry_digest(reference.geometry())


def test_gspo_with_lora_saves_an_adapter_and_uses_the_disabled_adapter_as_reference(tokenizer, tmp_path):
    from peft import PeftModel

    out = tmp_path / "gspo-lora"
    trainer = grpo(tokenizer, out, peft_config=lora(), beta=0.04)
    assert trainer.ref_model is None  # TRL: the reference is the base model with the adapter disabled
    trainer.train()
    assert all("kl" in e for e in trainer.state.log_history if "loss" in e)
    trainer.save_model()
    PeftModel.from_pretrained(tiny(tokenizer), str(out))
    assert "## Trained with hf_meshtune" in (out / "README.md").read_text()


def test_grpo_settings_that_mix_dense_and_masked_policies_are_refused(tokenizer, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"gradient_accumulation_steps=2 is invalid: it must be a multiple of "
        r"steps_per_generation·num_iterations = 4",
    ):
        MeshGSPOConfig(
            str(tmp_path),
            per_device_train_batch_size=4,
            num_generations=4,
            gradient_accumulation_steps=2,
            steps_per_generation=4,
            **COMMON,
        )
    MeshGSPOConfig(
        str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        steps_per_generation=4,
        mask_ratio=0.0,
        anchor=False,
        **COMMON,
    )  # dense policy: TRL's own rule
    with pytest.raises(ValueError, match="generation_batch_size .* must be divisible by num_generations"):
        MeshGSPOConfig(str(tmp_path), per_device_train_batch_size=4, num_generations=3, **COMMON)  # TRL's check
    with pytest.raises(ValueError, match="mask_protect_dims=4 is invalid"):
        MeshGSPOConfig(str(tmp_path), per_device_train_batch_size=4, num_generations=4, mask_protect_dims=4, **COMMON)


def test_the_gspo_anchor_refuses_to_run_before_any_rollout_exists(tokenizer, tmp_path):
    trainer = grpo(tokenizer, tmp_path / "early")
    trainer.create_optimizer()  # builds the anchor, as train() does
    with pytest.raises(
        ValueError, match=r"anchor rollouts=None is invalid: it must exist before the first optimizer step"
    ):
        trainer.mesh_anchor.dense_gradient(0)


def test_mesh_sft_gives_every_row_its_index_so_a_second_epoch_sends_only_changes(tokenizer, tmp_path):
    """TRL's SFT collator never sees the row ids (the wrapper takes them out and puts them back): 8 rows,
    4 per step, so steps 3-4 revisit every row of steps 1-2 and send the change codec's messages."""
    knobs = dict(preset="quality", mask_ratio=None, anchor=False, optim="adamw_torch", num_replicas=1)
    knobs.update(boundary_codec="outliers2+int4g15", boundary_change_codec="rot+delta4g16+zstd")
    args = MeshSFTConfig(
        str(tmp_path / "sft"), max_steps=4, per_device_train_batch_size=4, **{**COMMON, **MESH, **knobs}
    )
    trainer = MeshSFTTrainer(model=tiny(tokenizer), args=args, train_dataset=sft_dataset(8), processing_class=tokenizer)
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e]
    assert [e["change/revisit_fraction"] for e in logs] == [0.0, 0.0, 1.0, 1.0]
    assert logs[-1]["change/fwd_bytes_per_token"] == logs[-1]["comm/measured_pp_fwd_bytes_per_token"] > 0
    assert sorted(trainer.mesh_boundaries.caches[0].rows) == list(range(8))
