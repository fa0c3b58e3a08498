"""Shared test fixtures. Each section belongs to one group of tests; add new ones as new sections."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

# =============================================================================================
# Tiny Hugging Face causal LMs (used by test_boundaries.py; reusable by any test that needs a
# real transformers model). Built with ``AutoModelForCausalLM.from_config``: no hub, no network.
# =============================================================================================
from tests.tiny import make_tiny_causal_lm  # noqa: E402  (the factory lives beside its siblings)


@pytest.fixture
def tiny_causal_lm() -> Callable[..., torch.nn.Module]:
    """Factory fixture: ``tiny_causal_lm("llama", layers=4)`` → a fresh tiny model (see make_tiny_causal_lm)."""
    return make_tiny_causal_lm


@pytest.fixture
def single_thread_torch():
    """Run a test with one intra-op thread, then restore the previous count.

    Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's
    spin-waiting makes each of their ops ~100× slower (0.5 s instead of 2 ms per forward).
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# =============================================================================================
# Multi-process tests: the one launcher (gloo on loopback, spawned processes, hard timeout).
# =============================================================================================

from tests.distributed import launch as _launch  # noqa: E402


@pytest.fixture
def launcher() -> Callable:
    """``launcher(fn, world_size, *args, timeout=120, env=None)`` → per-rank return values (tests/distributed.py)."""
    return _launch
