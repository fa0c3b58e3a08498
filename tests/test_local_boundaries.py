"""Local boundaries: two stages on one host (``MeshTopology.local_boundaries``, what ``meshtune launch
--hosts`` exports) cross dense, with no codec, booked on the ``local`` circuit and never on ``pp_*``.

Multi-process (gloo on loopback): a two-stage pipeline whose boundary is local equals the single-process
model with nothing at its boundary (the compressed path with the codec off); a three-stage replica with
boundary 0 local and boundary 1 coded calibrates the codec through the local boundary and books each
boundary on its own circuit.
"""

from __future__ import annotations

import pytest
import torch

from hf_meshtune.comm.wire import Wire
from hf_meshtune.config import MeshConfig
from hf_meshtune.pipeline.messages import HEADER_VALUES
from hf_meshtune.pipeline.stage import build_stage
from hf_meshtune.topology import LOCAL_BOUNDARIES_ENV, MeshTopology
from tests.test_pipeline import BATCH, HIDDEN, MICRO, SEQ, _model, reference, run_stage

CODEC = "outliers8+int8"


def _local_worker(rank: int, world: int, steps: int) -> dict:
    topology = MeshTopology(replicas=1, stages=world, anchor=False, local_boundaries=(0,))
    groups = topology.build_groups()
    model = _model("llama")
    cfg = MeshConfig(num_stages=world, anchor=False, mask_ratio=0.0, boundary_codec=CODEC)
    module = build_stage(model, groups.stage, world, cfg, masked=True, local=topology.local_boundaries)
    codecs = len(module.side_codecs("in") + module.side_codecs("out"))
    out = run_stage(model, module, groups.pp_group, world, steps, Wire(), local=topology.local_boundaries)
    out["codecs"] = codecs
    return out


def test_a_local_boundary_is_dense_equals_the_model_and_books_only_local_bytes(launcher):
    steps = 2
    results = launcher(_local_worker, 2, steps, timeout=180)
    losses, grads = reference(2, steps, masked=False)
    assert [r["codecs"] for r in results] == [0, 0]  # the codec is off on the local boundary
    assert results[-1]["losses"] == pytest.approx(losses, rel=1e-5, abs=1e-6)
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # a header and the dense [MICRO·SEQ, H] float32 values, per microbatch and step, each way
    per_message = MICRO * SEQ * HIDDEN * 4 + HEADER_VALUES * 8
    sends = BATCH // MICRO * steps
    for stage, result in enumerate(results):
        sent = result["wire"]["sent"]
        assert sent["pp_fwd"] == sent["pp_bwd"] == 0  # nothing on the WAN circuits
        assert sent["local"] == per_message * sends


def _mixed_worker(rank: int, world: int) -> dict:
    from hf_meshtune.runtime.settings import RunSettings
    from hf_meshtune.runtime.worker import FastWorker
    from tests.test_mesh import MICRO as MESH_MICRO
    from tests.test_mesh import MICROBATCHES, _batches
    from tests.test_mesh import SEQ as MESH_SEQ

    topology = MeshTopology(replicas=1, stages=3, anchor=False, local_boundaries=(0,))
    groups = topology.build_groups(dp_peers=True)
    cfg = MeshConfig(num_stages=3, num_replicas=1, anchor=False, mask_ratio=0.0, boundary_codec=CODEC)
    settings = RunSettings(
        config=cfg,
        microbatch_size=MESH_MICRO,
        microbatches=MICROBATCHES,
        seq_len=MESH_SEQ,
        max_steps=3,
        lr=1e-3,
        dp_mode="allreduce",
    )
    worker = FastWorker(_model("llama"), groups, settings, _batches(0))
    codecs = {side: [c.ready for c in worker.module.side_codecs(side)] for side in ("in", "out")}
    result = worker.run()
    return {"codecs": codecs, "wire": result.wire, "calibration": result.calibration_bytes, "losses": result.losses}


def test_a_replica_with_one_local_and_one_coded_boundary_calibrates_through_the_local_one(launcher):
    results = launcher(_mixed_worker, 3, timeout=240)
    # stage 0 holds no codec (boundary 0 is local), stage 1 codes its output, stage 2 decodes its input: fitted
    assert [r["codecs"] for r in results] == [
        {"in": [], "out": []},
        {"in": [], "out": [True]},
        {"in": [True], "out": []},
    ]
    s0, s1, s2 = (r["wire"]["sent"] for r in results)
    assert s0["pp_fwd"] == 0 and s0["local"] > 0  # stage 0 → 1 only on the local circuit
    assert s1["local"] > 0 and s1["pp_fwd"] > 0  # gradients back to stage 0 local, activations to 2 coded
    assert s2["pp_bwd"] > 0 and s2["local"] == 0
    assert results[0]["calibration"] == 0 and results[1]["calibration"] > 0  # the geometry crosses boundary 1 only
    # the coded boundary sends int8 codes: fewer bytes per message than the dense local one
    assert s1["pp_fwd"] < s0["local"]
    assert len(results[2]["losses"]) == 3 and all(loss == loss for loss in results[2]["losses"])


@pytest.mark.parametrize(("text", "rule"), [("1", "[0, 1)"), ("0,0", "each once"), ("x", "comma-separated")])
def test_bad_local_boundaries_are_refused_naming_the_variable(monkeypatch, text, rule):
    monkeypatch.setenv(LOCAL_BOUNDARIES_ENV, text)
    with pytest.raises(ValueError, match=LOCAL_BOUNDARIES_ENV) as info:
        MeshTopology.from_environment(2, 2, anchor=False, num_layers=4, mesh="1x2")
    assert rule in str(info.value)
