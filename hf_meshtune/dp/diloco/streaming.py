"""``StreamingDiLoCo``: the context manager one pipeline stage trains in, on torchft's ``DiLoCo`` with
every fragment adopted as a ``_CompressedFragment``; and how the overlapped steps are split between a
sync's two rounds."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torchft import Manager
from torchft.local_sgd import DiLoCo

from ..._validation import require
from ...comm.wire import Wire
from ...memory import tensor_bytes
from ..outer import OuterUpdate, check_outer, outer_optimizer
from ..powersgd import PowerSGD, is_int
from ..quantize import QUANTIZERS, Int8Sum
from .fragment import _CompressedFragment
from .internals import require_torchft_internals

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle

__all__ = ["StreamingDiLoCo", "p_round_steps"]


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
        self._hook: RemovableHandle | None = None
        self.quantizer = Int8Sum() if quantize is not None else None  # the dense tensors' error feedback is here
        quantizers = None if self.quantizer is None else (self.quantizer, Int8Sum())
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
        and error feedback (``memory``)."""
        held: list[Any] = [[f.original_parameters, f._outer_optimizer.state] for f in self._diloco._fragments]
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
