"""DP sync of the fast replicas: Streaming DiLoCo per pipeline stage, pseudo-gradients PowerSGD-compressed.

Fast replicas take ``sync_every`` (S) inner steps, then average a pseudo-gradient Δθ = θ_global − θ_local
and apply it with an outer Nesterov SGD step (DiLoCo, Douillard et al. 2023, arXiv 2311.08105).
Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits each stage into F fragments that sync
at staggered inner steps, one every S/F steps, each sync able to overlap ``fragment_sync_delay`` (τ)
following inner steps. Before the all-reduce the pseudo-gradient of every large matrix is compressed
to rank r with PowerSGD (Vogels et al. 2019, arXiv 1905.13727) and error feedback, so a [m, n] matrix
travels as r·(m+n) numbers instead of m·n.

The fault-tolerant machinery is torchft's: one ``torchft.Manager`` per process, where replica r of the
mesh is the torchft replica group ``mesh_replica_{r}`` and stage s is its group rank, so torchft's
cross-replica process group joins stage s of every fast replica and nothing else (stage j syncs only
with stage j). torchft has no compressor hook; PowerSGD replaces the fragment's pseudo-gradient
averaging (``_StreamingDiLoCoFragment._average_grads``), and every all-reduce goes through
``Wire.all_reduce("dp", …)`` so its bytes are counted. The anchor replica is not in the torchft group:
it replays the committed outer steps from their wire form (``OuterUpdate``) with ``OuterFollower``.
"""

from __future__ import annotations

import math
import os
import socket
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torchft import Manager
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.coordination import LighthouseServer
from torchft.local_sgd import DiLoCo, _StreamingDiLoCoFragment
from torchft.process_group import ProcessGroupGloo

from ._validation import require
from .ledger import dp_payload_numel
from .wire import Wire

__all__ = ["OuterFollower", "OuterUpdate", "PowerSGD", "ReplicaStore", "StreamingDiLoCo", "decode",
           "host_replica_store", "make_manager", "outer_optimizer", "power_iteration", "start_lighthouse"]


def _is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


# =============================================================================================
# PowerSGD: the math (pure functions) and the per-parameter state (error feedback, warm-start Q)
# =============================================================================================

def _orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of P's column space (reduced QR; the sign convention cancels in P·Pᵀ)."""
    return torch.linalg.qr(p, mode="reduced").Q


def power_iteration(m: torch.Tensor, q: torch.Tensor,
                    all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """One PowerSGD power iteration of M [m, n] from Q [n, r]: P = orth(avg(M·Q)), Q' = avg(Mᵀ·P).

    ``all_reduce`` averages across replicas (identity in one process). ``decode(P, Q')`` = P·P̄ᵀ·M̄ is
    the rank-r approximation; with r ≥ rank(M) it reconstructs M (one process).
    """
    p = _orthonormalise(all_reduce(m @ q))
    return p, all_reduce(m.T @ p)


def decode(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P·Qᵀ in float32, returned in the factors' dtype: the rank-r pseudo-gradient every replica applies."""
    return (p.float() @ q.float().T).to(p.dtype)


class PowerSGD:
    """Rank-``rank`` (r) PowerSGD state of one process: error feedback e and warm-start Q per parameter.

    A parameter of shape [m, n] is compressed when r·(m+n) < m·n (``hf_meshtune.ledger.dp_payload_numel``);
    everything else travels dense. A round on a compressed parameter with pseudo-gradient Δ:
    M = Δ + e; P = M·Q (all-reduce); P ← orth(P); Q = Mᵀ·P (all-reduce); Δ̂ = P·Qᵀ; e ← M − Δ̂;
    and Q is kept to warm-start the next round. The first Q of parameter ``key`` is drawn from ``seed`` and
    ``key``, so every replica starts with the same Q. Factors travel in Δ's dtype; M, e and Q are
    float32. The rounds are split in three calls (``p_factor``, ``q_factor``, ``commit``) so the
    all-reduces can sit between them; ``round`` runs all three with a given all-reduce.
    """

    def __init__(self, rank: int, seed: int = 0) -> None:
        require(_is_int(rank, 1), "powersgd_rank", rank, "be an integer >= 1")
        require(_is_int(seed, 0), "seed", seed, "be an integer >= 0")
        self.rank, self.seed = rank, seed
        self.q: dict[str, torch.Tensor] = {}
        self.error: dict[str, torch.Tensor] = {}
        self._m: dict[str, torch.Tensor] = {}  # M of the round in flight

    def compresses(self, shape: Sequence[int]) -> bool:
        return len(shape) == 2 and dp_payload_numel(tuple(shape), self.rank) < math.prod(shape)

    def factor_q(self, key: str, shape: Sequence[int]) -> torch.Tensor:
        """The Q [n, r] the next round of ``key`` starts from (drawn from seed and key the first time)."""
        if key not in self.q:
            gen = torch.Generator().manual_seed(self.seed * 2**32 + zlib.crc32(key.encode()))
            self.q[key] = torch.randn(shape[1], self.rank, generator=gen)
        return self.q[key]

    def p_factor(self, key: str, grad: torch.Tensor) -> torch.Tensor:
        """Start a round: M = Δ + e, returns P = M·Q (to all-reduce)."""
        m = grad.detach().float() + self.error.get(key, 0.0)
        self._m[key] = m
        return (m @ self.factor_q(key, grad.shape).to(m.device)).to(grad.dtype)

    def q_factor(self, key: str, p_avg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the averaged P: (orth(P), Q = Mᵀ·orth(P)); Q goes to the second all-reduce."""
        p = _orthonormalise(p_avg.float()).to(p_avg.dtype)
        return p, (self._m[key].T @ p.float()).to(p_avg.dtype)

    def commit(self, key: str, approx: torch.Tensor, q_avg: torch.Tensor) -> None:
        """Close a round that was applied: e ← M − Δ̂ and Q ← averaged Q (warm start)."""
        m = self._m.pop(key)
        self.error[key] = m - approx.float()
        self.q[key] = q_avg.detach().float().clone()

    def discard(self) -> None:
        """Drop rounds that were not applied (failed commit): e and Q stay as they were."""
        self._m.clear()

    def round(self, key: str, grad: torch.Tensor,
              all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t) -> torch.Tensor:
        """A whole round of ``key``; returns Δ̂ (``grad`` itself when the shape is not compressed)."""
        if not self.compresses(grad.shape):
            return all_reduce(grad)
        p, q = self.q_factor(key, all_reduce(self.p_factor(key, grad)))
        q = all_reduce(q)
        approx = decode(p, q)
        self.commit(key, approx, q)
        return approx


# =============================================================================================
# What a committed sync averaged (wire form) and the outer step that applies it
# =============================================================================================

def outer_optimizer(params, lr: float, momentum: float) -> torch.optim.SGD:
    """The outer optimizer of one fragment: Nesterov SGD (η_out, μ_out), as in the DiLoCo paper.

    ``foreach=False``: the foreach path adds the momentum into ``p.grad`` in place, which would change
    a pseudo-gradient an ``OuterUpdate`` still holds; the per-tensor path also makes replicas and
    followers run the very same kernels.
    """
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=True, foreach=False)


@dataclass
class OuterUpdate:
    """A committed fragment sync in wire form: enough for an observer to replay the outer step.

    ``step`` is the torchft manager step after the commit (``manager.current_step()``), i.e. how many
    syncs of this stage have committed so far, this one included; fragment ``(step-1) % F`` is the one
    synced. ``tensors`` follow the fragment's parameter order: (P orthonormalised, Q averaged) for a
    compressed parameter, the averaged pseudo-gradient for a dense one. ``rank`` is r (None: no
    compression).
    """

    fragment: int
    step: int
    tensors: list[torch.Tensor]
    rank: int | None = None

    def pseudo_gradients(self, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The averaged pseudo-gradient Δ̄ of each parameter, exactly as the replicas applied it.

        The replicas decode through this very method, so the result is bitwise theirs on the same
        kernels (dense entries are returned as they are, not copied).
        """
        codec = PowerSGD(self.rank) if self.rank is not None else None
        grads, i = [], 0
        for shape in shapes:
            if codec is not None and codec.compresses(shape):
                grads.append(decode(self.tensors[i], self.tensors[i + 1]))
                i += 2
            else:
                grads.append(self.tensors[i])
                i += 1
        require(i == len(self.tensors), "shapes", [tuple(s) for s in shapes],
                f"describe all {len(self.tensors)} tensors of the update (consumed {i})")
        return grads


def _apply_outer_step(params: list[nn.Parameter], grads: list[torch.Tensor], optimizer) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class OuterFollower:
    """Replays committed outer steps on a process outside the DiLoCo group (the mesh's anchor replica).

    It holds the same fragments (parameters starting equal to θ_global) and the same outer optimizer
    per fragment; ``apply`` every ``OuterUpdate`` of its stage, in commit order, and its parameters
    equal the fast replicas' θ_global after each sync. Gradients the process holds are kept.
    """

    def __init__(self, fragments: list[nn.Module], *, outer_lr: float, outer_momentum: float) -> None:
        require(len(fragments) >= 1, "fragments", len(fragments), "hold at least one module")
        _check_outer(outer_lr, outer_momentum)
        self.fragments = fragments
        self._params = [list(f.parameters()) for f in fragments]
        self._optimizers = [outer_optimizer(ps, outer_lr, outer_momentum) for ps in self._params]

    def apply(self, update: OuterUpdate) -> None:
        require(0 <= update.fragment < len(self.fragments), "update.fragment", update.fragment,
                f"lie in [0, {len(self.fragments)})")
        params = self._params[update.fragment]
        kept = [p.grad for p in params]
        grads = update.pseudo_gradients([p.shape for p in params])
        _apply_outer_step(params, [g.to(p.device) for p, g in zip(params, grads)],
                          self._optimizers[update.fragment])
        for p, g in zip(params, kept):
            p.grad = g


def _check_outer(lr: float, momentum: float) -> None:
    require(isinstance(lr, (int, float)) and lr > 0, "outer_lr", lr, "be > 0")
    require(isinstance(momentum, (int, float)) and 0 <= momentum < 1, "outer_momentum", momentum,
            "lie in [0, 1)")


# =============================================================================================
# The fragment: torchft's Streaming DiLoCo fragment with its averaging routed through Wire/PowerSGD
# =============================================================================================

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
    def adopt(cls, fragment: _StreamingDiLoCoFragment, codec: PowerSGD | None, wire: Wire,
              on_update: Callable[[OuterUpdate], None] | None) -> _CompressedFragment:
        fragment.__class__ = cls
        fragment._codec, fragment._wire, fragment._on_update = codec, wire, on_update
        fragment._factors = {}
        fragment._update = None
        if codec is not None:
            fragment._register_codec_state()
        return fragment

    def _key(self, name: str) -> str:
        return f"{self._fragment_id}.{name}"

    def _register_codec_state(self) -> None:
        """Heal Q with the fragment (a recovering replica must warm-start from the same Q); e restarts."""
        names = [n for n, _ in self._model_fragment.named_parameters()]

        def save() -> dict[str, torch.Tensor]:
            return {n: self._codec.q[self._key(n)] for n in names if self._key(n) in self._codec.q}

        def load(state: dict[str, torch.Tensor]) -> None:
            for n in names:
                self._codec.error.pop(self._key(n), None)
                if n in state:
                    self._codec.q[self._key(n)] = state[n].float().clone()

        self._manager.register_state_dict_fn(f"PowerSGD_{self._fragment_id}", load, save)

    def _all_reduce(self, tensor: torch.Tensor):
        return self._wire.all_reduce("dp", tensor, self._manager.num_participants(), self._manager.allreduce)

    def _average_grads(self) -> None:
        """Issue the averaging all-reduces of this fragment's pseudo-gradients (torchft appends, then waits).

        Dense tensors: one all-reduce each, left in flight. Compressed matrices: all P all-reduces go
        out together and are *waited here*, because Q = Mᵀ·orth(P̄) needs the averaged P; that one
        round trip blocks the inner step that prepares the sync. The Q all-reduces then stay in
        flight and overlap the next ``fragment_sync_delay`` inner steps, as torchft's own averaging does.
        """
        pending = []
        for name, _ in self._model_fragment.named_parameters():
            grad = self._grads[name]
            if self._codec is not None and self._codec.compresses(grad.shape):
                p = self._codec.p_factor(self._key(name), grad)
                pending.append((name, p, self._all_reduce(p)))
            else:
                self._allreduce_work.append(self._all_reduce(grad))
        for name, p, work in pending:
            work.wait()
            p_orth, q = self._codec.q_factor(self._key(name), p)
            self._factors[name] = (p_orth, q)
            self._allreduce_work.append(self._all_reduce(q))

    def _set_grads(self) -> None:
        """On commit: decode Δ̄ through ``OuterUpdate`` (so observers replay it bitwise), close the rounds."""
        named = list(self._model_fragment.named_parameters())
        tensors: list[torch.Tensor] = []
        for name, _ in named:
            tensors.extend(self._factors[name] if name in self._factors else (self._grads[name],))
        update = OuterUpdate(self._fragment_id, self._manager.current_step(), tensors,
                             self._codec.rank if self._codec is not None else None)
        for (name, _), grad in zip(named, update.pseudo_gradients([p.shape for _, p in named])):
            if name in self._factors:
                self._codec.commit(self._key(name), grad, self._factors[name][1])
            self._grads[name] = grad
        self._update = update
        super()._set_grads()

    def perform_sync(self) -> bool:
        try:
            committed = super().perform_sync()
        finally:
            self._factors.clear()
            if self._codec is not None:
                self._codec.discard()
        update, self._update = self._update, None
        if committed and update is not None and self._on_update is not None:
            self._on_update(update)
        return committed


# =============================================================================================
# Public entry: the Streaming DiLoCo context manager of one stage
# =============================================================================================

class StreamingDiLoCo:
    """Streaming DiLoCo of one pipeline stage with PowerSGD pseudo-gradients (paper §2.4).

    Wraps ``torchft.local_sgd.DiLoCo``: on entry it hooks ``inner_optimizer.step``; every S/F inner
    steps one fragment (in turn) averages Δθ = θ_global − θ_local across the fast replicas and applies
    the outer Nesterov SGD step (``outer_lr`` η_out, ``outer_momentum`` μ_out). ``sync_every`` (S),
    the number of fragments (F) and ``fragment_sync_delay`` (τ) must be the same on every stage and
    replica. With τ > 0 the sync's pseudo-gradient is taken τ inner steps before it is applied; after
    the outer step the fragment's parameters become (1−α)·θ_global + α·θ_local with
    ``fragment_update_alpha`` α, so with α = 0 (torchft's default) the τ overlapped inner steps of that
    fragment are dropped. ``powersgd_rank`` (r) None sends Δθ dense, exactly torchft's averaging. Every all-reduce
    is booked on ``wire`` (``self.wire``, a fresh ``Wire`` if None) under "dp". ``on_outer_update`` is
    called on every process after each committed sync with its ``OuterUpdate``.

    Example:
        >>> manager = make_manager(replica=r, stage=s, num_stages=Y, lighthouse_addr=addr,
        ...                        store_addr=host, store_port=port)
        >>> with StreamingDiLoCo(manager, [stage_module], inner_opt, sync_every=8, powersgd_rank=4):
        ...     for batch in batches:
        ...         loss_fn(stage_module, batch).backward(); inner_opt.step(); inner_opt.zero_grad()
    """

    def __init__(self, manager: Manager, fragments: list[nn.Module], inner_optimizer: torch.optim.Optimizer,
                 *, sync_every: int, fragment_sync_delay: int = 0, outer_lr: float = 0.7,
                 outer_momentum: float = 0.9, powersgd_rank: int | None,
                 wire: Wire | None = None, on_outer_update: Callable[[OuterUpdate], None] | None = None,
                 seed: int = 0, fragment_update_alpha: float = 0.0) -> None:
        _validate(fragments, sync_every, fragment_sync_delay, outer_lr, outer_momentum, powersgd_rank)
        require(isinstance(fragment_update_alpha, (int, float)) and 0 <= fragment_update_alpha <= 1,
                "fragment_update_alpha", fragment_update_alpha, "lie in [0, 1]")
        self.wire = wire if wire is not None else Wire()
        self.codec = PowerSGD(powersgd_rank, seed) if powersgd_rank is not None else None
        self.fragments = fragments
        outer = [outer_optimizer(f.parameters(), outer_lr, outer_momentum) for f in fragments]
        self._diloco = DiLoCo(manager, fragments, inner_optimizer, outer, sync_every=sync_every,
                              fragment_sync_delay=fragment_sync_delay, fragment_update_alpha=fragment_update_alpha)
        for fragment in self._diloco._fragments:
            _CompressedFragment.adopt(fragment, self.codec, self.wire, on_outer_update)

    def global_parameters(self, fragment: int) -> list[torch.Tensor]:
        """θ_global of one fragment (the parameters of its last committed sync), in parameter order."""
        saved = self._diloco._fragments[fragment].original_parameters
        return [saved[name].clone() for name, _ in self.fragments[fragment].named_parameters()]

    def state_dict(self) -> dict:
        """Everything a resumed run needs to sync exactly as this one would have: inner steps since the
        last sync, θ_global and outer momentum of every fragment, PowerSGD's Q and error feedback, and
        the torchft manager's step (which fragment syncs next). Only between syncs: with a fragment's
        all-reduces in flight the state would miss them (a ValueError says so)."""
        fragments = self._diloco._fragments
        busy = [i for i, f in enumerate(fragments) if f._allreduce_work]
        require(not busy, "DiLoCo state", f"fragments {busy} syncing",
                "be taken between syncs (at a multiple of dp_sync_every / dp_fragments inner steps)")
        return {
            "local_step": self._diloco._local_step,
            "manager": self._diloco._manager.state_dict(),
            "fragments": [{"original": {n: t.clone() for n, t in f.original_parameters.items()},
                           "outer": f._outer_optimizer.state_dict()} for f in fragments],
            "codec": None if self.codec is None else {"q": dict(self.codec.q), "error": dict(self.codec.error)},
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore ``state_dict()``'s state (same fragments, sync period and PowerSGD rank)."""
        fragments = self._diloco._fragments
        require(len(state["fragments"]) == len(fragments), "dp_fragments", len(fragments),
                f"equal the checkpoint's {len(state['fragments'])} fragments")
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

    def __enter__(self) -> StreamingDiLoCo:
        self._diloco.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        return self._diloco.__exit__(exc_type, exc, tb)


def _validate(fragments: list[nn.Module], sync_every: int, delay: int, outer_lr: float,
              outer_momentum: float, rank: int | None) -> None:
    require(isinstance(fragments, (list, tuple)) and len(fragments) >= 1, "fragments",
            fragments if not isinstance(fragments, (list, tuple)) else len(fragments),
            "be a non-empty list of modules")
    for i, f in enumerate(fragments):
        require(any(True for _ in f.parameters()), f"fragments[{i}]", type(f).__name__,
                "own at least one parameter")
    count = len(fragments)
    require(_is_int(sync_every, 1), "sync_every", sync_every, "be an integer >= 1")
    require(sync_every % count == 0, "sync_every", sync_every,
            f"be a multiple of the number of fragments ({count})")
    require(_is_int(delay, 0) and delay < sync_every // count, "fragment_sync_delay", delay,
            f"be an integer in [0, sync_every / fragments) = [0, {sync_every // count})")
    _check_outer(outer_lr, outer_momentum)
    require(rank is None or _is_int(rank, 1), "powersgd_rank", rank, "be None or an integer >= 1")


# =============================================================================================
# torchft plumbing: lighthouse, per-replica store, manager
# =============================================================================================

JOIN_TIMEOUT_MS = 60_000
"""How long a lighthouse waits for every heartbeating replica to join a quorum before it forms one
without the stragglers (torchft's default is much shorter, so a replica a few steps slower than the
others would be left out of syncs it is healthy enough to join)."""


HOST_ENV = "MESHTUNE_HOST"


def advertised_host() -> str:
    """The address other machines reach this process at: ``$MESHTUNE_HOST``, else the hostname.

    torchft's servers and the replica stores advertise the hostname, which on a multi-homed machine
    (or inside a network namespace) may name an interface the peers cannot reach; set MESHTUNE_HOST
    to the address of the interface the mesh runs on (as GLOO_SOCKET_IFNAME picks gloo's).
    """
    return os.environ.get(HOST_ENV) or socket.gethostname()


def start_lighthouse(min_replicas: int, bind: str = "[::]:0", *, join_timeout_ms: int | None = JOIN_TIMEOUT_MS,
                     quorum_tick_ms: int | None = None) -> tuple[LighthouseServer, str]:
    """Start a torchft lighthouse (for local runs and tests); returns (server, address to give managers).

    ``min_replicas``: fast replicas a quorum needs. The server binds all interfaces and its address
    names this host by hostname, or by $MESHTUNE_HOST when set. Call ``server.shutdown()`` when done.
    """
    require(_is_int(min_replicas, 1), "min_replicas", min_replicas, "be an integer >= 1")
    server = LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                              quorum_tick_ms=quorum_tick_ms)
    address = server.address()
    if os.environ.get(HOST_ENV):  # torchft names the hostname; peers may only reach MESHTUNE_HOST
        address = f"http://{os.environ[HOST_ENV]}:{address.rstrip('/').rsplit(':', 1)[1]}"
    return server, address


@dataclass
class ReplicaStore:
    """The TCPStore of one replica group: ``store`` is the server (stage 0 only, keep it alive)."""

    addr: str
    port: int
    store: dist.TCPStore | None = None


def host_replica_store(replica: int, stage: int, *, host: str | None = None,
                       rendezvous: dist.Store | None = None, timeout_s: float = 60.0) -> ReplicaStore:
    """Stage 0 of replica ``replica`` hosts a fresh TCPStore; every stage of the replica learns its address.

    Why a store per replica: torchft's Manager writes its server address under one fixed key of its
    store, so replica groups cannot share one (the job's default store would be overwritten by every
    replica). The address is published through ``rendezvous`` (default: the default process group's
    store, so ``dist.init_process_group`` must have run) under ``hf_meshtune/dp_store/{replica}``.
    ``host`` is the address other machines reach this one at (default: the hostname); the store must
    be reachable from *every* fast process, not only this replica's stages, because the quorum's
    primary store also hosts the rendezvous of the cross-replica process groups.
    """
    key = f"hf_meshtune/dp_store/{replica}"
    if rendezvous is None:
        rendezvous = dist.distributed_c10d._get_default_store()
    if stage == 0:
        host = host or advertised_host()
        server = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                               timeout=timedelta(seconds=timeout_s))
        rendezvous.set(key, f"{host}:{server.port}")
        return ReplicaStore(host, server.port, server)
    addr, _, port = rendezvous.get(key).decode().rpartition(":")
    return ReplicaStore(addr, int(port))


class _AdvertisedHTTPTransport(HTTPTransport):
    """torchft's checkpoint server (how a restarted replica fetches a peer's state), named by the
    address peers reach it at: torchft's own names the hostname, which from another machine or
    network namespace may resolve to an interface the server is not reachable on (the heal then
    fails with "Connection refused"). The server itself listens on every interface."""

    def __init__(self, host: str | None, **kwargs: Any) -> None:
        self._advertised = host
        super().__init__(**kwargs)

    def address(self) -> str:
        if self._advertised is None:
            return super().address()
        return f"http://{self._advertised}:{self._server.socket.getsockname()[1]}/checkpoint/"


def make_manager(*, replica: int, stage: int, num_stages: int, lighthouse_addr: str, store_addr: str,
                 store_port: int, timeout_s: float = 60.0, quorum_timeout_s: float | None = None,
                 hostname: str | None = None, init_sync: bool = False, min_replica_size: int = 1) -> Manager:
    """The torchft Manager of stage ``stage`` of fast replica ``replica`` (group rank = stage).

    Gloo process group; synchronous quorum (DiLoCo requires it). ``min_replica_size``: replicas a
    quorum needs before it commits (1: a single surviving replica still commits, and a replica that
    comes back heals from a peer). Healthy replicas are not left out of a quorum as long as the
    lighthouse's ``join_timeout_ms`` exceeds how far apart they reach a sync (``start_lighthouse``). ``store_addr``/``store_port``: this replica's own TCPStore,
    hosted before this call by one process of the replica (``host_replica_store``: stage 0) and
    reachable by every fast process. ``timeout_s`` bounds collectives, RPCs and connects;
    ``quorum_timeout_s`` (default ``timeout_s``) how long a quorum waits for the other replicas, so
    it must exceed the time between syncs. ``init_sync=False``: every replica loads the same
    weights, so no step-0 checkpoint transfer (a replica that restarts later still heals).
    """
    require(_is_int(num_stages, 1), "num_stages", num_stages, "be an integer >= 1")
    require(_is_int(stage, 0) and stage < num_stages, "stage", stage, f"lie in [0, {num_stages})")
    require(_is_int(replica, 0), "replica", replica, "be an integer >= 0")
    require(timeout_s > 0, "timeout_s", timeout_s, "be > 0")
    require(_is_int(min_replica_size, 1), "min_replica_size", min_replica_size, "be an integer >= 1")
    timeout = timedelta(seconds=timeout_s)
    hostname = hostname if hostname is not None else os.environ.get(HOST_ENV)
    kwargs = {"hostname": hostname} if hostname is not None else {}
    return Manager(pg=ProcessGroupGloo(timeout=timeout), load_state_dict=None, state_dict=None,
                   checkpoint_transport=_AdvertisedHTTPTransport(hostname, timeout=timeout, num_chunks=0),
                   min_replica_size=min_replica_size, use_async_quorum=False, timeout=timeout,
                   quorum_timeout=timedelta(seconds=quorum_timeout_s or timeout_s), connect_timeout=timeout,
                   rank=stage, world_size=num_stages, store_addr=store_addr, store_port=store_port,
                   lighthouse_addr=lighthouse_addr, replica_id=f"mesh_replica_{replica}",
                   init_sync=init_sync, **kwargs)
