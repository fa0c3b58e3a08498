"""A fitted codec's geometry refitted from the anchor's dense passes (``codec_refit_every``).

Single process: the anchor circuit fits the geometry on its round's dense boundary activations (real
tokens only) and the boundaries switch to it after the step that applied the round's gradient. On
the mesh: anchor stage s sends boundary s's geometry to both fast stages that share it, and every
replica's stages switch together (the sender's and the receiver's geometry are the anchor's, bit for
bit); the lockstep resume of ``test_mesh_checkpoint`` covers continuing with it exactly.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hf_meshtune.anchor.circuit import AnchorCircuit
from hf_meshtune.boundary.compose.codec import geometry_digest, geometry_from_flat, geometry_layout, geometry_to_flat
from hf_meshtune.boundary.compose.handle import attach_composed
from hf_meshtune.boundary.hooks import attach_boundaries
from hf_meshtune.config import MeshConfig, codec_refit_every
from hf_meshtune.ledger import LedgerSettings, compute_ledger
from tests.distributed import mesh_launch
from tests.tiny import tiny_llama

REPO = Path(__file__).resolve().parents[1]
CODEC = "outliers2+pca8+int8"


class AnchorInbox:
    """The optimizer's side of the anchor (what ``SpectralAdamW.update_anchor`` receives)."""

    def __init__(self) -> None:
        self.stalenesses: list[int] = []

    def update_anchor(self, grads, staleness: int) -> None:
        self.stalenesses.append(staleness)


def _round_batch(round_index: int) -> dict:
    gen = torch.Generator().manual_seed(1000 + round_index)
    ids = torch.randint(3, 90, (2, 12), generator=gen)
    real = torch.ones_like(ids)
    real[1, 7:] = 0  # padding: its activations must not shape the geometry
    return {"input_ids": ids, "attention_mask": real, "labels": ids.masked_fill(real == 0, -100)}


def _same_geometry(a: dict, b: dict) -> None:
    assert torch.equal(a["outlier_dims"], b["outlier_dims"]) and torch.equal(a["rest_dims"], b["rest_dims"])
    torch.testing.assert_close(a["mean"], b["mean"], rtol=0, atol=1e-5)
    projector = lambda g: g["basis"] @ g["basis"].T  # noqa: E731 - the span, whatever the eigenvectors' signs
    torch.testing.assert_close(projector(a), projector(b), rtol=0, atol=1e-4)


def test_the_anchor_refits_on_its_dense_pass_and_the_codec_switches_after_the_delivery():
    model = tiny_llama(seed=0)
    model.train()
    handle = attach_composed(model, 2, CODEC)
    handle.calibrate(model, {"input_ids": torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(5))})
    calibrated = copy.deepcopy(handle.codecs[0].geometry())
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    anchor = AnchorCircuit(
        model, params, handle, every=2, delay=1, batches=lambda r: [_round_batch(r)], loss_fn=lambda m, b: m(**b).loss,
        refit_every=1,
    )  # fmt: skip
    inbox = AnchorInbox()
    batch = {k: v for k, v in _round_batch(0).items() if k != "labels"}
    reference = handle.codecs[0].fitted(handle.dense_boundary_tokens(model, batch)[0])  # the snapshot of step 0
    padded = handle.codecs[0].fitted(handle.dense_boundary_outputs(model, batch)[0])
    assert not torch.allclose(reference["mean"], padded["mean"], atol=1e-3)  # so the padding check below bites

    anchor.on_step(0, inbox)  # round 0 on the snapshot of step 0: delivered at step 1
    assert geometry_digest(handle.codecs[0].geometry()) == geometry_digest(calibrated)  # not before its delivery
    state = copy.deepcopy(anchor.state_dict())
    _same_geometry(state["pending"][0][3][0], reference)
    with torch.no_grad():  # the fast step moves the model; the delivered geometry is still the snapshot's
        for p in params.values():
            p.add_(0.01 * torch.randn_like(p))
    anchor.on_step(1, inbox)
    assert inbox.stalenesses == [1] and anchor.refits == 1
    _same_geometry(handle.codecs[0].geometry(), reference)

    # a resume with the round in flight delivers the same geometry at the same step
    handle.codecs[0].load_geometry(calibrated)
    resumed = AnchorCircuit(
        model, params, handle, every=2, delay=1, batches=lambda r: [_round_batch(r)], loss_fn=lambda m, b: m(**b).loss,
        refit_every=1,
    )  # fmt: skip
    resumed.load_state_dict(state)
    resumed.on_step(1, AnchorInbox())
    _same_geometry(handle.codecs[0].geometry(), reference)


def test_refits_skip_the_rounds_between_and_masks_have_nothing_to_refit():
    model = tiny_llama(seed=0)
    model.train()
    handle = attach_composed(model, 2, CODEC)
    handle.calibrate(model, {"input_ids": torch.randint(3, 90, (2, 12))})
    params = {n: p for n, p in model.named_parameters() if p.ndim == 2}
    anchor = AnchorCircuit(
        model, params, handle, every=1, delay=0, batches=lambda r: [_round_batch(r)], loss_fn=lambda m, b: m(**b).loss,
        refit_every=2,
    )  # fmt: skip
    for step in range(5):
        anchor.on_step(step, AnchorInbox())
    assert anchor.refits == 3  # rounds 0, 2, 4
    masked = attach_boundaries(tiny_llama(seed=0), 2, 0.9)
    with pytest.raises(ValueError, match=r"codec_refit_every=1 is invalid: it must be 0 unless the boundaries are"):
        AnchorCircuit(model, params, masked, every=1, delay=0, batches=None, loss_fn=None, refit_every=1)


def test_the_refit_knob_defaults_on_only_where_a_refit_can_happen():
    assert codec_refit_every(MeshConfig(boundary_codec="outliers8+int8", anchor=True)) == 1
    assert codec_refit_every(MeshConfig(boundary_codec="int8", anchor=True)) == 0  # nothing to fit
    assert codec_refit_every(MeshConfig(preset="quality")) == 0  # no anchor
    assert codec_refit_every(MeshConfig(preset="paper")) == 0  # masks
    assert codec_refit_every(MeshConfig(boundary_codec="outliers8+int8", anchor=True, codec_refit_every=0)) == 0


def test_the_ledger_books_each_refit_and_the_per_step_agreement():
    H, T, every, fast, stages = 64, 512, 4, 3, 3
    base = dict(num_replicas=fast + 1, num_stages=stages, mask_ratio=0.0, tokens_per_step=T, boundary_codec=CODEC)
    base.update(anchor_every=every, activation_dtype="float32", grad_dtype="float32", param_dtype="float32")
    shapes = [(H, H)]
    plain = compute_ledger(shapes, H, LedgerSettings(**base)).anchor
    for refit in (1, 3):
        refitted = compute_ledger(shapes, H, LedgerSettings(**base, codec_refit_every=refit)).anchor
        codec = attach_composed(tiny_llama(seed=0, hidden=H), 2, CODEC).codecs[0]
        numel = sum(torch.Size(shape).numel() for _, shape, _ in geometry_layout(codec))
        geometry = (stages - 1) * 2 * fast * numel * 4 / (fast * T * every * refit)
        agreement = 2 * (stages - 1) * 8 / T  # one int64 ring all-reduce per replica and fast step
        assert refitted - plain == pytest.approx(geometry + agreement, rel=1e-12)


def test_a_geometry_travels_as_floats_and_comes_back_exactly():
    model = tiny_llama(seed=0)
    handle = attach_composed(model, 2, "outliers3+spca9+int4")
    handle.calibrate(model, {"input_ids": torch.randint(3, 90, (2, 12))})
    codec = handle.codecs[0]
    flat = geometry_to_flat(codec, codec.geometry())
    assert flat.dtype == torch.float32 and flat.numel() == codec.spec.geometry_numel(codec.hidden_size)
    back = geometry_from_flat(codec, flat)
    assert geometry_digest(back) == geometry_digest(codec.geometry())
    assert back["outlier_dims"].dtype == torch.int64
    with pytest.raises(ValueError, match=r"codec geometry size=.* it must equal the layout's"):
        geometry_from_flat(codec, flat[:-1])


@pytest.mark.slow
def test_on_the_mesh_both_sides_of_a_boundary_switch_together_to_the_anchors_fit(tmp_path):
    """3x2 with the paper's asynchronous anchor: every refit the fast stages use is one the anchor
    sent, sender and receiver switch after the same steps to the same geometry, and it happens."""
    config = {"anchor": True, "anchor_every": 2, "anchor_delay": 2, "spectral_tau": 1e-3, "mask_ratio": 0.0}
    config["boundary_codec"] = CODEC
    proc = subprocess.run(
        [*mesh_launch("3x2"), "tests/scripts/mesh_run.py", str(tmp_path), "12", json.dumps(config)],
        cwd=REPO,
        # paced fast steps leave the anchor's dense rounds room on a loaded machine: without it, a fresh
        # clone's suite with the demo beside it saw the anchor finish 2 rounds in 12 steps
        env={**os.environ, "PYTHONPATH": str(REPO), "STEP_SECONDS": "0.25"},
        text=True,
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = [torch.load(tmp_path / f"result{r}.pt", weights_only=False).result for r in range(6)]
    sent = dict(results[4].geometry)  # anchor stage 0 fits boundary 0: snapshot → digest
    assert results[5].geometry == [] and len(sent) == len(results[4].anchor_rounds) >= 3
    for replica in (0, 1):
        sender, receiver = (r for r in results if r.role == "fast" and r.replica == replica)
        switches = [(step, snapshot) for step, snapshot, _, _ in sender.geometry]
        assert switches and switches == [(step, snapshot) for step, snapshot, _, _ in receiver.geometry]
        assert all(step >= snapshot for step, snapshot in switches)
        assert [out for *_, out in sender.geometry] == [sent[s] for _, s in switches]
        assert [inc for _, _, inc, _ in receiver.geometry] == [sent[s] for _, s in switches]


def test_a_refit_with_nothing_recorded_and_a_geometry_for_another_boundary_are_refused():
    from hf_meshtune.anchor.geometry import FastGeometryLink
    from hf_meshtune.comm.messages import GeometryHeader

    model = tiny_llama(seed=0)
    handle = attach_composed(model, 2, CODEC)
    with handle.recording():
        pass  # no dense forward ran
    with pytest.raises(ValueError, match=r"codec refit='no dense forward recorded' is invalid: it must follow"):
        handle.refit_geometry()
    link = FastGeometryLink.__new__(FastGeometryLink)  # its message check alone, without a link to receive on
    link.codecs, link.held, link.ended = [[handle.codecs[0]]], [{}], [False]
    with pytest.raises(ValueError, match=r"codec geometry boundary=1 is invalid: it must be 0, the boundary"):
        link._take(0, (GeometryHeader(1, 4, 1, 3), torch.zeros(3)))
