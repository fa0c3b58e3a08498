"""AnchorCircuit: delayed delivery of dense snapshot gradients, isolation from the fast circuit."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_meshtune import AnchorBatches, AnchorCircuit, attach_boundaries
from tests.tiny import pattern_dataset, tiny_llama


class RecordingOptimizer:
    """Stands in for SpectralAdamW's update_anchor and records what arrives, by step."""

    def __init__(self) -> None:
        self.arrivals: list[dict[torch.Tensor, torch.Tensor]] = []
        self.staleness: list[int | None] = []

    def update_anchor(self, grads, staleness=None):
        self.arrivals.append({p: g.clone() for p, g in grads.items()})
        self.staleness.append(staleness)
        return len(grads)


def batch_for(round_index: int) -> list[dict[str, torch.Tensor]]:
    ids = torch.tensor([pattern_dataset()[round_index % 64]["input_ids"]] * 2)
    return [{"input_ids": ids, "labels": ids}]


def loss_fn(model, batch):
    return model(**batch).loss


def dense_grads(model, params: dict, batch) -> dict[str, torch.Tensor]:
    """Reference: a plain dense gradient of a copy of the model (no hooks) at its current weights."""
    reference = copy.deepcopy(model)
    for hook_dict in (m._forward_hooks for m in reference.modules()):
        hook_dict.clear()
    reference._forward_pre_hooks.clear()
    reference.zero_grad()
    sum(loss_fn(reference, b) for b in batch).backward()
    named = dict(reference.named_parameters())
    return {name: named[name].grad.clone() for name in params}


@pytest.mark.parametrize("delay", [0, 1, 3])
def test_delivery_is_the_dense_gradient_of_the_snapshot_delay_steps_earlier(delay):
    model = tiny_llama()
    handle = attach_boundaries(model, num_stages=2, mask_ratio=0.75)
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    anchor = AnchorCircuit(model, params, handle, every=1, delay=delay, batches=batch_for, loss_fn=loss_fn)
    optimizer = RecordingOptimizer()
    expected = {}
    for step in range(6):
        expected[step] = dense_grads(model, params, batch_for(step))
        handle.set_step(step)
        delivered = anchor.on_step(step, optimizer)
        assert delivered == ([step - delay] if step >= delay else [])
        if delivered:
            arrival = optimizer.arrivals[-1]
            for name, param in params.items():
                torch.testing.assert_close(arrival[param], expected[step - delay][name], rtol=1e-5, atol=1e-6)
            assert anchor.last_staleness == delay and optimizer.staleness[-1] == delay  # told to the optimizer too
        with torch.no_grad():  # the fast circuit moves the weights between steps
            for param in params.values():
                param.add_(0.01 * torch.randn_like(param))
    assert len(optimizer.arrivals) == 6 - delay


def test_anchor_every_k_steps_and_pending_queue():
    model = tiny_llama()
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    anchor = AnchorCircuit(model, params, None, every=3, delay=4, batches=batch_for, loss_fn=loss_fn)
    optimizer = RecordingOptimizer()
    delivered = {step: anchor.on_step(step, optimizer) for step in range(10)}
    assert {s: d for s, d in delivered.items() if d} == {4: [0], 7: [3]}
    assert [p.snapshot_step for p in anchor.pending] == [6, 9]


def test_anchor_leaves_fast_grads_rng_and_masks_untouched():
    model = tiny_llama()
    handle = attach_boundaries(model, num_stages=2, mask_ratio=0.75)
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    model.config.attention_dropout = 0.0
    anchor = AnchorCircuit(model, params, handle, every=1, delay=0, batches=batch_for, loss_fn=loss_fn)
    ids = batch_for(0)[0]["input_ids"]
    handle.set_step(0)
    loss_fn(model, {"input_ids": ids, "labels": ids}).backward()
    fast_grads = {n: p.grad.clone() for n, p in params.items()}
    rng = torch.get_rng_state()
    counted = handle.counter.fwd_bytes
    anchor.on_step(0, RecordingOptimizer())
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(params[n].grad, g) for n, g in fast_grads.items())
    assert handle.counter.fwd_bytes == counted and handle.enabled and handle.microbatch == 0


def test_state_dict_round_trip_and_unknown_names():
    model = tiny_llama()
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    anchor = AnchorCircuit(model, params, None, every=1, delay=2, batches=batch_for, loss_fn=loss_fn)
    for step in range(2):
        anchor.on_step(step, RecordingOptimizer())
    state = anchor.state_dict()
    other = AnchorCircuit(model, params, None, every=1, delay=2, batches=batch_for, loss_fn=loss_fn)
    other.load_state_dict(state)
    assert [(p.snapshot_step, p.deliver_step) for p in other.pending] == [(0, 2), (1, 3)]
    first = next(iter(params))
    assert torch.equal(other.pending[0].grads[first], anchor.pending[0].grads[first])
    state["pending"][0][2]["not.a.param"] = torch.zeros(1)
    with pytest.raises(ValueError, match="anchor state=.*not.a.param"):
        other.load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(every=0), "anchor_every=0 is invalid: it must be >= 1"),
        (dict(delay=-1), "anchor_delay=-1 is invalid: it must be >= 0"),
        (dict(params={}), "anchor params=0 is invalid"),
    ],
)
def test_bad_anchor_settings_are_rejected(kwargs, message):
    model = tiny_llama()
    settings = dict(params={n: p for n, p in model.named_parameters() if p.ndim == 2}, every=1, delay=0)
    settings.update(kwargs)
    with pytest.raises(ValueError, match=message):
        AnchorCircuit(model, boundaries=None, batches=batch_for, loss_fn=loss_fn, **settings)


def test_anchor_batches_are_a_pure_function_of_the_round():
    data = pattern_dataset(n=10)
    a = AnchorBatches(data, lambda rows: rows, batch_size=3, microbatches=2, seed=5)
    b = AnchorBatches(data, lambda rows: rows, batch_size=3, microbatches=2, seed=5)
    assert [a.indices(r) for r in (4, 0, 2)] == [b.indices(r) for r in (4, 0, 2)]
    first_pass = a.indices(0) + a.indices(1)[:4]  # 6 + 4 samples = one pass over 10
    assert sorted(first_pass) == list(range(10))  # without replacement within a pass
    assert a.indices(0) != AnchorBatches(data, lambda r: r, 3, 2, seed=6).indices(0)
    assert len(a(1)) == 2 and len(a(1)[0]) == 3


def test_anchor_batches_need_a_map_style_dataset():
    with pytest.raises(ValueError, match="train_dataset='generator' is invalid: it must be a non-empty map-style"):
        AnchorBatches((x for x in range(3)), list, 1, 1, 0)


def test_a_round_without_batches_is_rejected():
    model = tiny_llama()
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    anchor = AnchorCircuit(model, params, None, every=1, delay=0, batches=lambda r: [], loss_fn=loss_fn)
    with pytest.raises(ValueError, match="anchor batches=0 is invalid: it must be at least one microbatch per round"):
        anchor.on_step(0, RecordingOptimizer())
