"""A composed boundary codec on the distributed pipeline equals the single-process model with the same codec
(multi-process, gloo, loopback), and what crosses is the packed message, not a dense tensor."""

from __future__ import annotations

import pytest
import torch

from hf_meshtune.boundary.compose.handle import attach_composed
from hf_meshtune.boundary.compose.spec import parse_codec
from hf_meshtune.comm.wire import Wire
from hf_meshtune.pipeline.stage import StageModule
from hf_meshtune.topology import MeshTopology
from tests.test_pipeline import BATCH, HIDDEN, LAYERS, MICRO, SEQ, _batch, run_stage
from tests.tiny import tiny_llama

SEED = 7

pytestmark = pytest.mark.slow  # three multi-process launches


def _calibrated(num_stages: int, codec: str):
    """The tiny model with ``codec`` attached and fitted on one dense batch (the same in every process)."""
    model = tiny_llama(seed=0, layers=LAYERS, hidden=HIDDEN)
    handle = attach_composed(model, num_stages, codec, seed=SEED)
    handle.calibrate(model, {"input_ids": _batch(99)})
    return model, handle


def reference(num_stages: int, codec: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, handle = _calibrated(num_stages, codec)
    losses = []
    for step in range(steps):
        model.zero_grad()
        handle.set_step(step)
        chunks = _batch(step).chunk(BATCH // MICRO)
        total = 0.0
        for chunk in chunks:
            loss = model(input_ids=chunk, labels=chunk).loss / len(chunks)
            loss.backward()
            total += loss.item()
        losses.append(total)
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class _RecordingWire(Wire):
    """A Wire that also keeps (circuit, dtype, shape, bytes) of every tensor it books."""

    def __init__(self) -> None:
        super().__init__()
        self.tensors: list[tuple[str, torch.dtype, tuple[int, ...], bytes]] = []

    def record_send(self, circuit: str, tensor: torch.Tensor) -> None:
        super().record_send(circuit, tensor)
        raw = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
        self.tensors.append((circuit, tensor.dtype, tuple(tensor.shape), raw))


def _worker(rank: int, world: int, codec: str, steps: int) -> dict:
    topology = MeshTopology(replicas=1, stages=world, anchor=False)
    groups = topology.build_groups()
    model, handle = _calibrated(world, codec)
    handle.remove()  # the stages apply the codecs themselves
    stage, codecs = groups.stage, handle.codecs
    module = StageModule(
        model,
        stage,
        world,
        None,
        None,
        codecs[stage - 1] if stage > 0 else None,
        codecs[stage] if stage < world - 1 else None,
    )
    wire = _RecordingWire()
    return {**run_stage(model, module, groups.pp_group, world, steps, wire), "sent": wire.tensors}


@pytest.mark.parametrize(
    ("stages", "codec"), [(2, "outliers2+int4g31sr"), (4, "outliers2+int4g31sr"), (4, "outliers4+spca12+int3")]
)
def test_a_composed_codec_on_the_pipeline_equals_the_single_process_model(launcher, stages, codec):
    steps = 2
    results = launcher(_worker, stages, codec, steps, timeout=180)
    ref_losses, ref_grads = reference(stages, codec, steps)
    # the same arithmetic on the same bytes: the tolerance is float reassociation between processes
    assert results[-1]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    seen = set()
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(ref_grads)
    # the wire: every boundary message is the packed payload, forward and backward
    spec = parse_codec(codec)
    message = spec.payload_bytes(HIDDEN, 4)
    assert message < HIDDEN * 4 // 3  # far below a dense fp32 hidden state
    per_step = BATCH // MICRO
    for stage, result in enumerate(results):
        sends = result["sent"]
        fwd = [s for s in sends if s[0] == "pp_fwd"]
        bwd = [s for s in sends if s[0] == "pp_bwd"]
        assert len(fwd) == (per_step * steps if stage < stages - 1 else 0)
        assert len(bwd) == (per_step * steps if stage > 0 else 0)
        for _, dtype, shape, raw in fwd + bwd:
            assert dtype == torch.float32 and shape == (MICRO, SEQ, message // 4)
            assert len(raw) == MICRO * SEQ * message
        assert result["wire"]["sent"]["pp_fwd"] == len(fwd) * MICRO * SEQ * message
