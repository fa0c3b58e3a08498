"""torchft's Streaming DiLoCo fragment with its pseudo-gradient averaging replaced: PowerSGD factors (or the
dense tensors), optionally as int8 codes, in buckets, every all-reduce booked on the ``Wire``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.distributed import ReduceOp
from torchft.local_sgd import _StreamingDiLoCoFragment

from ...comm.wire import Wire
from ..outer import OuterUpdate
from ..powersgd import PowerSGD
from ..quantize import Int8Codes, Int8Sum

__all__: list[str] = []


class _CompressedFragment(_StreamingDiLoCoFragment):
    """torchft's fragment whose pseudo-gradient averaging is PowerSGD (or dense) through ``Wire``.

    Adopted after torchft built it (``adopt``), so torchft's constructor, state-dict registration and
    sync schedule stay untouched. ``prepare_sync`` → ``_average_grads`` issues the all-reduces;
    ``perform_sync`` waits them, asks ``should_commit``, then (on commit) ``_set_grads`` decodes and
    the outer optimizer steps.
    """

    # set by ``adopt`` (torchft's constructor built the rest)
    _codec: PowerSGD | None
    _wire: Wire
    _on_update: Callable[[OuterUpdate], None] | None
    _quantizer: Int8Sum | None
    _q_quantizer: Int8Sum | None
    _coded: list[tuple[str, str]]
    _first_round: tuple[torch.Tensor, torch.Tensor, Any] | None
    _codes: tuple[torch.Tensor, torch.Tensor] | None
    _q_codes: tuple[list[str], torch.Tensor, torch.Tensor] | None
    _rounds: list[tuple[torch.Tensor, torch.Tensor]]
    _participants: int
    _factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    _update: OuterUpdate | None
    _pending: list[tuple[list[tuple[Any, torch.Tensor]], Any]]
    _keep: bool
    _prepared: dict[str, torch.Tensor]

    @classmethod
    def adopt(
        cls,
        fragment: _StreamingDiLoCoFragment,
        codec: PowerSGD | None,
        wire: Wire,
        on_update: Callable[[OuterUpdate], None] | None,
        *,
        keep_overlapped: bool = False,
        quantizers: tuple[Int8Sum, Int8Sum] | None = None,
    ) -> _CompressedFragment:
        fragment.__class__ = cls
        fragment._codec, fragment._wire, fragment._on_update = codec, wire, on_update
        # int8 codes: one coder for the P factors with the dense tensors, one for the Q factors
        fragment._quantizer, fragment._q_quantizer = quantizers or (None, None)
        fragment._coded = []  # (kind, name) of what the first int8 round carries, in order
        fragment._first_round = None  # (codes, block maxima, the codes' SUM all-reduce) of a first int8 round with P
        fragment._codes = None  # (int8 codes, block maxima) of the dense tensors, summed as perform_sync waits
        fragment._q_codes = None  # (names, int8 codes, block maxima) of the Q factors, summed likewise
        fragment._rounds = []  # (summed codes, block maxima) of every int8 round of the sync in flight
        fragment._participants = 0  # replicas coding the sync in flight (int8)
        fragment._factors = {}
        fragment._update = None
        fragment._pending = []  # (bucket views, its all-reduce) holding P factors, not yet turned into Q
        fragment._keep = keep_overlapped
        fragment._prepared = {}  # name → θ_local when the sync was prepared (keep_overlapped only)
        if codec is not None or quantizers is not None:
            fragment._register_codec_state()
        return fragment

    def _key(self, name: str) -> str:
        return f"{self._fragment_id}.{name}"

    def _register_codec_state(self) -> None:
        """Heal Q with the fragment (a recovering replica must warm-start from the same Q); e restarts."""
        names = [n for n, _ in self._model_fragment.named_parameters()]

        codec = self._codec

        def save() -> dict[str, torch.Tensor]:
            if codec is None:
                return {}
            return {n: codec.q[self._key(n)] for n in names if self._key(n) in codec.q}

        def load(state: dict[str, torch.Tensor]) -> None:
            for n in names:
                if self._quantizer is not None:  # error feedback is this replica's own: a healed one restarts it
                    self._quantizer.error.pop(self._key(n), None)
                if codec is None:
                    continue
                codec.error.pop(self._key(n), None)
                if n in state:
                    codec.q[self._key(n)] = state[n].float().clone()

        self._manager.register_state_dict_fn(f"PowerSGD_{self._fragment_id}", load, save)

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.AVG):
        def reduce(t: torch.Tensor):
            return self._manager.allreduce(t, reduce_op=op)

        return self._wire.all_reduce("dp", tensor, self._manager.num_participants(), reduce)

    def prepare_sync(self) -> None:
        if self._keep:  # θ_local now: what the overlapped inner steps are measured from
            self._prepared = {n: p.detach().clone() for n, p in self._model_fragment.named_parameters()}
        super().prepare_sync()

    def _average_grads(self) -> None:
        """Issue the averaging all-reduces of this fragment's pseudo-gradients (torchft appends, then waits).

        Every all-reduce on a WAN link costs its ring's round trips whatever its size, so the tensors go
        in buckets (``_buckets``): the compressed matrices' P factors with the dense tensors, in parameter
        order, then the Q factors, usually one all-reduce each for the whole fragment. Q = Mᵀ·orth(P̄)
        needs the averaged P, so ``finish_factors`` waits the first buckets, then sends the Q buckets,
        which torchft waits in ``perform_sync``. With τ ≥ 2 ``StreamingDiLoCo`` calls it
        ``p_round_steps`` inner steps after the prepare, so the P round trip overlaps inner steps instead
        of blocking the step that prepares the sync; with τ ≤ 1 ``perform_sync`` calls it before it waits.

        With int8 codes (``dp.quantize``) every all-reduce carries int8 codes instead: the P factors and
        the dense tensors (these with error feedback) go as one round, their block maxima all-reduced
        (MAX) and waited here (a few bytes a block: the codes need the shared maxima), then the codes
        sent (SUM), so the round's bytes travel while the overlapped inner steps run; ``finish_factors``
        waits them and sends the Q factors likewise.
        """
        items: list[tuple[tuple[str, str], torch.Tensor]] = []
        coded: list[tuple[tuple[str, str], torch.Tensor]] = []
        for name, _ in self._model_fragment.named_parameters():
            grad = self._grads[name]
            if self._codec is not None and self._codec.compresses(grad.shape):
                p = self._codec.p_factor(self._key(name), grad, consume=True)  # torchft's own temporary
                (coded if self._quantizer is not None else items).append((("p", name), p))
            elif self._quantizer is not None:
                coded.append((("dense", name), grad))
            else:
                items.append((("dense", name), grad))
        if coded:
            assert self._quantizer is not None  # coded only with int8 codes
            self._coded = [key for key, _ in coded]
            keys = [self._key(name) + ("/P" if kind == "p" else "") for (kind, name), _ in coded]
            factors = [key for key, ((kind, _), _) in zip(keys, coded) if kind == "p"]
            scales = self._quantizer.start([(key, t) for key, (_, t) in zip(keys, coded)], without_feedback=factors)
            self._all_reduce(scales, ReduceOp.MAX).wait()
            self._participants = self._manager.num_participants()
            codes = self._quantizer.codes(scales, self._participants)
            summed = self._all_reduce(codes, ReduceOp.SUM)
            self._rounds = [(codes, scales)]  # summed in place: the sync as it travelled (OuterUpdate.codes)
            if factors:
                self._first_round = codes, scales, summed
            else:
                self._allreduce_work.append(summed)
                self._codes = codes, scales
        for flat, views in _buckets(items):
            work = self._all_reduce(flat)
            for (kind, name), view in views:
                if kind == "dense":
                    self._grads[name] = view  # averaged in place once the work is waited
            if any(kind == "p" for (kind, _), _ in views):
                self._pending.append((views, work))
            else:
                self._allreduce_work.append(work)

    def finish_factors(self) -> None:
        """Wait the P buckets in flight, compute each Q and send the Q buckets (nothing pending: no-op).
        With int8 codes: wait the first round's codes, decode P (and the dense tensors), then code and
        send Q."""
        orth, items = {}, []
        if self._first_round is not None:
            (codes, scales, summed), self._first_round = self._first_round, None
            assert self._quantizer is not None and self._codec is not None  # a first round: int8 codes with P
            summed.wait()  # Q = Mᵀ·orth(P̄) needs the averaged P now
            for (kind, name), average in zip(self._coded, self._quantizer.decode(codes, scales)):
                if kind == "p":
                    orth[name], q = self._codec.q_factor(self._key(name), average)
                    items.append((name, q))
                else:  # its error feedback is kept when the sync commits (_set_grads)
                    self._grads[name] = average.to(self._grads[name].dtype)
            self._send_q_codes(orth, items)
            return
        pending, self._pending = self._pending, []
        for views, work in pending:
            work.wait()
            for (kind, name), p in views:
                if kind == "p":
                    assert self._codec is not None  # P factors come from it
                    orth[name], q = self._codec.q_factor(self._key(name), p)
                    items.append((name, q))
        for flat, views in _buckets(items):
            self._allreduce_work.append(self._all_reduce(flat))
            for name, q in views:
                self._factors[name] = (orth[name], q)  # q: a view of the bucket, averaged in place

    def _send_q_codes(self, orth: dict[str, torch.Tensor], items: list[tuple[str, torch.Tensor]]) -> None:
        """The Q factors as int8 codes, without error feedback of their own (PowerSGD's takes in what the
        codes leave out): block maxima all-reduced (MAX) and waited, then the codes (SUM, waited by
        ``perform_sync``)."""
        coder = self._q_quantizer
        assert coder is not None  # int8 codes
        keys = [self._key(name) + "/Q" for name, _ in items]
        scales = coder.start([(key, q) for key, (_, q) in zip(keys, items)], without_feedback=keys)
        self._all_reduce(scales, ReduceOp.MAX).wait()
        codes = coder.codes(scales, self._participants)
        self._allreduce_work.append(self._all_reduce(codes, ReduceOp.SUM))
        self._q_codes = [name for name, _ in items], codes, scales
        self._rounds.append((codes, scales))
        for name, q in items:
            self._factors[name] = (orth[name], q)  # Q: replaced by the decoded average in _set_grads

    def syncing(self) -> bool:
        """Whether this fragment has a sync in flight (all-reduces issued, not yet committed)."""
        return bool(self._allreduce_work or self._pending or self._first_round is not None)

    def _merge_parameters(self) -> None:
        """After the outer step the fragment holds θ_global. torchft's merge lerps back towards θ_local
        by ``fragment_update_alpha`` (0: the τ overlapped inner steps are dropped); with
        ``keep_overlapped`` they are kept instead: θ ← θ_global + (θ_local − θ_local at prepare)."""
        if not self._keep:
            super()._merge_parameters()
            return
        with torch.no_grad():
            for name, p in self._model_fragment.named_parameters():
                p.data.add_(self._local_parameters[name] - self._prepared[name])

    def _set_grads(self) -> None:
        """On commit: decode Δ̄ through ``OuterUpdate`` (so observers replay it bitwise), close the rounds."""
        named = list(self._model_fragment.named_parameters())
        if self._codes is not None:  # the int8 codes' sum, decoded to the average pseudo-gradients
            assert self._quantizer is not None
            codes, scales = self._codes
            for (_, name), average in zip(self._coded, self._quantizer.decode(codes, scales)):
                self._grads[name] = average.to(self._grads[name].dtype)
        if self._q_codes is not None:
            names, codes, scales = self._q_codes
            assert self._q_quantizer is not None
            for name, q in zip(names, self._q_quantizer.decode(codes, scales)):
                self._factors[name] = (self._factors[name][0], q.to(self._factors[name][0].dtype))
        if self._quantizer is not None and self._quantizer.busy():
            self._quantizer.commit()  # the dense tensors' error feedback
        tensors: list[torch.Tensor] = []
        for name, _ in named:
            tensors.extend(self._factors[name] if name in self._factors else (self._grads[name],))
        update = OuterUpdate(
            self._fragment_id,
            self._manager.current_step(),
            tensors,
            self._codec.rank if self._codec is not None else None,
            Int8Codes(self._participants, self._rounds) if self._rounds else None,
        )
        for (name, _), grad in zip(named, update.pseudo_gradients([p.shape for _, p in named])):
            if name in self._factors:
                assert self._codec is not None  # factors come from it
                self._codec.commit(self._key(name), grad, self._factors[name][1])
            self._grads[name] = grad
        self._update = update
        super()._set_grads()

    def perform_sync(self) -> bool:
        try:
            self.finish_factors()
            committed = super().perform_sync()
        finally:
            self._factors.clear()
            self._prepared = {}
            self._codes = self._first_round = self._q_codes = None
            self._rounds = []
            if self._codec is not None:
                self._codec.discard()
            if self._quantizer is not None:
                self._quantizer.discard()
                assert self._q_quantizer is not None  # adopted with _quantizer
                self._q_quantizer.discard()
        update, self._update = self._update, None
        if committed and update is not None and self._on_update is not None:
            self._on_update(update)
        return committed


BUCKET_BYTES = 16 * 2**20  # the most a DP all-reduce bucket copies; a larger tensor goes alone, uncopied


def _buckets(items: list[tuple[Any, torch.Tensor]]) -> list[tuple[torch.Tensor, list[tuple[Any, torch.Tensor]]]]:
    """Consecutive (key, tensor) pairs of one dtype and device, flattened into buckets of at most
    ``BUCKET_BYTES``: [(flat, [(key, view of flat shaped as its tensor), ...]), ...]. An all-reduce of
    ``flat`` in place averages every view; a bucket of one tensor is that tensor, not a copy."""
    groups: list[list[tuple[Any, torch.Tensor]]] = []
    size = 0
    for key, tensor in items:
        last = groups[-1][-1][1] if groups else None
        if (
            last is None
            or (last.dtype, last.device) != (tensor.dtype, tensor.device)
            or size + tensor.nbytes > BUCKET_BYTES
        ):
            groups.append([])
            size = 0
        groups[-1].append((key, tensor))
        size += tensor.nbytes
    out = []
    for group in groups:
        if len(group) == 1:
            key, tensor = group[0]
            flat = tensor.contiguous()
            out.append((flat, [(key, flat)]))
            continue
        flat = torch.cat([t.reshape(-1) for _, t in group])
        parts = flat.split([t.numel() for _, t in group])
        out.append((flat, [(key, part.view(t.shape)) for (key, t), part in zip(group, parts)]))
    return out
