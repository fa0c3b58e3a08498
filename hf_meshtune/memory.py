"""What a mesh process holds in memory, measured: its peak RSS from the kernel and, counted from the
tensors themselves, what each part of the method keeps.

- ``weights``: the model tensors this process really holds (a stage's own; the rest are on meta);
- ``gradients``: the largest total of ``.grad`` tensors seen before an optimizer step;
- ``optimizer``: the inner optimizer's state (AdamW moments and step counts);
- ``anchor``: ``SpectralAdamW``'s anchor momentum and filter bases (fast), the outer momentum the
  anchor replica replays (anchor);
- ``dp``: Streaming DiLoCo's θ_global backups and outer momentum, PowerSGD's Q and error feedback;
- ``codec``: the boundary codecs' geometry;
- ``activations``: the peak of the bytes autograd held for backward (``ActivationMeter``: every
  saved tensor that is not a parameter, counted once per storage while it is alive; with gradient
  checkpointing the layers' inputs are held by torch's checkpoint under hooks of its own, so this
  counts what is saved outside the layers and what their recompute saves in backward).

``peak_rss`` is ``getrusage``'s maximum resident set of the process (its whole life: the Python
runtime and libraries, loading, the steps); ``rss_at_start`` the resident set when the stage was built.
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable

import torch
from torch import nn

__all__ = ["MEMORY_PARTS", "ActivationMeter", "current_rss", "peak_rss", "tensor_bytes"]

MEMORY_PARTS = ("weights", "gradients", "optimizer", "anchor", "dp", "codec", "activations")


def peak_rss() -> int:
    """The process's peak resident set in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss() -> int:
    """The process's resident set now, in bytes."""
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of every real tensor in ``obj`` (nested dicts, lists, tuples), each storage once."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        if obj.is_meta:
            return 0
        storage = obj.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v, seen) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in obj)
    return 0


class _Saved:
    """One tensor autograd saved, counted by ``ActivationMeter`` until autograd lets go of it."""

    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, tensor: torch.Tensor, ptr: int, meter: ActivationMeter) -> None:
        self.tensor, self.ptr, self.meter = tensor, ptr, meter

    def __del__(self) -> None:
        self.meter._release(self.ptr)


class ActivationMeter:
    """A context (``torch.autograd.graph.saved_tensors_hooks``) that counts the bytes autograd holds for
    backward while it is alive, each storage once, parameters excluded; ``peak`` is the largest total.
    Works on meta tensors (``memory_ledger`` traces with it)."""

    def __init__(self, parameters: Iterable[nn.Parameter]) -> None:
        self._parameters = {p.untyped_storage()._cdata for p in parameters}
        self._live: dict[int, list[int]] = {}  # storage pointer → [references, bytes]
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor):
        storage = tensor.untyped_storage()
        ptr = storage._cdata  # the storage itself (a meta tensor's too: the ledger traces on meta)
        if ptr in self._parameters:
            return tensor
        entry = self._live.get(ptr)
        if entry is None:
            entry = self._live[ptr] = [0, storage.nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        return _Saved(tensor, ptr, self)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, ptr: int) -> None:
        entry = self._live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self._live[ptr]
            self.current -= entry[1]

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
