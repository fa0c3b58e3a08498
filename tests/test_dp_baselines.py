"""The per-step DP peers (``dp_baselines.GradientSync``) against DDP itself and a plain all-reduce."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_meshtune.comm.wire import Wire
from hf_meshtune.dp.baselines import GradientSync

STEPS = 5


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 3))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 12, generator=gen), torch.randn(6, 3, generator=gen)


def _compare_with_ddp(rank: int, world: int, mode: str) -> dict:
    """Each step: the same per-rank gradients averaged by GradientSync and by DDP (plain all-reduce
    averaging, or DDP with the same PowerSGD hook registered)."""
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    ours, reference = _model(), _model()
    ddp = DistributedDataParallel(reference, bucket_cap_mb=1000)  # one bucket, as GradientSync uses
    if mode == "powersgd_hook":
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=0
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    wire = Wire()
    sync = GradientSync(mode, list(ours.parameters()), None, world, wire, powersgd_rank=2, start_iter=2, seed=0)
    diffs, booked = [], []
    for step in range(STEPS):
        x, y = _batch(rank, step)
        for model in (ours, ddp):
            model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ours(x), y).backward()
        before = wire.booked["dp"]
        sync.sync()
        booked.append(wire.booked["dp"] - before)
        nn.functional.mse_loss(ddp(x), y).backward()
        diffs.append(
            max((a.grad - b.grad).abs().max().item() for a, b in zip(ours.parameters(), reference.parameters()))
        )
    return {"diffs": diffs, "booked": booked, "numel": sum(p.numel() for p in ours.parameters())}


@pytest.mark.parametrize("mode", ["allreduce", "powersgd_hook"])
def test_gradient_sync_equals_ddp_with_the_same_hook(launcher, mode):
    results = launcher(_compare_with_ddp, 2, mode, timeout=90)
    for result in results:
        assert max(result["diffs"]) < 1e-6, result["diffs"]
    booked = results[0]["booked"]
    full = 2.0 * (2 - 1) / 2 * results[0]["numel"] * 4  # ring traffic of one dense all-reduce per rank
    if mode == "allreduce":
        assert booked == [full] * STEPS
    else:
        assert booked[:2] == [full, full]  # torch's hook all-reduces densely for start_powerSGD_iter steps
        assert all(0 < b < full / 2 for b in booked[2:]), booked  # then P, Q and the 1-D tensors only


def test_gradient_sync_refuses_a_mode_it_does_not_run():
    with pytest.raises(
        ValueError, match=r"dp_mode='streaming_diloco' is invalid: it must be one of \['allreduce', 'powersgd_hook'\]"
    ):
        GradientSync("streaming_diloco", [nn.Parameter(torch.zeros(2))], None, 2, Wire())
    with pytest.raises(ValueError, match=r"dp_powersgd_rank=0 is invalid"):
        GradientSync("powersgd_hook", [nn.Parameter(torch.zeros(2, 2))], None, 2, Wire(), powersgd_rank=0)
