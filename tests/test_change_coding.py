"""Per-sample change coding (``boundary_change_codec``): a revisit against a float64 transcription, the
two sides' caches over epochs, a row whose tokens changed, the single-process hooks on a real model, and
MeshTrainer over several epochs with an exact resume mid-epoch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hf_meshtune import MeshConfig
from hf_meshtune.boundary.compose import ComposedCodec, parse_codec
from hf_meshtune.boundary.compose.change import (
    ChangeCache,
    ChangeCodec,
    change_spec,
    decode_change,
    encode_change,
    row_digest,
)
from hf_meshtune.boundary.compose.handle import attach_composed
from tests.test_compose import H, _activations, _ref_rotation
from tests.tiny import tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

CHANGE = "rot+delta4g32+zstd"


def _change_codec(text: str = CHANGE) -> ChangeCodec:
    return ChangeCodec(change_spec(text), 0, H, seed=0)


def _ref_change(codec: ChangeCodec, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """h̄ + Rᵀ(step ⊙ round(R(h − h̄) / step)) in float64, step = absmax of R h̄ per group of G / (2^(b-1) - 1)."""
    spec = codec.spec
    rotation = _ref_rotation(SimpleNamespace(rotations={"fwd": codec.rotation}), "fwd")
    groups = (previous.double() @ rotation.T).reshape(previous.shape[0], -1, spec.group)
    step = groups.abs().amax(-1, keepdim=True) / (2 ** (spec.bits - 1) - 1)
    change = ((hidden - previous).double() @ rotation.T).reshape(step.shape[0], -1, spec.group)
    coded = (torch.round(change / step).clamp(-127, 127) * step).reshape(previous.shape[0], -1)
    return previous.double() + coded @ rotation


def test_a_revisit_rebuilds_the_cached_value_plus_the_change_on_its_grid_as_the_float64_transcription():
    change, cache = _change_codec(), ChangeCache()
    before = _activations(12, seed=1)
    digest = row_digest(torch.arange(12))
    assert encode_change(change, cache, 7, digest, before) is None  # a first visit: the caller sends the base codec
    cache.put(7, digest, before)
    after = before + 0.05 * _activations(12, seed=2)
    (outliers, codes), rebuilt = encode_change(change, cache, 7, digest, after)
    torch.testing.assert_close(rebuilt.double(), _ref_change(change, before, after), rtol=1e-5, atol=1e-4)
    assert torch.equal(cache.get(7, digest), rebuilt)  # the new h̄ is what was rebuilt
    assert (
        codes.dtype == torch.int8 and codes.shape == (12, change_spec(CHANGE).record_bytes(H)) and not outliers.numel()
    )
    # the error is at most half a step: int4's error on the value, whatever the size of the change
    step = change.steps(before).expand(-1, -1, 32).reshape(12, -1)
    rotated_error = change.rotation.forward((rebuilt - after).float())
    assert (rotated_error.abs() <= step / 2 + 1e-4).all()
    # a small change codes to mostly zeros, which the coder packs far below a byte per value
    assert (codes == 0).float().mean() > 0.5


def test_sender_and_receiver_caches_stay_identical_over_epochs_and_a_missing_row_is_refused():
    base = ComposedCodec(parse_codec("outliers2+int4g31"), 0, H)
    base.fit(_activations())
    change = _change_codec()
    sender, receiver = ChangeCache(), ChangeCache()
    rows = {row: _activations(5 + row, seed=10 + row) for row in range(6)}
    digests = {row: row_digest(torch.tensor([row, 5 + row])) for row in rows}
    for epoch in range(3):
        for row, values in rows.items():
            h = values * (1 + 0.02 * epoch)
            coded = encode_change(change, sender, row, digests[row], h)
            if coded is None:  # first visit: both sides keep the boundary codec's h̃
                sender.put(row, digests[row], base.decode_activation(base.encode_activation(h)))
                receiver.put(row, digests[row], base.decode_activation(base.encode_activation(h)))
            else:
                message, rebuilt = coded
                assert torch.equal(decode_change(change, receiver, row, digests[row], message), rebuilt)
        assert sender.digest() == receiver.digest()
    assert sender.nbytes == sum(v.numel() for v in rows.values()) * 4
    # a receiver that lost a row never decodes a change against nothing
    message, _ = encode_change(change, sender, 3, digests[3], rows[3])
    del receiver.rows[3]
    with pytest.raises(ValueError, match=r"change cache='row 3' is invalid: it must be held by the receiver"):
        decode_change(change, receiver, 3, digests[3], message)


def test_a_row_whose_tokens_changed_is_a_first_visit():
    change, cache = _change_codec(), ChangeCache()
    values = _activations(4, seed=3)
    cache.put(0, row_digest(torch.tensor([5, 6, 7, 8])), values)
    assert encode_change(change, cache, 0, row_digest(torch.tensor([5, 6, 7, 9])), values) is None
    assert encode_change(change, cache, 0, row_digest(torch.tensor([5, 6, 7, 8])), values) is not None


def test_the_cache_state_round_trips_through_a_weights_only_checkpoint(tmp_path):
    cache = ChangeCache()
    for row in (3, 1, 9):
        cache.put(row, row_digest(torch.tensor([row])), _activations(row + 1, seed=row))
    torch.save(cache.state_dict(), tmp_path / "cache.pt")
    loaded = ChangeCache()
    loaded.load_state_dict(torch.load(tmp_path / "cache.pt", weights_only=True))
    assert loaded.digest() == cache.digest() and sorted(loaded.rows) == [1, 3, 9]


def test_the_hooks_code_revisits_as_changes_book_them_and_pass_the_gradient_to_the_base_backward():
    torch.manual_seed(0)
    model = tiny_llama(seed=0, layers=4, hidden=H)
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0  # row 1 has 7 real tokens
    handle = attach_composed(model, 2, "outliers2+int4g31", change=change_spec("rot+delta6g32+zstd"))
    handle.calibrate(model, {"input_ids": ids, "attention_mask": mask})
    with pytest.raises(ValueError, match=r"row ids=None is invalid: it must be given for every training forward"):
        model(input_ids=ids, attention_mask=mask)
    record = parse_codec("outliers2+int4g31").payload_bytes(H, 4)
    handle.set_rows(torch.tensor([10, 11]))
    model(input_ids=ids, attention_mask=mask).logits.sum().backward()
    assert handle.visits == {"first": 2, "revisit": 0}
    assert handle.counter.fwd_bytes == handle.counter.bwd_bytes == 17 * record and handle.change_counter.fwd_bytes == 0
    assert [v.shape for _, v in handle.caches[0].rows.values()] == [(10, H), (7, H)]
    handle.counter.reset()
    with torch.no_grad():  # the weights move: the second visit's activations differ from the first's
        for p in model.parameters():
            p.add_(1e-4 * torch.randn_like(p))
    handle.set_rows(torch.tensor([10, 11]))
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask)
    out.logits.sum().backward()
    assert handle.visits == {"first": 2, "revisit": 2}
    # a token's record: the 2 outlier dims in fp32 as they are, then an int8 code per other value (62, padded to 64)
    assert handle.change_counter.fwd_uncoded == 17 * (2 * 4 + 64) and handle.counter.fwd_bytes == 0
    assert 0 < handle.change_counter.fwd_bytes < handle.change_counter.fwd_uncoded
    assert handle.counter.bwd_bytes == 17 * record  # the gradient: the boundary codec's backward, every row
    # the revisit's h̃ = h̄ + D(change) on delta6's grid: closer to the dense activation than int4's own h̃
    (dense,) = handle.dense_boundary_outputs(model, {"input_ids": ids, "attention_mask": mask})
    codec, real = handle.codecs[0], mask.bool()
    base_error = (codec.decode_activation(codec.encode_activation(dense)) - dense)[real].norm()
    change_error = (torch.cat([v for _, v in handle.caches[0].rows.values()]) - dense[real]).norm()
    assert change_error < 0.5 * base_error, (change_error, base_error)
    handle.remove()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


def test_the_knobs_refuse_change_coding_without_a_composed_boundary_codec():
    assert MeshConfig(boundary_change_codec=CHANGE).boundary_change_codec == CHANGE
    with pytest.raises(ValueError, match=r"it must be None unless boundary_codec is a composed codec"):
        MeshConfig(boundary_codec="mask0.95", boundary_change_codec=CHANGE)
    with pytest.raises(ValueError, match=r"boundary_change_codec='outliers8\+int2' is invalid: it must be \[rot"):
        MeshConfig(boundary_change_codec="outliers8+int2")


def _trainer(tmp_path, change: str | None = CHANGE, dataset=None, **overrides):
    from hf_meshtune import MeshTrainer, MeshTrainingArguments
    from tests.test_trainer import BASE
    from tests.tiny import pattern_dataset

    knobs = dict(BASE, output_dir=str(tmp_path / "out"), max_steps=6, num_stages=2, anchor=False)
    knobs.update(optim="adamw_torch", boundary_codec="outliers2+int4g31", boundary_change_codec=change)
    args = MeshTrainingArguments(**{**knobs, **overrides})
    data = dataset if dataset is not None else pattern_dataset(n=8)
    return MeshTrainer(model=tiny_llama(), args=args, train_dataset=data)


def test_mesh_trainer_codes_every_revisit_as_a_change_and_keeps_the_data_order(tmp_path):
    """8 rows, 4 per step, 6 steps: epoch 1 (steps 1-2) sends the boundary codec's messages and trains exactly
    as without change coding (same rows in the same order); epochs 2 and 3 revisit every row."""
    coded = _trainer(tmp_path / "coded")
    coded.train()
    plain = _trainer(tmp_path / "plain", change=None)
    plain.train()
    logs = [h for h in coded.state.log_history if "loss" in h]
    plain_logs = [h for h in plain.state.log_history if "loss" in h]
    assert [h["loss"] for h in logs[:2]] == [h["loss"] for h in plain_logs[:2]]
    assert [h["change/revisit_fraction"] for h in logs] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    hidden = coded.mesh_boundaries.hidden_size
    assert logs[-1]["change/cache_bytes"] == 8 * 16 * hidden * 4  # rows × real tokens × H × fp32, one boundary
    first, revisit = logs[0]["comm/measured_pp_fwd_bytes_per_token"], logs[-1]["comm/measured_pp_fwd_bytes_per_token"]
    assert revisit == logs[-1]["change/fwd_bytes_per_token"] and 0 < revisit < first
    assert logs[-1]["comm/measured_pp_bwd_bytes_per_token"] == plain_logs[-1]["comm/measured_pp_bwd_bytes_per_token"]
    assert abs(logs[-1]["loss"] - plain_logs[-1]["loss"]) < 0.05 * plain_logs[-1]["loss"]


def test_a_change_coded_run_resumed_mid_epoch_continues_exactly_with_the_caches_it_saved(tmp_path):
    full = _trainer(tmp_path / "full", save_strategy="steps", save_steps=3)
    full.train()
    resumed = _trainer(tmp_path / "resumed", save_strategy="steps", save_steps=3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "out" / "checkpoint-3"))
    after = [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 3]
    assert after == [h["loss"] for h in full.state.log_history if "loss" in h and h["step"] > 3]
    caches = [c.digest() for c in full.mesh_boundaries.caches]
    assert [c.digest() for c in resumed.mesh_boundaries.caches] == caches
    # without its caches the checkpoint does not resume a change-coded run
    plain = _trainer(tmp_path / "plain", change=None, save_strategy="steps", save_steps=3)
    plain.train()
    with pytest.raises(ValueError, match=r"boundary_change_codec"):
        _trainer(tmp_path / "again").train(resume_from_checkpoint=str(tmp_path / "plain" / "out" / "checkpoint-3"))


def test_change_coding_refuses_a_streamed_dataset_and_a_cache_over_budget_before_training(tmp_path):
    from torch.utils.data import IterableDataset

    from tests.tiny import pattern_dataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(pattern_dataset(n=8))

    with pytest.raises(ValueError, match=r"train_dataset='Stream' is invalid: it must be a map-style dataset"):
        _trainer(tmp_path / "stream", dataset=Stream()).train()
    trainer = _trainer(tmp_path / "budget", change_cache_gb=1e-6)
    with pytest.raises(ValueError, match=r"change_cache_gb=1e-06 is invalid: it must be at least the change caches'"):
        trainer.train()
    assert trainer.state.global_step == 0


@pytest.mark.parametrize("checkpointing", [{"use_reentrant": True}, {"use_reentrant": False}])
def test_gradient_checkpointing_codes_each_row_once_per_forward(checkpointing):
    """The recompute in the backward must not code a revisit again (the cache would move twice)."""
    model = tiny_llama(seed=0, layers=4, hidden=H)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    model.train()
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    handle = attach_composed(model, 2, "outliers2+int4g31", change=change_spec(CHANGE))
    handle.calibrate(model, {"input_ids": ids})
    for _ in range(2):
        handle.set_rows(torch.tensor([0, 1]))
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert handle.visits == {"first": 2, "revisit": 2}


def test_the_outlier_dims_travel_as_they_are_so_a_massive_dim_does_not_set_the_grid():
    """A massive dim rotated in with the others would set every grid step of its block: the boundary codec's
    outlier dims are sent as they are, and the others keep int4's precision."""
    change, cache = ChangeCodec(change_spec(CHANGE), 0, H - 2), ChangeCache()
    before = _activations(12, seed=1)  # dims 5 and 40 are massive (300, -150)
    dims = (torch.tensor([5, 40]), torch.tensor([d for d in range(H) if d not in (5, 40)]))
    digest = row_digest(torch.arange(12))
    cache.put(0, digest, before)
    after = before + 0.5 * _activations(12, seed=2)
    (outliers, _), rebuilt = encode_change(change, cache, 0, digest, after, dims)
    assert torch.equal(outliers, after[:, [5, 40]]) and torch.equal(rebuilt[:, [5, 40]], after[:, [5, 40]])
    rest = dims[1]
    error = (rebuilt[:, rest] - after[:, rest]).norm() / after[:, rest].norm()
    whole = ChangeCodec(change_spec(CHANGE), 0, H)  # the same change coded with the massive dims rotated in
    _, rebuilt_whole = encode_change(whole, ChangeCache({0: (digest, before)}), 0, digest, after)
    error_whole = (rebuilt_whole[:, rest] - after[:, rest]).norm() / after[:, rest].norm()
    assert error < 0.25 * error_whole, (error, error_whole)


def test_every_other_change_coding_error_names_its_rule(tmp_path):
    from hf_meshtune.row_ids import RowIds, require_cache_budget

    with pytest.raises(ValueError, match=r"rot48\+delta4g16\+zstd' is invalid: it must rotate in blocks of a power"):
        change_spec("rot48+delta4g16+zstd")
    with pytest.raises(ValueError, match=r"train_dataset column='meshtune_row_id' is invalid: it must not be a col"):
        RowIds([{"input_ids": [1, 2], "meshtune_row_id": 5}])[0]
    with pytest.raises(ValueError, match=r"train_dataset row='list' is invalid: it must be a dict of features"):
        RowIds([[1, 2]])[0]
    with pytest.raises(ValueError, match=r"train_dataset='row 0 without input_ids' is invalid: it must be tokenized"):
        require_cache_budget([{"text": "a b"}], 64, 1, 4, 1.0)
    cache = ChangeCache()
    cache.put(0, b"\0" * 8, torch.zeros(3, H))
    with pytest.raises(ValueError, match=r"change cache='row 0: held \(3, 64\), now \(4, 64\)' is invalid"):
        encode_change(_change_codec(), cache, 0, b"\0" * 8, torch.zeros(4, H))
    with pytest.raises(ValueError, match=r"change cache state=\(1, 0, 1\) is invalid: it must hold one token digest"):
        ChangeCache().load_state_dict({"ids": torch.tensor([0]), "digests": [], "values": [torch.zeros(1, H)]})
    model = tiny_llama(seed=0, layers=4, hidden=H)
    handle = attach_composed(model, 2, "outliers2+int4g31", change=change_spec(CHANGE))
    ids = torch.randint(3, 100, (2, 6))
    handle.calibrate(model, {"input_ids": ids})
    handle.set_rows(torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match=r"3 row ids for input_ids of shape \(2, 6\)' is invalid: it must give one id"):
        model(input_ids=ids)
    with pytest.raises(ValueError, match=r"state\['change_caches'\]=0 is invalid: it must hold one change cache per"):
        handle.load_state_dict({k: v for k, v in handle.state_dict().items() if k != "change_caches"})
