"""The distributed pipeline equals the single-process masked model (multi-process, gloo, loopback)."""

from __future__ import annotations

import time

import pytest
import torch

from hf_meshtune.boundary.hooks import attach_boundaries
from hf_meshtune.boundary.masking import BoundaryMask, keep_count
from hf_meshtune.comm.wire import Wire
from hf_meshtune.pipeline.messages import HEADER_VALUES, carried_lengths
from hf_meshtune.pipeline.schedule import MeshStage, build_schedule, run_schedule
from hf_meshtune.pipeline.stage import StageModule, causal_lm_loss, stage_parameter_names, untie_embeddings
from hf_meshtune.topology import MeshTopology
from tests.tiny import tiny_family, tiny_llama

SEQ, MICRO, BATCH, HIDDEN, LAYERS, P = 12, 2, 8, 64, 4, 0.9


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randint(3, 100, (BATCH, SEQ), generator=gen)


def _masks(boundaries: int) -> list[BoundaryMask]:
    return [BoundaryMask(b, P, seed=7) for b in range(boundaries)]


def _model(arch: str):
    """The tiny model of family ``arch`` (its ``PIPELINE_FAMILIES`` switches on), untied as on the mesh: the first
    and last stages train their own copies of a tied embedding matrix."""
    model = tiny_llama(seed=0, layers=LAYERS, hidden=HIDDEN) if arch == "llama" else tiny_family(arch, HIDDEN, LAYERS)
    untie_embeddings(model)
    return model


def reference(
    num_stages: int,
    steps: int,
    arch: str = "llama",
    stage_layers: tuple[int, ...] | None = None,
    masked: bool = True,
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single process: the masked model (``masked=False``: the model itself, nothing at its boundaries) on the
    same microbatches; per-step loss, last step's grads."""
    model = _model(arch)
    handle = attach_boundaries(model, num_stages, mask_ratio=P, seed=7, stage_layers=stage_layers) if masked else None
    losses = []
    for step in range(steps):
        model.zero_grad()
        if handle is not None:
            handle.set_step(step)
        ids = _batch(step)
        chunks = ids.chunk(BATCH // MICRO)
        total = 0.0
        for chunk in chunks:
            loss = model(input_ids=chunk, labels=chunk).loss / len(chunks)
            loss.backward()
            total += loss.item()
        losses.append(total)
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _pipeline_worker(
    rank: int, world: int, steps: int, arch: str = "llama", stage_layers: tuple[int, ...] | None = None
) -> dict:
    topology = MeshTopology(replicas=1, stages=world, anchor=False, stage_layers=stage_layers)
    groups = topology.build_groups()
    model = _model(arch)
    masks = _masks(world - 1)
    stage = groups.stage
    module = StageModule(
        model,
        stage,
        world,
        masks[stage - 1] if stage > 0 else None,
        masks[stage] if stage < world - 1 else None,
        stage_layers=topology.stage_layers,
    )
    return run_stage(model, module, groups.pp_group, world, steps, Wire())


def run_stage(
    model, module: StageModule, group, world: int, steps: int, wire: Wire, labels_of=None, local: tuple[int, ...] = ()
) -> dict:
    """``steps`` pipeline steps of this rank's ``module`` on ``_batch(step)`` with ``labels_of(step)`` (default:
    the ids, every position labelled) through ``run_schedule``, which carries each row up to its last
    labelled position (``local``: the boundaries booked as local): last-stage losses, this stage's gradients
    after the last step, the wire's counters."""
    pipe = MeshStage(
        module,
        group=group,
        device=torch.device("cpu"),
        microbatch_size=MICRO,
        seq_len=SEQ,
        dtype=torch.float32,
        wire=wire,
        local=local,
    )
    schedule = build_schedule(pipe, BATCH // MICRO, causal_lm_loss(model))
    losses, started = [], time.perf_counter()
    for step in range(steps):
        model.zero_grad()
        module.step = step
        ids = _batch(step)
        labels = ids if labels_of is None else labels_of(step)
        losses.append(run_schedule(schedule, module, ids, labels, carried_lengths(labels)))
    wall = time.perf_counter() - started
    grads = {n: p.grad.clone() for n, p in stage_parameter_names(model, module).items() if p.grad is not None}
    return {"losses": losses, "grads": grads, "wire": wire.to_dict(), "compute_s": pipe.compute_seconds, "wall_s": wall}


def _assert_equals_reference(results: list[dict], ref_losses: list[float], ref_grads: dict) -> None:
    """The last stage's losses and every stage's gradients equal the single-process ones; together the stages
    hold a gradient for every parameter that has one there."""
    assert results[-1]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    seen = set()
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(ref_grads)


@pytest.mark.parametrize("stages", [2, 4])
def test_masked_pipeline_equals_single_process_masked_model(launcher, stages):
    steps = 2
    results = launcher(_pipeline_worker, stages, steps, timeout=180)
    _assert_equals_reference(results, *reference(stages, steps))
    # the wire: a header and the [MICRO·SEQ, K] kept values (every position is labelled), both ways, per boundary
    keep = keep_count(HIDDEN, P)
    per_message = MICRO * SEQ * keep * 4 + HEADER_VALUES * 8
    microbatches = BATCH // MICRO
    for stage, result in enumerate(results):
        sent = result["wire"]["sent"]
        expect_fwd = per_message * microbatches * steps if stage < stages - 1 else 0
        expect_bwd = per_message * microbatches * steps if stage > 0 else 0
        assert sent["pp_fwd"] == expect_fwd and sent["pp_bwd"] == expect_bwd
        assert result["wire"]["messages"]["pp_fwd"] == (2 * microbatches * steps if stage < stages - 1 else 0)


def test_an_uneven_split_pipeline_equals_the_single_process_model_split_the_same_way(launcher):
    """stage_layers = (3, 1): the boundary after layer 2, on both sides of the comparison."""
    steps = 2
    results = launcher(_pipeline_worker, 2, steps, "llama", (3, 1), timeout=180)
    _assert_equals_reference(results, *reference(2, steps, "llama", (3, 1)))
    assert len(results[0]["grads"]) > len(results[1]["grads"])  # stage 0 holds 3 of the 4 layers
    assert all(0 < r["compute_s"] < r["wall_s"] for r in results)  # computing is a part of each step


@pytest.mark.parametrize("arch", ["gemma2", "gpt_neox"])
def test_masked_pipeline_of_other_families_equals_their_single_process_masked_model(launcher, arch):
    """Gemma 2 (scaled embeddings, sliding layers with a window of 4 < T = 12, soft-capped logits, tied embeddings
    untied) and GPT-NeoX (its own module names, parallel residual) across two processes."""
    steps = 2
    results = launcher(_pipeline_worker, 2, steps, arch, timeout=180)
    _assert_equals_reference(results, *reference(2, steps, arch))
