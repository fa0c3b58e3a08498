"""The mesh on GPUs: its process group is gloo's, and GPU tensors cross gloo's point-to-point links
through CPU buffers. The CUDA runs themselves are ``benchmarks/wan/gpu_mesh_check.py`` (results in
``benchmarks/wan/results/gpu_mesh_check.json``); here, on the CPU, the rules and the staging logic,
with a meta tensor standing for a GPU one (any device but the CPU is staged)."""

from __future__ import annotations

import types

import pytest
import torch

from benchmarks.wan import gpu_mesh_check
from hf_meshtune.config.training import _require_gloo_backend
from tests.distributed import launch


def test_a_launched_process_gets_gloo_and_other_backends_are_refused(monkeypatch):
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    args = types.SimpleNamespace(ddp_backend=None)
    _require_gloo_backend(args)
    assert args.ddp_backend is None  # one process: accelerate creates no process group, nothing to choose
    monkeypatch.setenv("LOCAL_RANK", "0")  # launched: accelerate would pick NCCL on a GPU machine
    _require_gloo_backend(args)
    assert args.ddp_backend == "gloo"
    with pytest.raises(ValueError, match="ddp_backend='nccl' is invalid: it must be 'gloo' or unset"):
        _require_gloo_backend(types.SimpleNamespace(ddp_backend="nccl"))


def _staging(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from hf_meshtune.pipeline.messages import WireFormat
    from hf_meshtune.pipeline.schedule import _staged_recv, _staged_send

    group = dist.new_group([0])
    on_cpu = dist.P2POp(dist.isend, torch.arange(3.0), 0, group, 5)
    on_device = torch.empty(2, 3, dtype=torch.bfloat16, device="meta")
    new_recv = _staged_recv(dist.P2POp(dist.irecv, on_device, 0, group, 5))
    cpu_recv = _staged_recv(dist.P2POp(dist.irecv, torch.zeros(3), 0, group, 5))
    # a boundary message: header and body are CPU tensors whatever the payload's device; the body lands in
    # the stage's (device) buffer at the carried positions, zeros after
    form = WireFormat(record=8, width=2, dtype=torch.float32)
    payload = torch.arange(2 * 3 * 2, dtype=torch.float32).reshape(2, 3, 2)
    lengths = torch.tensor([3, 1])
    header, body = form.pack(payload, lengths)
    target = torch.full((2, 3, 2), 7.0)
    form.unpack(body, lengths, target)
    return {
        "send_unchanged": _staged_send(on_cpu) is on_cpu,
        "cpu_recv_unchanged": cpu_recv.tensor.device.type == "cpu" and cpu_recv.tag == 5,
        "recv_device": new_recv.tensor.device.type,
        "recv_shape": tuple(new_recv.tensor.shape),
        "recv_dtype": str(new_recv.tensor.dtype),
        "recv_peer_tag_group": (new_recv.peer, new_recv.tag, new_recv.group is group, new_recv.op is dist.irecv),
        "message_on_cpu": header.device.type == "cpu" and body.device.type == "cpu",
        "header": header.tolist(),
        "landed": target.tolist(),
    }


def test_pipeline_receives_of_device_tensors_land_in_cpu_buffers_then_in_the_device_buffer():
    (out,) = launch(_staging, 1)
    assert out["send_unchanged"] and out["cpu_recv_unchanged"]
    assert out["recv_device"] == "cpu" and out["recv_shape"] == (2, 3) and out["recv_dtype"] == "torch.bfloat16"
    assert out["recv_peer_tag_group"] == (0, 5, True, True)
    assert out["message_on_cpu"] and out["header"] == [4 * 8, 4, 8]
    assert out["landed"] == [[[0.0, 1.0], [2.0, 3.0], [4.0, 5.0]], [[6.0, 7.0], [0.0, 0.0], [0.0, 0.0]]]


def test_gpu_mesh_check_refuses_without_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "gpu_mesh_check.json"
    assert gpu_mesh_check.main(["--out", str(out)]) == 2
    assert "never falls back to the CPU" in capsys.readouterr().err
    assert not out.exists()


def test_the_committed_h200_mesh_runs_finished():
    # the committed JSON is the lent H200's run: every section finished without an error
    import json
    import os

    from benchmarks.wan.micro import RESULTS

    with open(os.path.join(RESULTS, "gpu_mesh_check.json")) as fh:
        data = json.load(fh)
    assert data["machine"]["gpu"] == "NVIDIA H200" and not data["errors"]
    for name in ("single_quality", "single_paper"):
        assert data[name]["gpu"]["device"] == "cuda:0" and data[name]["max_rel_loss_gap"] < 1e-3
    for name in ("mesh_1x2_quality", "mesh_3x2_paper"):
        assert data[name]["rc"] == 0 and data[name]["mesh_summary"]["steps"] == gpu_mesh_check.STEPS
