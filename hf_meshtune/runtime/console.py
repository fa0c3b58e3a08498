"""A mesh run seen as a Trainer run, from inside the mesh's processes.

Only one process has the loss: replica 0's last stage. There the Trainer's callbacks run as they do in
``Trainer.train()``: ``on_train_begin``, ``on_step_end`` after every optimizer step, ``on_log`` with every
logging step's entry, ``on_train_end``; so ``report_to`` trackers (TensorBoard, ...) and the Trainer's
progress bar or log printer see the run live, and ``trainer.state.is_world_process_zero`` is True there
only (the trackers open their files there alone). Under ``meshtune launch`` (``MESHTUNE_CONSOLE=launcher``)
the launcher draws the progress bar from the step lines this rank prints (``{"mesh": ..., "step": N, ...}``),
so the Trainer's own bar and printer are left out (they would draw into a pipe). At the end this rank
prints the run as a short table and the path of the full ``mesh_summary.json``. Every other rank stays
quiet: transformers' and datasets' progress bars off and torchft's Python loggers at warnings unless the
Trainer's ``log_level`` asks for info or debug.
"""

from __future__ import annotations

import json
import logging
import os

from transformers.trainer_callback import CallbackHandler, PrinterCallback, ProgressCallback

from ..comm.wire import CIRCUITS
from ..console import CONSOLE_ENV
from ..topology import MeshTopology
from .settings import StageCallback, StageView

__all__ = ["TrainerConsole", "step_rates", "summary_table"]

_TORCHFT_LOGGERS = ("torchft", "torchft_quorums", "torchft_commits", "torchft_errors")


class TrainerConsole(StageCallback):
    """The Trainer's callbacks and console on the rank with the loss (module docstring)."""

    def __init__(self, trainer, topology: MeshTopology, rank: int) -> None:
        replica, stage = topology.coords(rank)
        self.trainer, self.mesh = trainer, f"{topology.replicas}x{topology.stages}"
        self.has_loss = replica == 0 and stage == topology.stages - 1
        self.launcher = os.environ.get(CONSOLE_ENV) == "launcher"
        t = trainer
        kept = [c for c in t.callback_handler.callbacks if self._reaches(c)]
        self.handler = CallbackHandler(kept, t.model, t.processing_class, t.optimizer, t.lr_scheduler)

    def _reaches(self, callback) -> bool:
        """The Trainer's callbacks the mesh calls: the user's, the trackers, the printers. Not the ones that
        drive a single-process loop (``MeshCallback``: its masks and anchor are the mesh workers' own here;
        TRL's: reference-model syncs and the like, which the mesh refuses or runs itself), nor, under
        ``meshtune launch``, the Trainer's progress bar and printer (the launcher draws the bar)."""
        if type(callback).__module__.split(".")[0] in ("hf_meshtune", "trl"):
            return False
        return not (self.launcher and isinstance(callback, (ProgressCallback, PrinterCallback)))

    def _call(self, event: str, **kwargs) -> None:
        t = self.trainer
        t.control = getattr(self.handler, event)(t.args, t.state, t.control, **kwargs)

    def begin(self) -> None:
        """Before the first step: the state the callbacks read, quiet ranks, ``on_train_begin``."""
        state, args = self.trainer.state, self.trainer.args
        state.is_world_process_zero = state.is_local_process_zero = self.has_loss
        state.max_steps, state.global_step = args.max_steps, 0  # then every step's end (a resumed run's too)
        state.logging_steps = args.logging_steps
        if args.get_process_log_level() > logging.INFO or not self.has_loss:
            for name in _TORCHFT_LOGGERS:
                logging.getLogger(name).setLevel(logging.WARNING)
        if not self.has_loss:
            _quiet_progress_bars()
        _name_the_level()
        self._call("on_train_begin")

    def on_step_end(self, view: StageView) -> None:
        self.trainer.state.global_step = view.step
        self._call("on_step_end")

    def log(self, entry: dict) -> None:
        """One logging step's entry (the loss rank only): the launcher's step line, then ``on_log``."""
        if self.launcher:
            print(json.dumps({"mesh": self.mesh, **entry}), flush=True)
        logs = {"loss": entry["loss"], "learning_rate": entry["lr"]}
        logs |= {k: v for k, v in entry.items() if k not in ("step", "loss", "lr")}
        self.trainer.state.global_step = entry["step"]
        self._call("on_log", logs=logs)

    def end(self, summary: dict | None, path: str) -> None:
        """After the run: ``on_train_end``; the loss rank prints the summary table."""
        self._call("on_train_end")
        if self.has_loss and summary is not None:
            print(summary_table(summary, path), flush=True)


def step_rates(moved: float, tokens: int, tokens_per_step: int, fast_replicas: int, seconds: float) -> dict:
    """What the loss rank adds to a step's log entry: ``mesh_tokens_per_s``, the fast circuit's positions per
    second at this step's pace (every fast replica runs the replica's ``tokens_per_step`` in ``seconds``), and
    ``comm/rank_bytes_per_token``, the bytes this process moved since its steps began (``Wire.moved``) per
    position its replica trained: measured by this process alone, the mesh-wide figure is in the summary."""
    return {
        "mesh_tokens_per_s": tokens_per_step * fast_replicas / seconds if seconds > 0 else float("nan"),
        "comm/rank_bytes_per_token": moved / max(tokens, 1),
    }


def _name_the_level() -> None:
    """hf_meshtune's own warnings print as ``WARNING hf_meshtune.<module>: message`` when nothing else handles
    them (Python's last-resort handler prints the bare message), so the launcher's console tells them from
    a quiet rank's other lines; a user's logging configuration is left alone."""
    ours = logging.getLogger("hf_meshtune")
    if ours.handlers or logging.getLogger().handlers:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    ours.addHandler(handler)


def _quiet_progress_bars() -> None:
    """transformers' and datasets' progress bars off in this process (a rank without the loss)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        import datasets
    except ImportError:  # datasets is optional for a custom data pipeline
        return
    datasets.disable_progress_bars()


def _number(value: float | None, digits: int = 4) -> str:
    return "-" if value is None else f"{value:,.{digits}g}" if abs(value) < 1e4 else f"{value:,.0f}"


def _slowest(summary: dict) -> str:
    """ ", stage 1 computes longest (0.41 s a step; per stage 0.2 / 0.41 s)" where there are stages."""
    slowest, per_stage = summary.get("slowest_stage"), summary.get("compute_s_per_stage") or []
    if not slowest or len(per_stage) < 2:
        return ""
    each = " / ".join(_number(s, 2) for s in per_stage)
    longest = _number(slowest["compute_s"], 2)
    return f", stage {slowest['stage']} computes longest ({longest} s a step; per stage {each} s)"


def summary_table(summary: dict, path: str) -> str:
    """``mesh_summary.json`` in a dozen lines: the run, then bytes per fast token by circuit, measured on the
    wire beside the byte ledger's formula, then memory; ``path`` is where the whole summary is."""
    steps, tokens = summary.get("steps", 0), summary.get("fast_tokens", 0)
    lines = [
        f"mesh {summary.get('mesh')}: {steps} steps, {tokens:,} fast tokens ({summary.get('fast_replicas')} fast "
        f"replicas{', anchor' if summary.get('anchor') else ''}), the last fast replica's final loss "
        f"{_number(summary.get('final_loss'))}, "
        f"{_number(summary.get('step_seconds_mean'), 3)} s/step{_slowest(summary)}",
        "| bytes per fast token | " + " | ".join(CIRCUITS) + " | total |",
        "|---|" + "---:|" * (len(CIRCUITS) + 1),
    ]
    for label, key in (
        ("on the wire (measured)", "wire_bytes_per_token"),
        ("ledger (formula)", "analytic_bytes_per_token"),
    ):
        figures = summary.get(key) or {}
        lines.append(f"| {label} | " + " | ".join(_number(figures.get(c)) for c in (*CIRCUITS, "total")) + " |")
    memory = summary.get("memory_max_gib") or {}
    if "peak_rss" in memory:
        lines.append(f"peak RSS of the largest process: {memory['peak_rss']:.2f} GiB")
    lines.append(f"full summary: {path}")
    return "\n".join(lines)
