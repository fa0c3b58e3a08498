"""Tests of hook-based pipeline boundaries on unmodified HF causal LMs (hf_meshtune.boundary.hooks,
docs/design.md): layer discovery, stage split, equivalence with a hand-masked reference, dense
eval/generate/save, payload counting and validation."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from hf_meshtune.boundary.hooks import attach_boundaries, find_decoder_layers, split_stages
from hf_meshtune.boundary.masking import keep_indices

pytestmark = pytest.mark.usefixtures("single_thread_torch")

VOCAB = 100  # the vocabulary of conftest's tiny_causal_lm models

EXPECTED_LAYERS_NAME = {
    "llama": "model.layers",
    "qwen2": "model.layers",
    "mistral": "model.layers",
    "gemma": "model.layers",
    "phi3": "model.layers",
    "gpt2": "transformer.h",
    "gpt_neox": "gpt_neox.layers",
}
ARCHS = tuple(EXPECTED_LAYERS_NAME)


def token_batch(batch: int = 2, seq: int = 6, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training forward + backward from zeroed gradients."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def zero_one_mask(
    boundary: int, step: int, microbatch: int, seq: int, hidden: int, keep: int, seed: int
) -> torch.Tensor:
    m = torch.zeros(seq, hidden, dtype=torch.float64)
    idx = keep_indices(boundary, step, microbatch, seq, hidden, keep, seed)
    m[torch.arange(seq)[:, None], idx] = 1.0
    return m


@contextlib.contextmanager
def hand_masked(model: nn.Module, masks_by_layer: dict[int, torch.Tensor]) -> Iterator[None]:
    """The paper's h̃ = h ⊙ m written plainly: multiply the output of each boundary layer by its 0/1 mask."""

    def multiply(mask):
        def hook(module, args, output):
            if isinstance(output, tuple):
                return (output[0] * mask.to(output[0].dtype), *output[1:])
            return output * mask.to(output.dtype)

        return hook

    layers = model.model.layers
    hooks = [layers[i].register_forward_hook(multiply(m)) for i, m in masks_by_layer.items()]
    try:
        yield
    finally:
        for hook in hooks:
            hook.remove()


def reference_loss_and_grads(model, ids, masks_by_layer):
    with hand_masked(model, masks_by_layer):
        return loss_and_grads(model, ids)


def reference_loss(model, ids, masks_by_layer) -> torch.Tensor:
    with hand_masked(model, masks_by_layer), torch.no_grad():
        return model(input_ids=ids, labels=ids).loss


# ---------------------------------------------------------------------------------------------
# find_decoder_layers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_find_decoder_layers(arch, tiny_causal_lm):
    model = tiny_causal_lm(arch, layers=3)
    name, layers = find_decoder_layers(model)
    assert name == EXPECTED_LAYERS_NAME[arch]
    assert layers is model.get_submodule(name)
    assert len(layers) == 3


def test_find_decoder_layers_through_peft(tiny_causal_lm):
    import peft

    model = tiny_causal_lm("llama")
    inner = model.model.layers
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    name, layers = find_decoder_layers(wrapped)
    assert name == "base_model.model.model.layers"
    assert layers is inner


def test_peft_model_trains_through_boundaries(tiny_causal_lm):
    import peft

    model = tiny_causal_lm("llama")
    wrapped = peft.get_peft_model(
        model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    )
    names = [n for n, _ in wrapped.named_parameters()]
    handle = attach_boundaries(wrapped, num_stages=2, mask_ratio=0.75)
    assert [n for n, _ in wrapped.named_parameters()] == names
    handle.set_step(0)
    ids = token_batch()
    masked, grads = loss_and_grads(wrapped, ids)
    assert handle.microbatch == 0 and handle.counter.fwd_bytes > 0
    with handle.disabled():
        dense, _ = loss_and_grads(wrapped, ids)
    assert not torch.isclose(masked, dense)
    lora_b = [g for n, g in grads.items() if "lora_B" in n]
    assert len(lora_b) == 8 and all(bool(g.abs().sum() > 0) for g in lora_b)  # q, v × 4 layers
    assert all("lora_" in n for n in grads)  # the base stays frozen


@pytest.mark.parametrize(
    "module",
    [nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.ModuleDict({"blocks": nn.ModuleList([nn.Linear(4, 4)])})],
    ids=["sequential", "module_list"],
)
def test_find_decoder_layers_rejects_non_hf_models(module):
    with pytest.raises(ValueError, match=rf"model={type(module).__name__} is invalid: .*_no_split_modules"):
        find_decoder_layers(module)


# ---------------------------------------------------------------------------------------------
# split_stages
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_layers, num_stages", [(1, 1), (4, 1), (4, 2), (4, 3), (4, 4), (7, 3), (10, 4), (16, 5), (30, 7)]
)
def test_split_stages_balanced_and_contiguous(num_layers, num_stages):
    stages = split_stages(num_layers, num_stages)
    assert len(stages) == num_stages
    assert [i for stage in stages for i in stage] == list(range(num_layers))  # contiguous, covers all, in order
    sizes = [len(stage) for stage in stages]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    assert sizes == sorted(sizes, reverse=True)  # earlier stages take the extra layer


def test_split_stages_by_hand():
    assert split_stages(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert split_stages(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]


@pytest.mark.parametrize("num_stages, shown", [(0, "num_stages=0"), (5, "num_stages=5"), (-1, "num_stages=-1")])
def test_split_stages_rejects(num_stages, shown):
    with pytest.raises(ValueError, match=shown):
        split_stages(4, num_stages)


# ---------------------------------------------------------------------------------------------
# Equivalence with a hand-masked reference (single process)
# ---------------------------------------------------------------------------------------------

H, KEEP, SEED = 32, 8, 3  # p = 0.75 at H = 32 → K = 8


def test_masked_forward_backward_matches_reference(tiny_causal_lm):
    model = tiny_causal_lm("llama", layers=4).double()
    ids = token_batch(seq=6)
    seq = ids.shape[1]
    handle = attach_boundaries(model, num_stages=3, mask_ratio=0.75, seed=SEED)
    assert handle.boundary_layers == [1, 2] and handle.keep == KEEP
    handle.set_step(5)
    loss, grads = loss_and_grads(model, ids)
    handle.remove()

    masks = {1: zero_one_mask(0, 5, 0, seq, H, KEEP, SEED), 2: zero_one_mask(1, 5, 0, seq, H, KEEP, SEED)}
    ref_loss, ref_grads = reference_loss_and_grads(model, ids, masks)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    assert grads.keys() == ref_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-10, atol=1e-13, msg=name)

    # The reference is sharp: the dense model and a mix-up of the two boundaries' masks both differ.
    dense_loss, _ = loss_and_grads(model, ids)
    swapped, _ = reference_loss_and_grads(model, ids, {1: masks[2], 2: masks[1]})
    assert abs(float(loss - dense_loss)) > 1e-4
    assert abs(float(loss - swapped)) > 1e-6


def test_microbatch_and_step_indexing(tiny_causal_lm):
    model = tiny_causal_lm("llama", layers=4).double()
    ids = token_batch(seq=6)
    seq = ids.shape[1]
    handle = attach_boundaries(model, num_stages=3, mask_ratio=0.75, seed=SEED)
    seen = []
    handle.set_step(5)
    seen.append(model(input_ids=ids, labels=ids).loss.detach())  # step 5, microbatch 0
    seen.append(model(input_ids=ids, labels=ids).loss.detach())  # step 5, microbatch 1
    assert handle.microbatch == 1
    handle.set_step(6)
    model.eval()
    model(input_ids=ids)  # an eval forward takes no microbatch index
    model.train()
    with torch.no_grad():
        model(input_ids=ids)  # neither does a no-grad forward in training mode (e.g. a rollout)
    seen.append(model(input_ids=ids, labels=ids).loss.detach())  # step 6, microbatch 0
    assert handle.microbatch == 0
    handle.remove()

    def expected(step, microbatch):
        masks = {1 + b: zero_one_mask(b, step, microbatch, seq, H, KEEP, SEED) for b in range(2)}
        return reference_loss(model, ids, masks)

    for got, (step, microbatch) in zip(seen, [(5, 0), (5, 1), (6, 0)]):
        torch.testing.assert_close(got, expected(step, microbatch), rtol=1e-12, atol=0)
    assert not torch.isclose(seen[0], seen[1])


def test_single_stage_attaches_no_mask(tiny_causal_lm):
    model = tiny_causal_lm("llama")
    ids = token_batch()
    dense = model(input_ids=ids).logits
    handle = attach_boundaries(model, num_stages=1, mask_ratio=0.75)
    assert handle.masks == [] and handle.boundary_layers == []
    assert torch.equal(model(input_ids=ids).logits, dense)


# ---------------------------------------------------------------------------------------------
# Dense paths: eval, disabled(), remove(), save/load, generate
# ---------------------------------------------------------------------------------------------


def test_eval_disabled_and_remove_are_dense(tiny_causal_lm):
    model = tiny_causal_lm("llama")
    ids = token_batch()

    def logits() -> torch.Tensor:
        return model(input_ids=ids).logits.detach()

    dense_train = logits()
    model.eval()
    dense_eval = logits()
    handle = attach_boundaries(model, num_stages=3, mask_ratio=0.75)
    handle.set_step(1)
    assert torch.equal(logits(), dense_eval)
    model.train()
    assert not torch.allclose(logits(), dense_train)  # masks do act on training forwards
    with torch.no_grad():
        assert torch.equal(logits(), dense_train)  # a forward that cannot backpropagate is dense
    with handle.disabled():
        assert torch.equal(logits(), dense_train)
    assert handle.enabled
    handle.remove()
    assert torch.equal(logits(), dense_train)


def test_names_state_dict_and_save_pretrained_unchanged(tiny_causal_lm, tmp_path):
    model = tiny_causal_lm("llama")
    ids = token_batch()
    names = [n for n, _ in model.named_parameters()]
    keys = list(model.state_dict())
    handle = attach_boundaries(model, num_stages=3, mask_ratio=0.75)
    assert [n for n, _ in model.named_parameters()] == names
    assert list(model.state_dict()) == keys

    handle.set_step(0)
    loss_and_grads(model, ids)  # a masked training step has run on the hooked model
    model.save_pretrained(tmp_path)
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    model.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, model(input_ids=ids).logits)


def test_generate_is_dense(tiny_causal_lm):
    model = tiny_causal_lm("llama").eval()
    ids = token_batch(seq=4)
    settings = dict(max_new_tokens=5, do_sample=False, attention_mask=torch.ones_like(ids))
    dense = model.generate(ids, **settings)
    handle = attach_boundaries(model, num_stages=3, mask_ratio=0.75)
    handle.set_step(0)
    assert torch.equal(model.generate(ids, **settings), dense)
    model.train()  # RL rollouts generate from a model left in training mode: still dense
    assert torch.equal(model.generate(ids, **settings), dense)
    with handle.disabled():
        assert torch.equal(model.generate(ids, **settings), dense)
    assert handle.microbatch == -1 and handle.counter.fwd_bytes == 0  # generation consumed nothing


# ---------------------------------------------------------------------------------------------
# Payload counter
# ---------------------------------------------------------------------------------------------


def test_payload_counter_counts_compact_payloads(tiny_causal_lm):
    model = tiny_causal_lm("llama")
    batch, seq = 2, 5
    ids = token_batch(batch, seq)
    handle = attach_boundaries(model, num_stages=3, mask_ratio=0.75)
    handle.set_step(0)
    loss_and_grads(model, ids)
    expected = 2 * batch * seq * KEEP * 4  # 2 boundaries, float32
    assert (handle.counter.fwd_bytes, handle.counter.bwd_bytes, handle.counter.tokens) == (
        expected,
        expected,
        batch * seq,
    )

    # neither eval nor a disabled (anchor) forward sends anything
    with torch.no_grad():
        with handle.disabled():
            model(input_ids=ids)
        model.eval()
        model(input_ids=ids)
    assert (handle.counter.fwd_bytes, handle.counter.tokens) == (expected, batch * seq)
    handle.counter.reset()
    assert (handle.counter.fwd_bytes, handle.counter.bwd_bytes, handle.counter.tokens) == (0, 0, 0)


def test_payload_counter_at_zero_ratio_counts_the_dense_state(tiny_causal_lm):
    """p = 0 (K = H) leaves the model dense, but a pipeline still sends [B, T, H] each way."""
    model = tiny_causal_lm("llama")
    batch, seq = 2, 5
    ids = token_batch(batch, seq)
    dense, dense_grads = loss_and_grads(model, ids)
    handle = attach_boundaries(model, num_stages=3, mask_ratio=0.0)
    handle.set_step(0)
    loss, grads = loss_and_grads(model, ids)
    assert torch.equal(loss, dense) and all(torch.equal(grads[n], dense_grads[n]) for n in grads)
    expected = 2 * batch * seq * H * 4
    assert (handle.counter.fwd_bytes, handle.counter.bwd_bytes, handle.counter.tokens) == (
        expected,
        expected,
        batch * seq,
    )


# ---------------------------------------------------------------------------------------------
# Every architecture through attach + masked training step
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHS)
def test_masked_training_step_on_every_architecture(arch, tiny_causal_lm):
    model = tiny_causal_lm(arch)
    ids = token_batch()
    handle = attach_boundaries(model, num_stages=3, mask_ratio=0.75)
    handle.set_step(0)
    loss, grads = loss_and_grads(model, ids)
    assert math.isfinite(float(loss))
    assert handle.counter.fwd_bytes == 2 * ids.numel() * KEEP * 4
    assert handle.counter.bwd_bytes == handle.counter.fwd_bytes
    with handle.disabled():
        dense, _ = loss_and_grads(model, ids)
    assert not torch.isclose(loss, dense)

    _, layers = find_decoder_layers(model)
    for i, layer in enumerate(layers):
        for name, param in layer.named_parameters():
            assert param.grad is not None, f"layer {i}: {name} has no grad"
            assert torch.isfinite(param.grad).all(), f"layer {i}: {name}"
        assert any(bool(p.grad.abs().sum() > 0) for p in layer.parameters()), f"layer {i} got a zero gradient"


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


def test_attach_rejects_unknown_fill(tiny_causal_lm):
    with pytest.raises(ValueError, match="mask_fill='bogus'"):
        attach_boundaries(tiny_causal_lm("llama"), num_stages=2, fill="bogus")


def test_attach_rejects_ratio_that_keeps_nothing(tiny_causal_lm):
    model = tiny_causal_lm("llama", hidden=8)  # K = round(0.05 · 8) = 0
    with pytest.raises(ValueError, match=r"mask_ratio=0\.95 is invalid: .*hidden_size=8"):
        attach_boundaries(model, num_stages=2, mask_ratio=0.95)


def test_attach_rejects_more_stages_than_layers(tiny_causal_lm):
    with pytest.raises(ValueError, match="num_stages=5"):
        attach_boundaries(tiny_causal_lm("llama", layers=4), num_stages=5)


def test_mean_fill_advances_once_per_step(tiny_causal_lm):
    model = tiny_causal_lm("llama")
    ids = token_batch()
    handle = attach_boundaries(model, num_stages=2, mask_ratio=0.75, fill="mean")
    fill = handle.masks[0].fill
    handle.set_step(0)
    model(input_ids=ids)
    assert fill.value(H) is None  # the step is not finished
    handle.set_step(0)  # same step again: nothing folded
    assert fill.value(H) is None
    handle.set_step(1)
    first = fill.value(H)
    assert first is not None and first.shape == (H,) and bool(first.abs().sum() > 0)
    state = handle.state_dict()
    handle.set_step(2)  # no forward in step 1: nothing new to fold
    assert torch.equal(fill.value(H), first)
    handle.load_state_dict(state)
    assert handle.step == 1 and handle.microbatch == -1


def test_attach_rejects_rescale_with_mean_fill(tiny_causal_lm):
    with pytest.raises(ValueError, match="mask_fill='mean' is invalid: it must be 'zeros' when mask_rescale=True"):
        attach_boundaries(tiny_causal_lm("llama"), num_stages=2, mask_ratio=0.75, rescale=True, fill="mean")


@pytest.mark.parametrize("checkpointing", [{"use_reentrant": True}, {"use_reentrant": False}])
def test_gradient_checkpointing_keeps_masked_numerics_and_counts(tiny_causal_lm, checkpointing):
    """A recompute must see the same masks (and a reentrant no-grad first pass must still mask)."""
    ids = token_batch(seq=6)
    results = []
    for enable in (False, True):
        model = tiny_causal_lm("llama")
        if enable:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        handle = attach_boundaries(model, num_stages=3, mask_ratio=0.75)
        handle.set_step(2)
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        grads = [p.grad.clone() for p in model.parameters()]
        results.append((loss.detach(), grads, handle.counter.fwd_bytes, handle.counter.bwd_bytes))
    (loss0, grads0, fwd0, bwd0), (loss1, grads1, fwd1, bwd1) = results
    torch.testing.assert_close(loss1, loss0, rtol=0, atol=0)
    for g0, g1 in zip(grads0, grads1):
        torch.testing.assert_close(g1, g0, rtol=1e-6, atol=1e-7)
    assert (fwd1, bwd1) == (fwd0, bwd0)


def test_protect_largest_dims_keeps_the_dims_of_largest_rms(tiny_causal_lm):
    model = tiny_causal_lm("llama", layers=4)
    ids = token_batch(seq=6)
    handle = attach_boundaries(model, num_stages=3, mask_ratio=0.75)
    # reference RMS of each boundary layer's output in a plain dense forward
    squares = {}
    layers = model.model.layers
    hooks = [
        layers[i].register_forward_hook(lambda m, a, out, b=b: squares.__setitem__(b, out.detach().pow(2).mean((0, 1))))
        for b, i in enumerate(handle.boundary_layers)
    ]
    with torch.no_grad():
        model(input_ids=ids)
    for hook in hooks:
        hook.remove()
    chosen = handle.protect_largest_dims(model, {"input_ids": ids}, count=3)
    for b, dims in enumerate(chosen):
        assert dims == sorted(squares[b].topk(3).indices.tolist())
    handle.set_step(4)
    for mask in handle.masks:
        idx = mask.indices(4, 0, 6, 32)
        for dim in mask.protected.tolist():
            assert bool((idx == dim).any(-1).all())
    state = handle.state_dict()
    other = attach_boundaries(tiny_causal_lm("llama", layers=4), num_stages=3, mask_ratio=0.75)
    other.load_state_dict(state)
    assert [m.protected.tolist() for m in other.masks] == chosen
    with pytest.raises(ValueError, match="mask_protect_dims=8 is invalid: it must be < K=8"):
        handle.protect_largest_dims(model, {"input_ids": ids}, count=8)


def test_protect_largest_dims_leaves_the_global_rng_alone(tiny_causal_lm):
    model = tiny_causal_lm("gpt2", embd_pdrop=0.1)  # dropout draws from the RNG in train mode
    handle = attach_boundaries(model, num_stages=2, mask_ratio=0.75)
    state = torch.get_rng_state()
    handle.protect_largest_dims(model, {"input_ids": token_batch(seq=6)}, count=2)
    assert torch.equal(torch.get_rng_state(), state)


def test_attach_rejects_a_config_without_hidden_size(tiny_causal_lm):
    import types

    model = tiny_causal_lm("llama")
    model.config = types.SimpleNamespace(hidden_size=0)  # HF configs refuse a bad value themselves
    with pytest.raises(ValueError, match="config.hidden_size=0 is invalid: it must be a positive int"):
        attach_boundaries(model, num_stages=2, mask_ratio=0.5)


def test_protect_largest_dims_rejects_a_negative_count(tiny_causal_lm):
    model = tiny_causal_lm("llama")
    handle = attach_boundaries(model, num_stages=2, mask_ratio=0.5)
    with pytest.raises(ValueError, match="mask_protect_dims=-1 is invalid: it must be >= 0"):
        handle.protect_largest_dims(model, {"input_ids": token_batch()}, count=-1)
