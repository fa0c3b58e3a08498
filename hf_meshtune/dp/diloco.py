"""Streaming DiLoCo of one pipeline stage with PowerSGD pseudo-gradients, on torchft's ``DiLoCo``.

Fast replicas take ``sync_every`` (S) inner steps, then average a pseudo-gradient Δθ = θ_global − θ_local
and apply it with an outer Nesterov SGD step (DiLoCo, Douillard et al. 2023, arXiv 2311.08105).
Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits each stage into F fragments that sync
at staggered inner steps, one every S/F steps, each sync able to overlap ``fragment_sync_delay`` (τ)
following inner steps. Before the all-reduce the pseudo-gradient of every large matrix is compressed
to rank r with PowerSGD (``dp.powersgd``), so a [m, n] matrix travels as r·(m+n) numbers.

torchft has no compressor hook, so this is the one module of the library that reaches into torchft's
private internals (``TORCHFT_INTERNALS`` lists each one; ``require_torchft_internals`` fails naming the
one a torchft release moved): PowerSGD replaces the fragment's pseudo-gradient averaging
(``_StreamingDiLoCoFragment._average_grads``), every all-reduce goes through ``Wire.all_reduce("dp", …)``
so its bytes are counted, and the checkpoint server is named by the address peers reach it at.
"""

from __future__ import annotations

import socket
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from importlib.metadata import version
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.distributed import ReduceOp
from torchft import Manager
from torchft import local_sgd as torchft_local_sgd
from torchft.checkpointing import http_transport as torchft_http_transport
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.local_sgd import DiLoCo, _StreamingDiLoCoFragment

from .._validation import require
from ..comm.listen import listen_address
from ..comm.wire import Wire
from ..runtime.memory import tensor_bytes
from .outer import OuterUpdate, check_outer, outer_optimizer
from .powersgd import PowerSGD, is_int
from .quantize import QUANTIZERS, Int8Codes, Int8Sum

__all__ = ["TORCHFT_INTERNALS", "AdvertisedHTTPTransport", "StreamingDiLoCo", "require_torchft_internals"]

# Every private torchft name this module relies on: (owner, attribute, what it is for).
TORCHFT_INTERNALS = (
    ("torchft.local_sgd", "_StreamingDiLoCoFragment", "the fragment class whose averaging PowerSGD replaces"),
    ("_StreamingDiLoCoFragment", "_average_grads", "issues the pseudo-gradient all-reduces"),
    ("_StreamingDiLoCoFragment", "_set_grads", "sets the averaged pseudo-gradients before the outer step"),
    ("_StreamingDiLoCoFragment", "perform_sync", "waits the all-reduces, commits, steps the outer optimizer"),
    ("_StreamingDiLoCoFragment", "prepare_sync", "takes the pseudo-gradients and starts their all-reduces"),
    ("_StreamingDiLoCoFragment", "_merge_parameters", "mixes θ_local back in after the outer step"),
    ("fragment", "_local_parameters", "θ_local as perform_sync found it (name → tensor)"),
    ("fragment", "_fragment_id", "the fragment's index"),
    ("fragment", "_model_fragment", "the fragment's module"),
    ("fragment", "_grads", "name → pseudo-gradient of the sync in flight"),
    ("fragment", "_allreduce_work", "the all-reduce works torchft waits in perform_sync"),
    ("fragment", "_manager", "the fragment's torchft Manager"),
    ("fragment", "_outer_optimizer", "the fragment's outer optimizer"),
    ("fragment", "original_parameters", "θ_global of the fragment (name → tensor)"),
    ("DiLoCo", "_fragments", "the fragments DiLoCo built"),
    ("DiLoCo", "_local_step", "inner steps since the last sync"),
    ("DiLoCo", "_manager", "DiLoCo's Manager"),
    ("HTTPTransport", "_server", "the checkpoint server's socket (its port)"),
)


def require_torchft_internals(diloco: DiLoCo | None = None, transport: HTTPTransport | None = None) -> None:
    """A RuntimeError naming the first private torchft attribute this module uses that is missing
    (on the classes, and on ``diloco``'s fragments / ``transport`` when given)."""
    owners: dict[str, list[Any]] = {
        "torchft.local_sgd": [torchft_local_sgd],
        "_StreamingDiLoCoFragment": [_StreamingDiLoCoFragment],
        "fragment": list(diloco._fragments) if diloco is not None and hasattr(diloco, "_fragments") else [],
        "DiLoCo": [diloco] if diloco is not None else [],
        "HTTPTransport": [transport] if transport is not None else [],
    }
    for owner, attribute, purpose in TORCHFT_INTERNALS:
        for obj in owners[owner]:
            if not hasattr(obj, attribute):
                raise RuntimeError(
                    f"torchft {version('torchft')} has no {owner}.{attribute} ({purpose}); hf_meshtune's "
                    "DiLoCo adapter (hf_meshtune/dp/diloco.py) needs it: use torchft 0.2.x or update the adapter"
                )


class _CompressedFragment(_StreamingDiLoCoFragment):
    """torchft's fragment whose pseudo-gradient averaging is PowerSGD (or dense) through ``Wire``.

    Adopted after torchft built it (``adopt``), so torchft's constructor, state-dict registration and
    sync schedule stay untouched. ``prepare_sync`` → ``_average_grads`` issues the all-reduces;
    ``perform_sync`` waits them, asks ``should_commit``, then (on commit) ``_set_grads`` decodes and
    the outer optimizer steps.
    """

    _codec: PowerSGD | None
    _wire: Wire
    _on_update: Callable[[OuterUpdate], None] | None

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

    def _all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.AVG):
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
        items, coded = [], []
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
            codes, scales = self._codes
            for (_, name), average in zip(self._coded, self._quantizer.decode(codes, scales)):
                self._grads[name] = average.to(self._grads[name].dtype)
        if self._q_codes is not None:
            names, codes, scales = self._q_codes
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
                self._q_quantizer.discard()
        update, self._update = self._update, None
        if committed and update is not None and self._on_update is not None:
            self._on_update(update)
        return committed


# =============================================================================================
# Public entry: the Streaming DiLoCo context manager of one stage
# =============================================================================================


def p_round_steps(fragments: list[nn.Module], codec: PowerSGD | None, delay: int) -> int:
    """Of the τ = ``delay`` inner steps a sync overlaps, how many the first round (PowerSGD's P factors with the
    dense tensors) travels before ``finish_factors`` waits it; Q's round gets the rest. Split by the rounds'
    values over every fragment (on a link that carries nothing else a round's time goes with its bytes),
    at least one step each: P's round is the larger where a vocabulary-sized matrix is compressed (P = [m, r]
    for a tall [m, n]), and waiting it half-way would stall the step that waits it."""
    if delay < 2:
        return delay
    first = second = 0
    for fragment in fragments:
        for p in fragment.parameters():
            if codec is not None and codec.compresses(p.shape):
                first, second = first + p.shape[0] * codec.rank, second + p.shape[1] * codec.rank
            else:
                first += p.numel()
    share = first / (first + second) if first + second else 0.5
    return min(delay - 1, max(1, round(delay * share)))


class StreamingDiLoCo:
    """Streaming DiLoCo of one pipeline stage with PowerSGD pseudo-gradients (paper §2.4).

    Wraps ``torchft.local_sgd.DiLoCo``: on entry it hooks ``inner_optimizer.step``; every S/F inner
    steps one fragment (in turn) averages Δθ = θ_global − θ_local across the fast replicas and applies
    the outer Nesterov SGD step (``outer_lr`` η_out, ``outer_momentum`` μ_out). ``sync_every`` (S),
    the number of fragments (F) and ``fragment_sync_delay`` (τ) must be the same on every stage and
    replica. With τ > 0 the sync's pseudo-gradient is taken τ inner steps before it is applied; after
    the outer step the fragment's parameters become (1−α)·θ_global + α·θ_local with
    ``fragment_update_alpha`` α, so with α = 0 (torchft's default) the τ overlapped inner steps of that
    fragment are dropped; ``keep_overlapped`` keeps them instead: θ_global + (θ_local − θ_local at the
    prepare). With τ ≥ 2 the PowerSGD P round (P factors with the dense tensors) overlaps the first of
    those steps and Q's the rest, split by their bytes (``p_round_steps``; the same numbers as waiting P
    at the prepare, later). ``powersgd_rank`` (r) None sends
    Δθ dense, exactly torchft's averaging. ``quantize="int8"`` sends every all-reduce as int8 codes with
    shared block scales (``dp.quantize``): the dense tensors with error feedback of their own, PowerSGD's
    factors under PowerSGD's. Every all-reduce is booked on ``wire`` (``self.wire``, a fresh ``Wire`` if
    None) under "dp". Every committed sync's ``OuterUpdate`` is kept until ``take_committed()`` (what a
    training loop reads after its optimizer step); ``on_outer_update``, if given, is also called with it
    inside the step.

    Example:
        >>> manager = make_manager(replica=r, stage=s, num_stages=Y, lighthouse_addr=addr,
        ...                        store_addr=host, store_port=port)
        >>> with StreamingDiLoCo(manager, [stage_module], inner_opt, sync_every=8, powersgd_rank=4):
        ...     for batch in batches:
        ...         loss_fn(stage_module, batch).backward(); inner_opt.step(); inner_opt.zero_grad()
    """

    def __init__(
        self,
        manager: Manager,
        fragments: list[nn.Module],
        inner_optimizer: torch.optim.Optimizer,
        *,
        sync_every: int,
        fragment_sync_delay: int = 0,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        powersgd_rank: int | None,
        wire: Wire | None = None,
        on_outer_update: Callable[[OuterUpdate], None] | None = None,
        seed: int = 0,
        fragment_update_alpha: float = 0.0,
        keep_overlapped: bool = False,
        quantize: str | None = None,
    ) -> None:
        _validate(fragments, sync_every, fragment_sync_delay, outer_lr, outer_momentum, powersgd_rank)
        require(quantize in (None, *QUANTIZERS), "quantize", quantize, f"be None or one of {list(QUANTIZERS)}")
        require(
            isinstance(fragment_update_alpha, (int, float)) and 0 <= fragment_update_alpha <= 1,
            "fragment_update_alpha",
            fragment_update_alpha,
            "lie in [0, 1]",
        )
        require(
            keep_overlapped is False or fragment_update_alpha == 0,
            "fragment_update_alpha",
            fragment_update_alpha,
            "be 0 with keep_overlapped (the overlapped steps are kept whole, not mixed)",
        )
        self.wire = wire if wire is not None else Wire()
        self._inner = inner_optimizer
        interval = sync_every // len(fragments)
        # the inner step (counted from the last sync) after which the P all-reduces are waited, so P's and Q's
        # rounds both overlap inner steps (τ ≤ 1: None, perform_sync waits them)
        self.codec = PowerSGD(powersgd_rank, seed) if powersgd_rank is not None else None
        p_steps = p_round_steps(fragments, self.codec, fragment_sync_delay)
        self._finish_at = interval - fragment_sync_delay + p_steps if fragment_sync_delay > 1 else None
        self._hook = None
        self.quantizer = Int8Sum() if quantize is not None else None  # the dense tensors' error feedback is here
        quantizers = None if quantize is None else (self.quantizer, Int8Sum())
        self.fragments = fragments
        outer = [outer_optimizer(f.parameters(), outer_lr, outer_momentum) for f in fragments]
        self._diloco = DiLoCo(
            manager,
            fragments,
            inner_optimizer,
            outer,
            sync_every=sync_every,
            fragment_sync_delay=fragment_sync_delay,
            fragment_update_alpha=fragment_update_alpha,
        )
        require_torchft_internals(self._diloco)
        self._committed: list[OuterUpdate] = []
        self._on_outer_update = on_outer_update
        for fragment in self._diloco._fragments:
            _CompressedFragment.adopt(
                fragment,
                self.codec,
                self.wire,
                self._on_commit,
                keep_overlapped=keep_overlapped,
                quantizers=quantizers,
            )

    def _on_commit(self, update: OuterUpdate) -> None:
        self._committed.append(update)
        if self._on_outer_update is not None:
            self._on_outer_update(update)

    def take_committed(self) -> list[OuterUpdate]:
        """The syncs committed since the last call, oldest first (each fragment's in commit order)."""
        committed, self._committed = self._committed, []
        return committed

    def global_parameters(self, fragment: int) -> list[torch.Tensor]:
        """θ_global of one fragment (the parameters of its last committed sync), in parameter order."""
        saved = self._diloco._fragments[fragment].original_parameters
        return [saved[name].clone() for name, _ in self.fragments[fragment].named_parameters()]

    def sync_tensors(self) -> list[torch.Tensor]:
        """θ_global and the outer momentum of every fragment as committed so far, in the order the
        anchor's follower loads them (``anchor.follower.OuterFollower.load_sync``): per fragment its
        parameters, then their momentum (zeros before a fragment's first sync, which Nesterov SGD's first
        step treats the same as none)."""
        out = []
        for fragment, ft_fragment in zip(self.fragments, self._diloco._fragments):
            named = list(fragment.named_parameters())
            state = ft_fragment._outer_optimizer.state
            out += [_cpu_copy(ft_fragment.original_parameters[name]) for name, _ in named]
            for _, param in named:
                buffer = state.get(param, {}).get("momentum_buffer")
                out.append(torch.zeros(param.shape) if buffer is None else _cpu_copy(buffer))
        return out

    def state_bytes(self) -> int:
        """Bytes this stage keeps for DP: θ_global of every fragment, the outer momentum, PowerSGD's Q
        and error feedback (``runtime.memory``)."""
        held = [[f.original_parameters, f._outer_optimizer.state] for f in self._diloco._fragments]
        if self.codec is not None:
            held.append([self.codec.q, self.codec.error])
        if self.quantizer is not None:
            held.append(self.quantizer.error)
        return tensor_bytes(held)

    def state_dict(self) -> dict:
        """Everything a resumed run needs to sync exactly as this one would have: inner steps since the
        last sync, θ_global and outer momentum of every fragment, PowerSGD's Q and error feedback, and
        the torchft manager's step (which fragment syncs next). Only between syncs: with a fragment's
        all-reduces in flight the state would miss them (a ValueError says so)."""
        fragments = self._diloco._fragments
        busy = [i for i, f in enumerate(fragments) if f.syncing()]
        require(
            not busy,
            "DiLoCo state",
            f"fragments {busy} syncing",
            "be taken between syncs (at a multiple of dp_sync_every / dp_fragments inner steps)",
        )
        return {
            "local_step": self._diloco._local_step,
            "manager": self._diloco._manager.state_dict(),
            "fragments": [
                {
                    "original": {n: t.clone() for n, t in f.original_parameters.items()},
                    "outer": f._outer_optimizer.state_dict(),
                }
                for f in fragments
            ],
            "codec": None if self.codec is None else {"q": dict(self.codec.q), "error": dict(self.codec.error)},
            "int8_error": None if self.quantizer is None else dict(self.quantizer.error),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state (same fragments, sync period and PowerSGD rank)."""
        fragments = self._diloco._fragments
        require(
            len(state["fragments"]) == len(fragments),
            "dp_fragments",
            len(fragments),
            f"equal the checkpoint's {len(state['fragments'])} fragments",
        )
        self._diloco._local_step = int(state["local_step"])
        self._diloco._manager.load_state_dict(state["manager"])
        with torch.no_grad():
            for fragment, saved in zip(fragments, state["fragments"]):
                for name, value in saved["original"].items():
                    fragment.original_parameters[name].copy_(value)
                fragment._outer_optimizer.load_state_dict(saved["outer"])
        if self.codec is not None and state["codec"] is not None:
            self.codec.q = {k: v.float().clone() for k, v in state["codec"]["q"].items()}
            self.codec.error = {k: v.float().clone() for k, v in state["codec"]["error"].items()}
        if self.quantizer is not None and state.get("int8_error") is not None:
            self.quantizer.error = {k: v.float().clone() for k, v in state["int8_error"].items()}

    def _finish_factors(self, *_: Any) -> None:
        """After torchft's step hook: at ``_finish_at`` turn the fragment's averaged P into Q."""
        if self._diloco._local_step == self._finish_at:
            for fragment in self._diloco._fragments:
                fragment.finish_factors()

    def __enter__(self) -> StreamingDiLoCo:
        self._diloco.__enter__()
        if self._finish_at is not None:  # registered after torchft's hook, so it runs after it
            self._hook = self._inner.register_step_post_hook(self._finish_factors)
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        return self._diloco.__exit__(exc_type, exc, tb)


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


def _cpu_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A float32 CPU copy (never a view of the live tensor, which the next sync changes)."""
    return tensor.detach().to("cpu", torch.float32, copy=True)


def _validate(
    fragments: list[nn.Module], sync_every: int, delay: int, outer_lr: float, outer_momentum: float, rank: int | None
) -> None:
    require(
        isinstance(fragments, (list, tuple)) and len(fragments) >= 1,
        "fragments",
        fragments if not isinstance(fragments, (list, tuple)) else len(fragments),
        "be a non-empty list of modules",
    )
    for i, f in enumerate(fragments):
        require(any(True for _ in f.parameters()), f"fragments[{i}]", type(f).__name__, "own at least one parameter")
    count = len(fragments)
    require(is_int(sync_every, 1), "sync_every", sync_every, "be an integer >= 1")
    require(sync_every % count == 0, "sync_every", sync_every, f"be a multiple of the number of fragments ({count})")
    require(
        is_int(delay, 0) and delay < sync_every // count,
        "fragment_sync_delay",
        delay,
        f"be an integer in [0, sync_every / fragments) = [0, {sync_every // count})",
    )
    check_outer(outer_lr, outer_momentum)
    require(rank is None or is_int(rank, 1), "powersgd_rank", rank, "be None or an integer >= 1")


def _http_server_at(address: str) -> type[ThreadingHTTPServer]:
    """torchft's checkpoint HTTP server class (daemon threads, a deep backlog), listening on ``address``
    whatever address torchft asks for (it asks for every interface)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET

    class BoundHTTPServer(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True
        request_queue_size = 1024

        def __init__(self, server_address, handler) -> None:
            super().__init__((address, server_address[1]), handler)

    return BoundHTTPServer


class AdvertisedHTTPTransport(HTTPTransport):
    """torchft's checkpoint server (how a restarted replica fetches a peer's state), named by the
    address peers reach it at: torchft's own names the hostname, which from another machine or
    network namespace may resolve to an interface the server is not reachable on (the heal then
    fails with "Connection refused"). torchft's server would listen on every interface; this one
    listens on ``listen_address(host)`` only (``comm.listen``)."""

    def __init__(self, host: str | None, **kwargs: Any) -> None:
        self._advertised = host
        original = torchft_http_transport._IPv6HTTPServer
        torchft_http_transport._IPv6HTTPServer = _http_server_at(listen_address(host))
        try:
            super().__init__(**kwargs)
        finally:
            torchft_http_transport._IPv6HTTPServer = original

    def address(self) -> str:
        if self._advertised is None:
            return super().address()
        return f"http://{self._advertised}:{self._server.socket.getsockname()[1]}/checkpoint/"
