"""What both roles of a mesh process share: this process's stage of its replica's pipeline, on the Wire."""

from __future__ import annotations

import torch
from torch import nn

from .._validation import require
from ..anchor.link import anchor_matrices
from ..boundary.compose.codec import geometry_layout
from ..boundary.masking import private_rng
from ..comm.errors import naming_the_peers
from ..comm.messages import flatten
from ..comm.wire import LOCAL, Wire
from ..config import composed_codec
from ..dp.fragments import stage_fragments
from ..memory import MEMORY_PARTS, ActivationMeter, current_rss, peak_rss, tensor_bytes
from ..pipeline.messages import carried_lengths
from ..pipeline.placement import materialised_bytes, release_unowned, split_of, stage_of
from ..pipeline.schedule import MeshStage, build_schedule, run_schedule
from ..pipeline.stage import build_stage, causal_lm_loss, stage_parameter_names
from ..topology import MeshGroups
from .results import MeshResult
from .settings import Batches, RunSettings, StageView

__all__ = ["CALIBRATION_TAG", "StageWorker"]

CALIBRATION_TAG = 7001  # the codecs' one-off calibration pass between pipeline neighbours


class StageWorker:
    """Stage ``groups.stage`` of replica ``groups.replica``: its ``StageModule``, pipeline schedule,
    DiLoCo fragments and anchor matrices, its ``Wire`` and its ``MeshResult``."""

    role = "fast"

    def __init__(self, model: nn.Module, groups: MeshGroups, settings: RunSettings, batches: Batches) -> None:
        anchor = self.role == "anchor"
        self.groups, self.topology, self.settings, self.batches = groups, groups.topology, settings, batches
        self.rank, self.replica, self.stage = groups.rank, groups.replica, groups.stage
        self.wire = Wire()
        self.result = MeshResult(self.rank, self.replica, self.stage, self.role)
        self.model = model
        assert settings.config.mask_ratio is not None  # MeshConfig resolves it
        masked = not anchor and (settings.config.mask_ratio > 0 or composed_codec(settings.config) is not None)
        local = self.topology.local_boundaries
        self.module = build_stage(model, self.stage, self.topology.stages, settings.config, masked=masked, local=local)
        self._hold_only_this_stage()
        microbatches = (settings.anchor_microbatches or settings.microbatches) if anchor else settings.microbatches
        first = next(self.module.parameters())
        self.device, self.dtype = first.device, first.dtype
        self.microbatches = microbatches
        self.loss_fn = settings.loss(model, microbatches) if settings.loss is not None else causal_lm_loss(model)
        if hasattr(batches, "bind"):  # batches made through this replica's stages (RL's rollouts)
            batches.bind(self)
        self.build_pipe()
        self.fragments = stage_fragments(self.module, settings.config.dp_fragments)
        self.matrices = anchor_matrices(model, self.module)
        self.peer_hosts: dict[int, str] = {}  # pipeline neighbours' addresses (bootstrap fills it)
        self.activations = ActivationMeter(self.module.parameters())
        self._gradient_peak = 0
        self._rss_at_start = current_rss()
        self.carried_tokens = 0  # positions the last step's boundaries carried (its real tokens)
        self.step_compute_s = 0.0  # seconds the last pipeline step computed on this stage (MeshStage)

    def build_pipe(self) -> None:
        """This stage's ``MeshStage`` and 1F1B schedule, sized for its boundaries' payload widths now. A
        governed level switch changes those widths, so every stage of the replica rebuilds both at the
        same step (torch's schedule runs its start-up handshake with the neighbours again)."""
        settings = self.settings
        previous: MeshStage | None = getattr(self, "pipe", None)
        if previous is not None:  # the old stage's sends finish before it is let go
            previous.finish_step()
        self.pipe = MeshStage(
            self.module,
            group=self.groups.pp_group,
            device=self.device,
            microbatch_size=settings.microbatch_size,
            seq_len=settings.seq_len,
            dtype=self.dtype,
            wire=self.wire,
            anchor=self.role == "anchor",
            local=self.topology.local_boundaries,
        )
        self.schedule = build_schedule(self.pipe, self.microbatches, self.loss_fn)

    def _hold_only_this_stage(self) -> None:
        """Give back every tensor of the model this process's stage does not hold (a model loaded per
        stage by ``load_causal_lm`` holds no other already: its stage must be this process's)."""
        stages = self.topology.stages
        loaded = stage_of(self.model)
        require(
            loaded is None or loaded == (self.stage, stages),
            "model stage",
            loaded,
            f"be (stage, Y) = {(self.stage, stages)} of rank {self.rank}: the model was loaded for another "
            "stage (load it in the process that trains it, with the launched mesh's Y)",
        )
        split = split_of(self.model)
        require(
            loaded is None or split == self.module.stage_layers,
            "model stage_layers",
            split,
            f"equal the run's split {self.module.stage_layers} (decoder layers per stage): the model was loaded "
            "for another split (pass the run's stage_layers to load_causal_lm)",
        )
        self.result.released_bytes = release_unowned(self.model, self.module, self.stage, stages)

    # --- the codecs' geometry -------------------------------------------------------------------
    def calibrate_codecs(self) -> None:
        """Give this replica's composed codecs their geometry before the first step: one dense pipeline
        pass of ``batches(0)``. Stage ℓ receives stage ℓ-1's dense output and boundary ℓ-1's geometry,
        runs its layers dense, fits boundary ℓ's codec on its own output and sends both on, so the two
        sides of every boundary hold the same geometry (the sender's fit, received bit for bit). Governed,
        every level of the ladder is fitted on the same output and its geometry sent in turn. The pass
        runs up to the last coded boundary's receiver; a local boundary (no codec) only relays the dense
        output. Its bytes are booked on ``pp_fwd`` (``local`` over a local boundary) and those on
        ``pp_fwd`` counted in ``result.calibration_bytes``."""
        module = self.module
        codecs_in, codecs_out = module.side_codecs("in"), module.side_codecs("out")
        sides = codecs_in + codecs_out
        last = self._calibration_reach()
        if last is None or self.stage > last or (sides and all(c.ready for c in sides)):
            return
        ids, _ = self.batches(0)
        ids = ids.to(self.device)
        dtype = self.dtype
        before = self.wire.sent["pp_fwd"]
        group, replica, topology = self.groups.pp_group, self.replica, self.topology
        local = topology.local_boundaries
        with self.naming_link_failure("the codec calibration pass with", self._neighbours()):
            if self.stage > 0:
                src = topology.process_rank(topology.rank(replica, self.stage - 1))  # torch's rank (replica jobs)
                x = torch.empty(*ids.shape, module.hidden_size, dtype=dtype, device=self.device)
                self.wire.recv(LOCAL if self.stage - 1 in local else "pp_fwd", x, src, group=group, tag=CALIBRATION_TAG)
                for codec in codecs_in:
                    geometry: dict[str, torch.Tensor | None] = {}
                    for name, shape, kind in geometry_layout(codec):
                        geometry[name] = tensor = torch.empty(shape, dtype=kind)
                        self.wire.recv("pp_fwd", tensor, src, group=group, tag=CALIBRATION_TAG)
                    codec.load_geometry(geometry)
            else:
                x = ids
            if self.stage == last:
                return
            module.dense = True
            try:
                with torch.no_grad(), private_rng(self.device):
                    hidden = module(x)
            finally:
                module.dense = False
            dst = topology.process_rank(topology.rank(replica, self.stage + 1))
            circuit = LOCAL if self.stage in local else "pp_fwd"
            self.wire.send(circuit, hidden.contiguous(), dst, group=group, tag=CALIBRATION_TAG)
            for codec in codecs_out:
                codec.fit(hidden)
                geometry = codec.geometry()
                for name, _, _ in geometry_layout(codec):
                    fitted = geometry[name]
                    assert fitted is not None  # a fitted codec holds every tensor of its layout
                    self.wire.send("pp_fwd", fitted.contiguous(), dst, group=group, tag=CALIBRATION_TAG)
        self.result.calibration_bytes = self.wire.sent["pp_fwd"] - before

    def _calibration_reach(self) -> int | None:
        """The last stage the calibration pass reaches (the receiver of the replica's last coded boundary),
        None when no boundary of the replica has a codec that needs fitting. Every stage of the replica
        computes the same answer from the run's knobs and its local boundaries."""
        sides = self.module.side_codecs("in") + self.module.side_codecs("out")
        spec = sides[0].spec if sides else composed_codec(self.settings.config)
        if spec is None or not spec.needs_fit or self.role != "fast":
            return None
        coded = [b for b in range(self.topology.stages - 1) if b not in self.topology.local_boundaries]
        return max(coded) + 1 if coded else None

    # --- the pipeline ---------------------------------------------------------------------------
    def pipeline_step(self, ids: torch.Tensor, labels: torch.Tensor) -> float | None:
        """One pipeline step; a send/receive that fails or times out names the neighbours it waited on.
        With the causal-LM loss the boundaries carry each row up to its last labelled position
        (``pipeline.messages``), and ``carried_tokens`` counts those positions; a loss of its own (RL's)
        may read any position, so every one travels."""
        lengths = carried_lengths(labels) if self.settings.loss is None else None
        # every position of a row otherwise (an RL target is [B, T, k]: its positions, not its values, count)
        self.carried_tokens = int(lengths.sum()) if lengths is not None else labels.shape[0] * labels.shape[1]
        computed = self.pipe.compute_seconds
        with self.naming_link_failure("a message to or from", self._neighbours()), self.activations:
            loss = run_schedule(self.schedule, self.module, ids, labels, lengths)
        self.step_compute_s = self.pipe.compute_seconds - computed  # of the step: its waits are the rest
        grads = tensor_bytes([p.grad for p in self.module.parameters() if p.grad is not None])
        self._gradient_peak = max(self._gradient_peak, grads)
        return loss

    def naming_link_failure(self, what: str, peers: list[int]):
        """A context in which a network failure names this process, the step and ``peers`` with addresses."""
        topology = self.topology
        named = [
            f"rank {peer} (replica {topology.coords(peer)[0]}, stage {topology.coords(peer)[1]}) at "
            f"{self.peer_hosts.get(peer, 'an unknown address')}"
            for peer in peers
        ]
        who = f"rank {self.rank} ({self.role} replica {self.replica}, stage {self.stage})"
        return naming_the_peers(who, self.module.step, what, named, self.settings.link_timeout_s)

    def _neighbours(self) -> list[int]:
        stages = self.topology.stages
        return [self.topology.rank(self.replica, s) for s in (self.stage - 1, self.stage + 1) if 0 <= s < stages]

    # --- what a caller sees -----------------------------------------------------------------------
    def view(self, step: int, loss: float | None = None) -> StageView:
        return StageView(
            self.rank, self.replica, self.stage, self.role, step, loss, self._parameters, self._global_parameters
        )

    def _parameters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in stage_parameter_names(self.model, self.module).items()}

    def _global_parameters(self) -> list[torch.Tensor]:
        """θ_global of every fragment, flattened (overridden where another copy holds it)."""
        return [flatten([p.detach() for p in f.parameters()]) for f in self.fragments]

    # --- memory ---------------------------------------------------------------------------------
    def _state_bytes(self) -> dict[str, int]:
        """Bytes of the optimizer, anchor, DP and codec state this process keeps (``memory``)."""
        sides = self.module.side_codecs("in") + self.module.side_codecs("out")
        codecs = [c.geometry() for c in sides if c.ready]
        return {"optimizer": 0, "anchor": 0, "dp": 0, "codec": tensor_bytes(codecs)}

    def memory(self) -> dict[str, int]:
        """What this process holds, in bytes: ``memory.MEMORY_PARTS`` counted from the tensors,
        their sum (``counted``), the kernel's peak resident set and the resident set at the stage's start."""
        parts = {
            "weights": materialised_bytes(self.model),
            "gradients": self._gradient_peak,
            **self._state_bytes(),
            "activations": self.activations.peak,
        }
        parts = {name: int(parts[name]) for name in MEMORY_PARTS}
        return {
            **parts,
            "counted": sum(parts.values()),
            "peak_rss": peak_rss(),
            "rss_at_start": self._rss_at_start,
            "released": int(self.result.released_bytes),
        }

    def _finish(self, step: int) -> MeshResult:
        self.result.wire = self.wire.to_dict()
        self.result.memory = self.memory()
        view = self.view(step)
        for callback in self.settings.callbacks:
            callback.on_train_end(view)
        return self.result
