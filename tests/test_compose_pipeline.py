"""A composed boundary codec on the distributed pipeline equals the single-process model with the same codec
(multi-process, gloo, loopback) on rows of different lengths, and what crosses is a header and the packed
records of the carried positions only (coded where the codec ends in a coder), not a padded tensor."""

from __future__ import annotations

import pytest
import torch

from hf_meshtune.boundary.compose.entropy import decode_records
from hf_meshtune.boundary.compose.grammar import parse_codec
from hf_meshtune.boundary.compose.handle import attach_composed
from hf_meshtune.comm.wire import Wire
from hf_meshtune.pipeline.messages import carried_lengths
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


def _labels(step: int) -> torch.Tensor:
    """The ids as labels with each row cut at its own length (padding after it, as a collator leaves it); row 3
    has no label at all, so it carries nothing (its microbatch partner does)."""
    labels = _batch(step).clone()
    for row in range(BATCH):
        labels[row, 2 + (5 * row + 3 * step) % (SEQ - 2) :] = -100
    labels[3] = -100
    return labels


def reference(num_stages: int, codec: str, steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, handle = _calibrated(num_stages, codec)
    losses = []
    for step in range(steps):
        model.zero_grad()
        handle.set_step(step)
        chunks = _batch(step).chunk(BATCH // MICRO)
        label_chunks = _labels(step).chunk(BATCH // MICRO)
        total = 0.0
        for chunk, labels in zip(chunks, label_chunks):
            loss = model(input_ids=chunk, labels=labels).loss / len(chunks)
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
    return {**run_stage(model, module, groups.pp_group, world, steps, wire, _labels), "sent": wire.tensors}


@pytest.mark.parametrize(
    ("stages", "codec"),
    [
        (2, "outliers2+int4g31sr"),
        (4, "outliers2+rot16+int4g16e8m0/rot32+int6g32sr+zstd"),  # rotated, asymmetric, entropy-coded
        (4, "outliers4+spca12+int3"),
    ],
)
def test_a_composed_codec_on_the_pipeline_equals_the_single_process_model(launcher, stages, codec):
    steps = 2
    results = launcher(_worker, stages, codec, steps, timeout=180)
    ref_losses, ref_grads = reference(stages, codec, steps)
    # the same arithmetic on the same bytes: the tolerance is float reassociation between processes (the
    # receiver's zeros after a row's length change no carried position: attention is causal)
    assert results[-1]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    seen = set()
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
            seen.add(name)
    assert seen == set(ref_grads)
    # the wire: per microbatch a header (body bytes, carried rows, record bytes) and a body of exactly the
    # carried positions' records (coded: decoding gives them back), nothing for the padding
    spec = parse_codec(codec)
    per_step = BATCH // MICRO
    carried = [carried_lengths(_labels(step)).split(MICRO) for step in range(steps)]
    for stage, result in enumerate(results):
        for circuit, direction, active in (("pp_fwd", "fwd", stage < stages - 1), ("pp_bwd", "bwd", stage > 0)):
            sends = [s for s in result["sent"] if s[0] == circuit]
            assert len(sends) == (2 * per_step * steps if active else 0)
            record = spec.side(direction).message_bytes(HIDDEN, 4)
            for i in range(0, len(sends), 2):
                (_, kind, _, head), (_, body_kind, _, body) = sends[i], sends[i + 1]
                size, rows, width = torch.frombuffer(bytearray(head), dtype=torch.int64).tolist()
                assert kind == torch.int64 and body_kind == torch.uint8 and width == record and size == len(body)
                assert rows in {int(lengths.sum()) for step in carried for lengths in step}
                if spec.entropy is None:
                    assert size == rows * record
                else:
                    records = decode_records(body, rows, record, spec.entropy)
                    assert records.shape == (rows, record)
            expected = sum(len(s[3]) for s in sends)
            assert result["wire"]["sent"][circuit] == expected
    padded = BATCH * SEQ * steps
    real = sum(int(lengths.sum()) for step in carried for lengths in step)
    assert real < 0.7 * padded  # the rows really are of different lengths
