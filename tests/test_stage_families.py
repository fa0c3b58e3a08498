"""Every decoder family the pipeline rebuilds (``pipeline.layout``): its stages, run one after the other in this
process, are the model. Dense boundaries against the plain forward; masked and composed-codec boundaries against
the single-process model with the same boundaries attached (``attach_boundaries`` / ``attach_composed``)."""

from __future__ import annotations

import pytest
import torch

from hf_meshtune.boundary.compose.handle import attach_composed
from hf_meshtune.boundary.hooks import attach_boundaries
from hf_meshtune.boundary.masking import BoundaryMask
from hf_meshtune.memory import ActivationMeter
from hf_meshtune.memory_ledger import MemorySettings, predict_memory
from hf_meshtune.pipeline.layout import FAMILIES, SUPPORTED_MODEL_TYPES
from hf_meshtune.pipeline.stage import StageModule, causal_lm_loss, untie_embeddings
from tests.tiny import PIPELINE_FAMILIES, tiny_family

pytestmark = pytest.mark.usefixtures("single_thread_torch")

SEQ, P, SEED = 12, 0.75, 7
# fp32 on one process: the stages run the model's own modules on the same tensors in the same order, so they
# agree to float rounding of the few ops whose order may differ (none today: the results are bit-identical)
TOL = dict(rtol=1e-5, atol=1e-6)


def _ids(seed: int, rows: int = 2) -> torch.Tensor:
    return torch.randint(3, 100, (rows, SEQ), generator=torch.Generator().manual_seed(seed))


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _side(given: list | None, boundary: int):
    return given[boundary] if given is not None and 0 <= boundary < len(given) else None


def _staged(
    model,
    ids: torch.Tensor,
    stages: int,
    masks=None,
    codecs=None,
    step: int = 0,
    microbatch: int = 0,
    stage_layers: tuple[int, ...] | None = None,
):
    """The logits of ``stages`` StageModules run in sequence; boundary b carries ``masks[b]`` or ``codecs[b]``."""
    x = ids
    for s in range(stages):
        sides = (_side(masks, s - 1), _side(masks, s), _side(codecs, s - 1), _side(codecs, s))
        module = StageModule(model, s, stages, *sides, stage_layers=stage_layers)
        module.step, module.microbatch = step, microbatch
        x = module(x)
    return x


def test_every_supported_family_is_tested():
    assert set(PIPELINE_FAMILIES) == set(SUPPORTED_MODEL_TYPES) == set(FAMILIES)


# balanced splits of the tiny models' 4 layers, and uneven ones (``stage_layers``: a slow host's stage holds fewer)
SPLITS = [(2, None), (3, None), (2, (3, 1)), (3, (1, 1, 2))]


@pytest.mark.parametrize("stages, stage_layers", SPLITS)
@pytest.mark.parametrize("family", SUPPORTED_MODEL_TYPES)
def test_dense_stages_in_sequence_equal_the_model(family, stages, stage_layers):
    """Logits, loss and every parameter's gradient of the staged forward equal the model's own forward, for
    balanced and uneven splits."""
    model = tiny_family(family)
    ids = _ids(0)
    reference = model(input_ids=ids, labels=ids)
    reference.loss.backward()
    expected = _grads(model)
    model.zero_grad()
    logits = _staged(model, ids, stages, stage_layers=stage_layers)
    loss = causal_lm_loss(model)(logits, ids)
    loss.backward()
    torch.testing.assert_close(logits, reference.logits, **TOL)
    torch.testing.assert_close(loss, reference.loss, **TOL)
    got = _grads(model)
    assert got.keys() == expected.keys() == {n for n, _ in model.named_parameters()}
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, **TOL, msg=name)


@pytest.mark.parametrize("family", [f for f, layout in FAMILIES.items() if layout.embed_dropout])
def test_the_embedding_dropout_runs_on_the_first_stage(family):
    """With dropout on and the same seed, the staged forward draws the same masks in the same order as the model
    (its embedding dropout first): the first stage applies the family's embedding dropout."""
    dropout = {"gpt_neox": {"hidden_dropout": 0.3}, "phi": {"embd_pdrop": 0.3}}[family]
    model = tiny_family(family, **dropout)
    ids = _ids(1)
    torch.manual_seed(3)
    reference = model(input_ids=ids).logits
    torch.manual_seed(3)
    torch.testing.assert_close(_staged(model, ids, 2), reference, **TOL)


def _masked_run(
    family: str, stages: int, steps: int, attach: bool, stage_layers: tuple[int, ...] | None = None
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Per-step loss and the last step's gradients over two microbatches per step: the model with
    ``attach_boundaries`` (attach=True), or its stages in sequence with the same masks."""
    model = tiny_family(family)
    handle = attach_boundaries(model, stages, mask_ratio=P, seed=SEED, stage_layers=stage_layers) if attach else None
    masks = [BoundaryMask(b, P, seed=SEED) for b in range(stages - 1)]
    losses = []
    for step in range(steps):
        model.zero_grad()
        if handle is not None:
            handle.set_step(step)
        total = 0.0
        for micro, chunk in enumerate(_ids(10 + step, rows=4).chunk(2)):
            if handle is not None:
                loss = model(input_ids=chunk, labels=chunk).loss / 2
            else:
                logits = _staged(
                    model, chunk, stages, masks=masks, step=step, microbatch=micro, stage_layers=stage_layers
                )
                loss = causal_lm_loss(model)(logits, chunk) / 2
            loss.backward()
            total += loss.item()
        losses.append(total)
    return losses, _grads(model)


@pytest.mark.parametrize(
    "family, stages, stage_layers",
    [("gemma2", 2, None), ("gemma3_text", 3, None), ("gpt_neox", 3, None), ("qwen2", 2, None), ("llama", 2, (1, 3))],
)
def test_masked_stages_equal_the_single_process_masked_model(family, stages, stage_layers):
    ref_losses, ref_grads = _masked_run(family, stages, steps=2, attach=True, stage_layers=stage_layers)
    losses, grads = _masked_run(family, stages, steps=2, attach=False, stage_layers=stage_layers)
    assert losses == pytest.approx(ref_losses, rel=1e-6, abs=1e-7)
    assert grads.keys() == ref_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, **TOL, msg=name)


@pytest.mark.parametrize("family, stage_layers", [("gemma2", None), ("phi3", None), ("qwen2", (2, 1, 1))])
def test_composed_codec_stages_equal_the_single_process_model_with_the_codec(family, stage_layers):
    """The codecs fitted once on the attached model; the stages reuse those very codecs on the same model."""
    model = tiny_family(family)
    handle = attach_composed(model, 3, "outliers2+int4g15sr", seed=SEED, stage_layers=stage_layers)
    handle.calibrate(model, {"input_ids": _ids(99, rows=4)})
    ids = _ids(5)
    handle.set_step(0)
    reference = model(input_ids=ids, labels=ids)
    reference.loss.backward()
    expected = _grads(model)
    handle.remove()
    model.zero_grad()
    logits = _staged(model, ids, 3, codecs=handle.codecs, step=0, microbatch=0, stage_layers=stage_layers)
    causal_lm_loss(model)(logits, ids).backward()
    torch.testing.assert_close(logits, reference.logits, **TOL)
    for name, grad in expected.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, **TOL, msg=name)


@pytest.mark.parametrize("seq", [16, 256])
@pytest.mark.parametrize("family", SUPPORTED_MODEL_TYPES)
def test_the_memory_ledger_traces_what_every_familys_stages_save_within_15_percent(family, seq):
    """The ledger traces each stage on meta tensors with the masks a run builds (a sliding window's [B, 1, T, T]
    mask, which SDPA turns into an additive one in every layer); both lengths are past the window of 4."""
    model = tiny_family(family, hidden=64)
    untie_embeddings(model)
    settings = MemorySettings(num_replicas=2, num_stages=2, microbatch_size=2, microbatches=1, seq_len=seq)
    predicted = {row["stage"]: row["activations"] for row in predict_memory(model.config, settings)}
    for stage in (0, 1):
        module = StageModule(model, stage, 2, None, None)
        x = torch.randint(3, 90, (2, seq)) if stage == 0 else torch.randn(2, seq, 64, requires_grad=True)
        meter = ActivationMeter(module.parameters())
        with meter:
            out = module(x)
            if stage == 1:
                out = causal_lm_loss(model)(out, torch.randint(3, 90, (2, seq)))
        assert meter.peak > 0
        assert predicted[stage] == pytest.approx(meter.peak, rel=0.15), stage


def test_an_uneven_split_places_the_layers_and_boundaries_it_names():
    model = tiny_family("llama")
    assert [len(StageModule(model, s, 3, None, None, stage_layers=(1, 1, 2)).layers) for s in range(3)] == [1, 1, 2]
    assert StageModule(model, 2, 3, None, None, stage_layers=(1, 1, 2)).layer_range == range(2, 4)
    assert StageModule(model, 0, 3, None, None).stage_layers == (2, 1, 1)  # balanced: the earlier stages take more
    handle = attach_boundaries(model, 2, mask_ratio=P, stage_layers=(3, 1))
    assert handle.boundary_layers == [2]  # the boundary after layer 2 (0-based): stage 0 holds layers 0-2
    handle.remove()
    handle = attach_composed(model, 3, "outliers2+int8", stage_layers=(1, 2, 1))
    assert handle.boundary_layers == [0, 2]
    handle.remove()
