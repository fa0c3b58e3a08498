"""Measure the TFLOP/s this machine sustains on a model's own work, for ``plan.model``'s host speeds.

``measure_tflops(config, seq_len)`` builds the model with one decoder layer (random weights, float32 on
the CPU unless ``device`` says otherwise), times forward + backward of ``microbatch_size`` rows of
``seq_len`` tokens (the median of ``repeats`` after a warm-up) and divides the FLOPs ``plan.flops``
counts for that work by the time: a measurement of the speed on this layer shape, which the plan then
applies to every layer of that shape. Threads: torch's current setting (``torch.set_num_threads``), as a
mesh process would run with its ``OMP_NUM_THREADS``.
"""

from __future__ import annotations

import copy
import statistics
import time

from .._validation import require

__all__ = ["measure_tflops"]


def measure_tflops(config, seq_len: int, microbatch_size: int = 1, repeats: int = 5, device: str = "cpu") -> float:
    """TFLOP/s of forward + backward (weights training) of a one-layer copy of ``config``'s model."""
    import torch
    from transformers import AutoModelForCausalLM

    from .flops import stage_flops

    require(repeats >= 1, "repeats", repeats, "be >= 1")
    one = copy.deepcopy(config)
    text = one.get_text_config()
    text.num_hidden_layers = 1
    if getattr(text, "layer_types", None):
        text.layer_types = text.layer_types[:1]
    model = AutoModelForCausalLM.from_config(one).to(device).float().train()
    ids = torch.randint(0, text.vocab_size, (microbatch_size, seq_len), device=device)

    def step() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter() - start

    step()  # warm-up
    seconds = statistics.median(step() for _ in range(repeats))
    (flops,) = stage_flops(one, 1, seq_len)
    return (flops.forward + flops.backward) * microbatch_size * seq_len / seconds / 1e12
