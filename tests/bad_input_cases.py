"""Every input hf_meshtune refuses, the entry point that refuses it and the exact error: one list.

``CASES`` is the single source of truth for two things that must not drift apart:

- ``docs/bad_input.md``, rendered by ``render()`` (``python -m tests.bad_input_cases > docs/bad_input.md``);
- ``tests/test_bad_input.py``, which triggers every row and checks the exception type and message, and
  checks that the file in ``docs/`` is what ``render()`` produces now.

A row (``Case``) is a group, the input as a reader would write it, the public entry point that refuses it
("where"), a trigger (a callable with no argument, or one taking a fresh temporary folder), the exception
type and the exact message. ``<tmp>`` in a message stands for the trigger's temporary folder. Messages
that hf_meshtune does not write itself (torch, transformers, TRL) and that run on are checked by their
beginning (``prefix=True``); ``note`` says in the table whose message it is, or what is weak about it.
Triggers use tiny models from ``tests/tiny.py``: no network, no hub, a few ms to about a second each.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import io
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from hf_meshtune import (
    AnchorBatches,
    AnchorCircuit,
    LedgerSettings,
    MeshConfig,
    MeshTrainer,
    MeshTrainingArguments,
    SpectralAdamW,
    attach_boundaries,
    keep_count,
    keep_indices,
)
from hf_meshtune.boundary.masking import BoundaryMask
from hf_meshtune.comm.wire import Wire
from hf_meshtune.config import QUALITY_CODEC
from hf_meshtune.dp.baselines import GradientSync
from hf_meshtune.ledger import format_table, settings_for_row
from hf_meshtune.pipeline.generate import RolloutSettings
from hf_meshtune.pipeline.layout import layer_cache_argument
from hf_meshtune.rl import PolicyLoss, PolicyLossSettings
from hf_meshtune.topology import MeshTopology
from tests.bad_input_hosts import host_cases
from tests.tiny import make_tiny_causal_lm, pattern_dataset, tiny_llama, tiny_word_tokenizer

# ---------------------------------------------------------------------------------------------------
# The row type
# ---------------------------------------------------------------------------------------------------

TMP = "<tmp>"
"""Stands for the trigger's temporary folder in messages (the test substitutes the real path)."""


@dataclass(frozen=True)
class Case:
    """One validated input: what a user writes, where it is refused, and the exact error."""

    group: str
    input: str
    where: str
    trigger: Callable[..., object]
    error: type[BaseException]
    message: str
    prefix: bool = False  # only the start of the message is fixed (a third-party message that runs on)
    note: str = ""

    @property
    def wants_tmp(self) -> bool:
        """Whether the trigger takes a temporary folder (inputs that are files or folders)."""
        parameters = inspect.signature(self.trigger).parameters.values()
        return sum(p.default is inspect.Parameter.empty for p in parameters) == 1

    def expected(self, tmp: Path | None) -> str:
        """The message with ``<tmp>`` replaced by the folder the trigger was given."""
        return self.message if tmp is None else self.message.replace(TMP, str(tmp))

    def run(self, tmp: Path | None) -> None:
        """Call the trigger (with ``tmp`` if it takes a folder); it is expected to raise."""
        if self.wants_tmp:
            self.trigger(tmp)
        else:
            self.trigger()


class CliExit(Exception):
    """``meshtune`` returned a non-zero exit code; the message is ``"exit <code>: <last stderr line>"``.

    Why a stand-in exception: the console entry point prints the error and returns 2 instead of
    raising, and a row must say both what the user reads and the exit code scripts see.
    """


# ---------------------------------------------------------------------------------------------------
# Small helpers the triggers share
# ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def environ(**values: str | None) -> Iterator[None]:
    """Set (or, for None, unset) environment variables for the block, then restore them.

    Why: a launched rank learns its place from WORLD_SIZE and MESHTUNE_MESH, and MeshPlugin reads
    MESHTUNE_<FIELD>; the rows that depend on them run in this one process.
    """

    def apply(settings: dict[str, str | None]) -> None:
        for name, value in settings.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    saved = {name: os.environ.get(name) for name in values}
    try:
        apply(values)
        yield
    finally:
        apply(saved)


def unwritable_cache(tmp: str) -> None:
    """The embedded model's first use with ``$HF_MESHTUNE_CACHE`` under a regular file."""
    from hf_meshtune.apps.assets import smollm2_checkpoint

    Path(tmp, "file").write_text("not a folder")
    with environ(HF_MESHTUNE_CACHE=os.path.join(tmp, "file", "cache")):
        smollm2_checkpoint()


def partial_fill(tmp: str) -> None:
    """``filled_once`` given a fill that writes one of the two files it requires."""
    from hf_meshtune.apps.cache import filled_once

    def config_only(folder: Path) -> None:
        (folder / "config.json").write_text("{}")

    filled_once(Path(tmp, "model"), config_only, ("config.json", "model.safetensors"))


def launched(world_size: int, mesh: str | None = None) -> contextlib.AbstractContextManager[None]:
    """The environment of one rank of a launched job (``meshtune launch`` sets both variables)."""
    return environ(WORLD_SIZE=str(world_size), MESHTUNE_MESH=mesh)


def meshtune(*argv: str) -> None:
    """Run the ``meshtune`` console entry point in-process; a non-zero exit becomes ``CliExit``."""
    from hf_meshtune.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    if code:
        lines = [line for line in err.getvalue().splitlines() if line.strip()]
        raise CliExit(f"exit {code}: {lines[-1] if lines else ''}")


def cli(*argv: str) -> Callable[[], None]:
    """A trigger that runs ``meshtune *argv``."""
    return lambda: meshtune(*argv)


def cli_in(*argv: str) -> Callable[[Path], None]:
    """A trigger that runs ``meshtune *argv`` with ``<tmp>`` in an argument replaced by its folder."""
    return lambda tmp: meshtune(*(arg.replace(TMP, str(tmp)) for arg in argv))


TRAINING: dict[str, object] = {
    "per_device_train_batch_size": 2,
    "max_steps": 2,
    "learning_rate": 1e-3,
    "logging_steps": 1,
    "report_to": [],
    "use_cpu": True,
    "disable_tqdm": True,
    "save_strategy": "no",
    "preset": "paper",
    "num_stages": 2,
    "mask_ratio": 0.5,
    "anchor_every": 1,
    "anchor_delay": 3,
}
"""MeshTrainingArguments of the tiny runs: the paper's method (2 steps, Y = 2, p = 0.5, an anchor gradient in
flight)."""


def mesh_args(tmp: Path, **overrides: object) -> MeshTrainingArguments:
    return MeshTrainingArguments(output_dir=str(tmp / "out"), **{**TRAINING, **overrides})


def mesh_trainer(tmp: Path, model: nn.Module | None = None, **overrides: object) -> MeshTrainer:
    """A MeshTrainer of a 4-layer tiny Llama (H = 64) on 16 counting rows of 8 tokens."""
    return MeshTrainer(
        model=model if model is not None else tiny_llama(),
        args=mesh_args(tmp, **overrides),
        train_dataset=pattern_dataset(16, 8),
    )


class _Stream(IterableDataset):
    """A streamed copy of the tiny counting rows: no index per row."""

    def __iter__(self):
        return iter(pattern_dataset(16, 8))


def _change_trainer(tmp: Path, change: str = "rot+delta4g32+zstd", dataset=None, **knobs: object) -> MeshTrainer:
    """A change-coded MeshTrainer of the tiny Llama (H = 64, Y = 2, a composed codec, AdamW)."""
    args = mesh_args(tmp, preset="quality", mask_ratio=None, anchor=False, optim="adamw_torch",
                     boundary_codec="outliers2+int4g31", boundary_change_codec=change, **knobs)  # fmt: skip
    data = dataset if dataset is not None else pattern_dataset(16, 8)
    return MeshTrainer(model=tiny_llama(), args=args, train_dataset=data)


def _forward_without_row_ids() -> None:
    from hf_meshtune.boundary.compose.change import change_spec
    from hf_meshtune.boundary.compose.handle import attach_composed

    model = tiny_llama()
    handle = attach_composed(model, 2, "int8", change=change_spec("rot+delta4g32+zstd"))
    ids = torch.randint(3, 50, (2, 8))
    handle.calibrate(model, {"input_ids": ids})
    model(input_ids=ids)


def _decode_without_the_row() -> None:
    from hf_meshtune.boundary.compose.change import ChangeCache, ChangeCodec, change_spec, decode_change

    codec = ChangeCodec(change_spec("rot+delta4g32+zstd"), 0, 64)
    decode_change(codec, ChangeCache(), 5, b"\0" * 8, torch.zeros(3, 64, dtype=torch.int8))


def _grpo_with_change_coding(tmp: Path) -> None:
    from hf_meshtune import MeshGRPOConfig, MeshGRPOTrainer
    from hf_meshtune.apps.arithmetic import exact_answer_reward

    config = MeshGRPOConfig(output_dir=str(tmp / "out"), num_stages=2, boundary_change_codec="rot+delta4g32+zstd")
    MeshGRPOTrainer(model=tiny_llama(), reward_funcs=exact_answer_reward, args=config)


def frozen(model: nn.Module, *names: str) -> nn.Module:
    """``model`` with the named parameters frozen (names relative to the model)."""
    for name in names:
        model.get_parameter(name).requires_grad_(False)
    return model


O_PROJ, Q_PROJ = "model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.q_proj.weight"


def temporary_folder() -> Path:
    """A folder removed when the process exits (for what is built once and shared by rows)."""
    path = Path(tempfile.mkdtemp(prefix="meshtune-bad-input-"))
    atexit.register(shutil.rmtree, path, True)
    return path


@functools.cache
def saved_checkpoint() -> Path:
    """``checkpoint-2`` of a 2-step MeshTrainer run (layer 0's o_proj frozen, anchor gradients of
    steps 0 and 1 still in flight), built once per process; rows that damage it work on a copy."""
    root = temporary_folder()
    mesh_trainer(root, frozen(tiny_llama(), O_PROJ), save_strategy="steps", save_steps=2).train()
    return root / "out" / "checkpoint-2"


def checkpoint_copy(tmp: Path) -> Path:
    """A copy of ``saved_checkpoint()`` at ``<tmp>/checkpoint-2``."""
    return Path(shutil.copytree(saved_checkpoint(), tmp / "checkpoint-2"))


def resume(tmp: Path, checkpoint: Path | str | bool, model: nn.Module | None = None, **overrides: object) -> None:
    """Resume the run of ``saved_checkpoint()`` (same knobs unless overridden) from ``checkpoint``."""
    model = model if model is not None else frozen(tiny_llama(), O_PROJ)
    trainer = mesh_trainer(tmp, model, max_steps=4, **overrides)
    trainer.train(resume_from_checkpoint=checkpoint if isinstance(checkpoint, bool) else str(checkpoint))


def resume_with_mesh_state(tmp: Path, content: bytes | None = None, obj: object = None) -> None:
    """Resume from a copy of the checkpoint whose ``mesh_state.pt`` holds ``content`` (raw bytes) or
    ``torch.save(obj)``, or is missing when both are None."""
    checkpoint = checkpoint_copy(tmp)
    path = checkpoint / "mesh_state.pt"
    if content is not None:
        path.write_bytes(content)
    elif obj is not None:
        torch.save(obj, path)
    else:
        path.unlink()
    resume(tmp, checkpoint)


def truncated_mesh_state(tmp: Path) -> None:
    """The first half of a real ``mesh_state.pt`` (a copy cut short, a disk that filled up)."""
    data = (saved_checkpoint() / "mesh_state.pt").read_bytes()
    resume_with_mesh_state(tmp, content=data[: len(data) // 2])


@functools.cache
def tiny_model_folder() -> Path:
    """A local model folder: the tiny Llama (max_position_embeddings 64) and a 100-word word-level tokenizer."""
    folder = temporary_folder() / "tiny-llama"
    tiny_llama().save_pretrained(folder)
    tiny_word_tokenizer().save_pretrained(folder)
    return folder


def text_file(tmp: Path, words: int = 200) -> Path:
    """``<tmp>/notes.txt``: ``words`` words of the tiny tokenizer's vocabulary."""
    path = tmp / "notes.txt"
    path.write_text(" ".join(f"w{3 + i % 97}" for i in range(words)) + "\n", encoding="utf-8")
    return path


def load_recipe(name: str):
    """``recipes/<name>.py`` as a module (the recipes are scripts, not a package)."""
    from tests.test_recipes import load_script

    return load_script(f"recipes/{name}.py")


def cpt(tmp: Path, *argv: str) -> None:
    """``python recipes/cpt.py --output_dir <tmp>/out --model_name_or_path tiny *argv`` (``<tmp>`` in argv replaced)."""
    args = [
        "--output_dir",
        str(tmp / "out"),
        "--use_cpu",
        "--report_to",
        "none",
        "--model_name_or_path",
        str(tiny_model_folder()),
    ]
    load_recipe("cpt").main([*args, *(arg.replace(TMP, str(tmp)) for arg in argv)])


def cpt_on_text(tmp: Path, *argv: str, words: int = 200) -> None:
    """``recipes/cpt.py`` on ``words`` words of ``<tmp>/notes.txt`` (one token each, then EOS) with the tiny model."""
    cpt(tmp, "--text_files", str(text_file(tmp, words)), *argv)


def sft(tmp: Path, *argv: str) -> None:
    """``python recipes/sft.py --output_dir <tmp>/out --model_name_or_path tiny *argv``."""
    load_recipe("sft").main(
        [
            "--output_dir",
            str(tmp / "out"),
            "--use_cpu",
            "--report_to",
            "none",
            "--model_name_or_path",
            str(tiny_model_folder()),
            *argv,
        ]
    )


# --- SpectralAdamW ----------------------------------------------------------------------------------


def spectral(**kwargs: object) -> Callable[[], SpectralAdamW]:
    """A trigger that builds ``SpectralAdamW`` over one 4×3 matrix with ``kwargs``."""
    return lambda: SpectralAdamW([nn.Parameter(torch.zeros(4, 3))], **kwargs)


def spectral_group(**options: object) -> None:
    """A param group dict whose own options are bad (the constructor checks groups like its defaults)."""
    SpectralAdamW([{"params": [nn.Parameter(torch.zeros(4, 3))], **options}])


def anchor_for_foreign_parameter() -> None:
    SpectralAdamW([nn.Parameter(torch.zeros(4, 3))]).update_anchor({nn.Parameter(torch.zeros(4, 3)): torch.zeros(4, 3)})


def factors_of_wrong_shape() -> None:
    w = torch.nn.Parameter(torch.zeros(4, 3))
    SpectralAdamW([w]).update_anchor_factors({w: (torch.zeros(4, 2), torch.zeros(3), torch.zeros(3, 2))})


def anchor_of_wrong_shape() -> None:
    weight = nn.Parameter(torch.zeros(4, 3))
    SpectralAdamW([weight]).update_anchor({weight: torch.zeros(3, 4)})


def added_group_with_negative_lr() -> None:
    SpectralAdamW([nn.Parameter(torch.zeros(4, 3))]).add_param_group(
        {"params": [nn.Parameter(torch.zeros(2, 2))], "lr": -1.0}
    )


# --- the mesh (launched jobs, run here as one rank) --------------------------------------------------


def rollout_settings(**options: object) -> Callable[[], None]:
    """``RolloutSettings.from_generation_config`` of a GenerationConfig with ``options`` over
    max_new_tokens=8, pad_token_id=0."""
    from transformers import GenerationConfig

    from hf_meshtune.pipeline.generate import RolloutSettings

    def trigger() -> None:
        RolloutSettings.from_generation_config(GenerationConfig(**{"max_new_tokens": 8, "pad_token_id": 0, **options}))

    return trigger


def generate_without_prompts() -> None:
    """Stage 0 of a 2-stage tiny_llama asked to generate with no prompts (no process group needed: it
    refuses before any send)."""
    from hf_meshtune.pipeline.generate import pipelined_generate
    from hf_meshtune.pipeline.stage import build_stage

    module = build_stage(tiny_llama(), 0, 2, MeshConfig(num_stages=2), masked=False)
    pipelined_generate(module, Wire(), [0, 1], RolloutSettings(max_new_tokens=4, pad_token_id=0))


def policy_loss_settings(**options: object) -> Callable[[], None]:
    """``PolicyLossSettings.from_grpo_config`` of a TRL GRPOConfig with ``options``."""

    def trigger() -> None:
        from trl import GRPOConfig

        from hf_meshtune.rl import PolicyLossSettings

        config = GRPOConfig(output_dir=str(temporary_folder()), use_cpu=True, bf16=False, report_to="none", **options)
        PolicyLossSettings.from_grpo_config(config)

    return trigger


def rollouts_longer_than_seq_len() -> None:
    """Two rollouts of a 5-token prompt and a 6-token completion packed into 8 positions."""
    from hf_meshtune.rl import pack_rollouts

    ones = torch.ones(2, 5, dtype=torch.long)
    pack_rollouts(ones, ones, torch.ones(2, 6, dtype=torch.long), torch.ones(2, 6), torch.zeros(2), 8, 0)


def generate_with_wrong_stage_ranks() -> None:
    """Stage 0 of a 2-stage split told its pipeline has 3 ranks (refused before any send)."""
    from hf_meshtune.pipeline.generate import pipelined_generate
    from hf_meshtune.pipeline.stage import build_stage

    module = build_stage(tiny_llama(), 0, 2, MeshConfig(num_stages=2), masked=False)
    ids = torch.ones(2, 4, dtype=torch.long)
    pipelined_generate(module, Wire(), [0, 1, 2], RolloutSettings(max_new_tokens=4, pad_token_id=0), ids)


def generate_with_mismatched_mask() -> None:
    """Stage 0 given [2, 4] prompts and a [2, 3] padding mask (refused before any send)."""
    from hf_meshtune.pipeline.generate import pipelined_generate
    from hf_meshtune.pipeline.stage import build_stage

    module = build_stage(tiny_llama(), 0, 2, MeshConfig(num_stages=2), masked=False)
    ids, mask = torch.ones(2, 4, dtype=torch.long), torch.ones(2, 3, dtype=torch.long)
    pipelined_generate(module, Wire(), [0, 1], RolloutSettings(max_new_tokens=4, pad_token_id=0), ids, mask)


def mesh_trainer_in(world_size: int, mesh: str | None, **overrides: object) -> Callable[[Path], object]:
    """A trigger: MeshTrainer(...) built on one rank of a launched job of ``world_size`` processes."""

    def trigger(tmp: Path) -> None:
        args = mesh_args(tmp, **overrides)  # built before the launch variables, as a script's parser would
        with launched(world_size, mesh):
            MeshTrainer(model=tiny_llama(), args=args, train_dataset=pattern_dataset(16, 8))

    return trigger


def mesh_train_in(
    world_size: int,
    mesh: str | None,
    model_factory: Callable[[], nn.Module] = tiny_llama,
    resume_from: str | bool | None = None,
    **overrides: object,
) -> Callable[[Path], object]:
    """A trigger: MeshTrainer(...).train() on one rank of a launched job (refused before any rendezvous)."""

    def trigger(tmp: Path) -> None:
        args = mesh_args(tmp, **overrides)
        with launched(world_size, mesh):
            trainer = MeshTrainer(model=model_factory(), args=args, train_dataset=pattern_dataset(16, 8))
            trainer.train(resume_from_checkpoint=resume_from)

    return trigger


def from_environment(
    world_size: int, num_stages: int, mesh: str | None, anchor: bool = True, num_layers: int = 4
) -> Callable[[], MeshTopology]:
    """A trigger: ``MeshTopology.from_environment`` on a rank whose MESHTUNE_MESH is ``mesh``."""

    def trigger() -> MeshTopology:
        with environ(MESHTUNE_MESH=mesh):
            return MeshTopology.from_environment(world_size, num_stages, anchor, num_layers)

    return trigger


def replica_job(
    world_size: int, num_stages: int, mesh: str | None, replica: str, anchor: bool = False
) -> Callable[[], MeshTopology]:
    """A trigger: ``MeshTopology.from_environment`` on a rank of replica job ``MESHTUNE_REPLICA=replica``."""

    def trigger() -> MeshTopology:
        with environ(MESHTUNE_MESH=mesh, MESHTUNE_REPLICA=replica):
            return MeshTopology.from_environment(world_size, num_stages, anchor, 4)

    return trigger


def _ranks_with_different_knobs() -> None:
    """What every rank of a 2x2 world sees when rank 1's settings differ (a store holding all four)."""
    import json

    import torch.distributed as dist

    from hf_meshtune.runtime.bootstrap import _require_same_settings, _settings_of
    from hf_meshtune.runtime.settings import RunSettings

    def settings(ratio: float) -> RunSettings:
        return RunSettings(
            config=MeshConfig(anchor=False, num_stages=2, mask_ratio=ratio),
            microbatch_size=1,
            microbatches=1,
            seq_len=8,
            max_steps=1,
            dp_timeout_s=1.0,
        )

    store = dist.HashStore()
    for rank in (0, 2, 3):
        store.set(f"hf_meshtune/settings/{rank}", json.dumps(_settings_of(settings(0.9))))
    _require_same_settings(store, MeshTopology(2, 2, anchor=False), 1, settings(0.95))


def _allreduce_on_rank0(topology: MeshTopology) -> None:
    """run_worker of mesh rank 0 with dp_mode='allreduce' on ``topology``, without any process group."""
    from hf_meshtune.runtime.bootstrap import run_worker
    from hf_meshtune.runtime.settings import RunSettings
    from hf_meshtune.topology import MeshGroups

    settings = RunSettings(
        config=MeshConfig(anchor=False, num_stages=2),
        microbatch_size=1,
        microbatches=1,
        seq_len=8,
        max_steps=1,
        dp_mode="allreduce",
    )
    groups = MeshGroups(topology, rank=0, replica=0, stage=0, pp_group=None)
    run_worker(tiny_llama(), groups, settings, lambda step: None)


def _allreduce_in_replica_job() -> None:
    _allreduce_on_rank0(MeshTopology(3, 2, anchor=False, job_replica=0))


def _fixed_link_knob_in_anchor_replica_job(**knobs) -> Callable[[], None]:
    """A trigger: run_worker of mesh rank 0 of a 3x2 replica job with the anchor on and ``knobs``."""

    def trigger() -> None:
        from hf_meshtune.runtime.bootstrap import run_worker
        from hf_meshtune.runtime.settings import RunSettings
        from hf_meshtune.topology import MeshGroups

        settings = RunSettings(
            config=MeshConfig(anchor=True, num_stages=2, **knobs),
            microbatch_size=1,
            microbatches=1,
            seq_len=8,
            max_steps=1,
        )
        groups = MeshGroups(MeshTopology(3, 2, anchor=True, job_replica=0), rank=0, replica=0, stage=0, pp_group=None)
        run_worker(tiny_llama(), groups, settings, lambda step: None)

    return trigger


def _replica_job_without_lighthouse() -> None:
    from hf_meshtune.runtime.job import _lighthouse

    with environ(TORCHFT_LIGHTHOUSE=None):
        _lighthouse(0, MeshTopology(3, 2, anchor=False, job_replica=0))


def _job_store_without_port() -> None:
    from hf_meshtune.comm.jobs import job_store

    with environ(MESHTUNE_JOB_STORE="nowhere"):
        job_store(1.0)


def _unresolvable_host() -> None:
    from hf_meshtune.comm.listen import listen_address

    with environ(MESHTUNE_HOST="no-such-host.invalid"):
        listen_address()


def _foreign_dp_host(host: str = "192.0.2.7") -> None:
    from hf_meshtune.comm.listen import dp_gloo_device

    with environ(MESHTUNE_DP_HOST=host):
        dp_gloo_device()


def _secret_in(tmp: Path, content: str | None, **env: str | None) -> None:
    """``secret_key()`` with ``<tmp>/secret`` holding ``content`` (None: no such file) named by MESHTUNE_SECRET_FILE."""
    from hf_meshtune.comm.gate import secret_key

    if content is not None:
        (tmp / "secret").write_text(content, encoding="utf-8")
    with environ(MESHTUNE_SECRET_FILE=str(tmp / "secret"), **{"MESHTUNE_SECRET": None, **env}):
        secret_key()


def _guarded_process(**env: str | None) -> None:
    from hf_meshtune.comm import gate

    with environ(**{"MESHTUNE_SECRET": None, "MESHTUNE_SECRET_FILE": None, "MESHTUNE_GATE": None, **env}):
        assert not gate._GUARD
        gate.guard_launched_process()


def _mesh_checkpoint(tmp: Path, step: int, ranks=(0, 1, 2, 3), **state) -> str:
    """A 3x2 (anchor on) mesh checkpoint of fake states under ``tmp``; returns its folder."""
    from hf_meshtune.runtime.checkpoint import save_rank_state

    for rank in ranks:
        save_rank_state(str(tmp), step, rank, dict(state), MeshTopology(3, 2), None)
    return str(tmp / f"checkpoint-{step}")


def _incomplete_mesh_checkpoint(tmp: Path) -> None:
    checkpoint = _mesh_checkpoint(tmp, 8, ranks=(0, 1, 3))
    mesh_train_in(6, "3x2", resume_from=checkpoint, num_stages=2)(tmp)


def _checkpoint_of_another_mesh(tmp: Path) -> None:
    from hf_meshtune.runtime.checkpoint import read_rank_state

    read_rank_state(_mesh_checkpoint(tmp, 4), 0, MeshTopology(2, 2, anchor=False))


def _damaged_rank_file(tmp: Path) -> None:
    from hf_meshtune.runtime.checkpoint import read_rank_state

    checkpoint = _mesh_checkpoint(tmp, 4)
    Path(checkpoint, "mesh", "rank0.pt").write_bytes(b"")
    read_rank_state(checkpoint, 0, MeshTopology(3, 2))


def _mesh_resume_with_changed_knob() -> None:
    import dataclasses

    from hf_meshtune.config import require_saved_knobs

    require_saved_knobs(
        dataclasses.asdict(MeshConfig(mask_ratio=0.9)),
        MeshConfig(mask_ratio=0.5),
        context="to resume from checkpoint-4",
    )


def embeddings_and_first_layers_frozen() -> nn.Module:
    """Stage 0 of a Y = 2 pipeline (embeddings + layers 0, 1) has nothing left to train."""
    model = tiny_llama()
    for param in [*model.model.embed_tokens.parameters(), *model.model.layers[:2].parameters()]:
        param.requires_grad_(False)
    return model


def bidirectional_gemma3() -> nn.Module:
    """Gemma 3 with bidirectional attention (an embedding model's setting): its masks are not causal."""
    return make_tiny_causal_lm("gemma3_text", use_bidirectional_attention=True)


def llama_without_head() -> nn.Module:
    """The bare decoder (``LlamaModel``): decoder layers, no LM head."""
    return tiny_llama().model


def run_settings(config: MeshConfig | None = None, **sizes: object) -> Callable[[], object]:
    """A trigger: the settings every rank of the mesh builds from the knobs after the rendezvous."""
    from hf_meshtune.runtime.settings import RunSettings

    full = {"microbatch_size": 1, "microbatches": 1, "seq_len": 8, "max_steps": 1, **sizes}
    return lambda: RunSettings(config=config or MeshConfig(preset="paper"), **full)


def groups_without_process_group() -> None:
    MeshTopology(3, 2).build_groups()


def dp_peers_in_a_replica_job() -> None:
    MeshTopology(3, 2, anchor=False, job_replica=0).build_groups(dp_peers=True)


def _allreduce_without_peer_groups() -> None:
    _allreduce_on_rank0(MeshTopology(2, 2, anchor=False))


# --- model types --------------------------------------------------------------------------------------


class TwoLayerMLP(nn.Module):
    """Not a transformers model: no decoder-layer list, no ``_no_split_modules``."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])


def protect_dims_at_train(tmp: Path) -> None:
    mesh_trainer(tmp, mask_protect_dims=40).train()


# --- anchor -------------------------------------------------------------------------------------------


def only_vectors_trainable() -> nn.Module:
    """Every matrix frozen: the anchor (and the spectral filter) would have nothing to act on."""
    model = tiny_llama()
    for param in model.parameters():
        param.requires_grad_(param.ndim != 2)
    return model


def anchor_circuit(every: int = 1, delay: int = 0, batches: Callable[[int], list] = lambda r: []) -> AnchorCircuit:
    model = tiny_llama()
    return AnchorCircuit(
        model, {O_PROJ: model.get_parameter(O_PROJ)}, None, every, delay, batches, lambda m, b: m(**b).loss
    )


def anchor_round_without_batches() -> None:
    circuit = anchor_circuit()
    circuit.on_step(0, SpectralAdamW([circuit.params[O_PROJ]]))


def no_rows() -> Iterator[dict]:
    yield from ()


# --- MeshPlugin / MeshAccelerator -----------------------------------------------------------------------


def plugin(**kwargs: object) -> Callable[[], object]:
    """A trigger: ``MeshPlugin(**kwargs)`` (env-backed fields from a clean environment)."""
    from hf_meshtune.accelerate import MeshPlugin

    return lambda: MeshPlugin(**kwargs)


def plugin_from_env(name: str, value: str) -> Callable[[], object]:
    """A trigger: ``MeshPlugin()`` with ``$name=value`` set."""
    from hf_meshtune.accelerate import MeshPlugin

    def trigger() -> object:
        with environ(**{name: value}):
            return MeshPlugin()

    return trigger


def train_loader(dataset: object = None, **kwargs: object) -> DataLoader:
    """The training DataLoader of the accelerate rows: 8 counting rows, batches of 2."""
    from transformers import default_data_collator

    options = {"batch_size": 2, "collate_fn": default_data_collator, **kwargs}
    return DataLoader(pattern_dataset(8, 8) if dataset is None else dataset, **options)


def prepare(
    *objects: Callable[[nn.Module], object], model: Callable[[], nn.Module] = tiny_llama, **plugin_kwargs: object
) -> Callable[[], object]:
    """A trigger: ``MeshAccelerator(mesh_plugin=MeshPlugin(preset="paper", **plugin_kwargs)).prepare(model, *objects)``;
    each object is built from the model (an optimizer over its parameters, a loader, ...)."""
    from hf_meshtune.accelerate import MeshAccelerator, MeshPlugin

    def trigger() -> object:
        net = model()
        knobs = {"preset": "paper", "num_stages": 2, "mask_ratio": 0.5, **plugin_kwargs}  # the paper's masks + anchor
        accelerator = MeshAccelerator(mesh_plugin=MeshPlugin(**knobs))
        return accelerator.prepare(net, *(build(net) for build in objects))

    return trigger


def adamw(**kwargs: object) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda net: torch.optim.AdamW(net.parameters(), lr=1e-3, **kwargs)


def adam(**kwargs: object) -> Callable[[nn.Module], torch.optim.Optimizer]:
    return lambda net: torch.optim.Adam(net.parameters(), lr=1e-3, **kwargs)


def sgd(net: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=1e-3)


def stepped_adamw(net: nn.Module) -> torch.optim.Optimizer:
    """An AdamW that has already taken a step (its moments exist)."""
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-3)
    for param in net.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    return optimizer


def loader(**kwargs: object) -> Callable[[nn.Module], DataLoader]:
    return lambda net: train_loader(**kwargs)


class CountingStream(IterableDataset):
    """An iterable dataset: no ``__getitem__``, so the anchor cannot draw its own rows."""

    def __iter__(self) -> Iterator[dict]:
        yield from pattern_dataset(8, 8)


def accelerator_with_plain_config() -> object:
    from hf_meshtune.accelerate import MeshAccelerator

    return MeshAccelerator(mesh_plugin=MeshConfig())


def accelerate_resume_with_changed_knob(tmp: Path) -> None:
    """``save_state`` at p = 0.5, then ``load_state`` into an accelerator set up with p = 0.75."""
    from accelerate.state import AcceleratorState, GradientState

    from hf_meshtune.accelerate import MeshAccelerator, MeshPlugin

    def setup(mask_ratio: float) -> MeshAccelerator:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        net = tiny_llama()
        accelerator = MeshAccelerator(mesh_plugin=MeshPlugin(num_stages=2, mask_ratio=mask_ratio, anchor=False))
        accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=1e-3), train_loader())
        return accelerator

    setup(0.5).save_state(str(tmp / "state"))
    setup(0.75).load_state(str(tmp / "state"))


# --- TRL ----------------------------------------------------------------------------------------------


def trl_config(name: str, tmp: Path, **kwargs: object) -> object:
    """``trl.<name>(output_dir=<tmp>/out, bf16=False, **kwargs)``: TRL's own config, not the Mesh one."""
    import trl

    return getattr(trl, name)(output_dir=str(tmp / "out"), bf16=False, **kwargs)


def mesh_config_of(name: str, **kwargs: object) -> Callable[[Path], object]:
    """A trigger: ``hf_meshtune.<name>(output_dir=<tmp>/out, **kwargs)`` (MeshSFTConfig, MeshGRPOConfig, ...)."""
    import hf_meshtune

    return lambda tmp: getattr(hf_meshtune, name)(output_dir=str(tmp / "out"), **kwargs)


def grpo_config_on_mesh(name: str, **kwargs: object) -> Callable[[Path], object]:
    """A trigger: a GRPO/GSPO config built in a process launched as one of a 3x2 mesh's 6."""
    import hf_meshtune

    def trigger(tmp: Path) -> object:
        with launched(6, "3x2"):
            return getattr(hf_meshtune, name)(output_dir=str(tmp / "out"), num_stages=2, **kwargs)

    return trigger


def sft_trainer_with_trl_config(tmp: Path) -> None:
    from hf_meshtune import MeshSFTTrainer

    MeshSFTTrainer(model=tiny_llama(), args=trl_config("SFTConfig", tmp), train_dataset=pattern_dataset(8, 8))


def grpo_trainer_with_trl_config(tmp: Path) -> None:
    from hf_meshtune import MeshGRPOTrainer
    from hf_meshtune.apps.arithmetic import exact_answer_reward

    config = trl_config("GRPOConfig", tmp, per_device_train_batch_size=8, num_generations=8)
    MeshGRPOTrainer(model=tiny_llama(), reward_funcs=exact_answer_reward, args=config)


def grpo_trainer_on_mesh(reward_funcs: object = None, **kwargs: object) -> Callable[[Path], None]:
    """A trigger: ``MeshGRPOTrainer`` built on a rank launched as one of a 3x2 mesh's 6 (``reward_funcs``
    None: the arithmetic reward)."""

    def trigger(tmp: Path) -> None:
        from hf_meshtune import MeshGRPOConfig, MeshGRPOTrainer
        from hf_meshtune.apps.arithmetic import exact_answer_reward

        with launched(6, "3x2"):
            config = MeshGRPOConfig(output_dir=str(tmp / "out"), num_stages=2)
            funcs = exact_answer_reward if reward_funcs is None else reward_funcs
            MeshGRPOTrainer(model=tiny_llama(), reward_funcs=funcs, args=config, **kwargs)

    return trigger


def sft_trainer_on_mismatched_mesh(tmp: Path) -> None:
    from hf_meshtune import MeshSFTConfig, MeshSFTTrainer

    config = MeshSFTConfig(output_dir=str(tmp / "out"), num_stages=4, max_steps=2)
    with launched(6, "3x2"):
        MeshSFTTrainer(model=tiny_llama(), args=config, train_dataset=pattern_dataset(8, 8))


# --- PEFT ---------------------------------------------------------------------------------------------


def peft_trainer(config_name: str, model: object = "tiny", **config: object) -> Callable[[Path], object]:
    """A trigger: ``MeshTrainer(model, args, peft_config=peft.<config_name>(task_type="CAUSAL_LM", **config))``."""

    def trigger(tmp: Path) -> object:
        import peft

        peft_config = getattr(peft, config_name)(task_type="CAUSAL_LM", **config)
        net = tiny_llama() if model == "tiny" else model
        return MeshTrainer(model=net, args=mesh_args(tmp), train_dataset=pattern_dataset(8, 8), peft_config=peft_config)

    return trigger


# --- recipes ------------------------------------------------------------------------------------------


def arithmetic_problems(**kwargs: object) -> Callable[[], object]:
    from hf_meshtune.apps.arithmetic import problems

    return lambda: problems(**{"count": 4, **kwargs})


def read_no_text_files() -> None:
    load_recipe("cpt").read_text_files([])


# --- masks and boundaries -----------------------------------------------------------------------------


def attach(num_stages: int = 2, **kwargs: object) -> Callable[[], object]:
    return lambda: attach_boundaries(tiny_llama(), num_stages, **kwargs)


def protect_negative_dims() -> None:
    model = tiny_llama()
    handle = attach_boundaries(model, 2, 0.5)
    handle.protect_largest_dims(model, {"input_ids": torch.tensor([[3, 4, 5]])}, -1)


def fill(name: str, **kwargs: object) -> Callable[[], object]:
    from hf_meshtune.boundary import fills

    return lambda: getattr(fills, name)(**kwargs)


# --- codecs -------------------------------------------------------------------------------------------


def codec(name: str, *args: object, **kwargs: object) -> Callable[[], object]:
    from hf_meshtune.boundary import codecs

    return lambda: getattr(codecs, name)(*args, **kwargs)


def _governed_handle():
    """A governed handle (ladder int4, int8) on the tiny Llama split in 2 stages."""
    from hf_meshtune.boundary.compose.grammar import parse_codec
    from hf_meshtune.boundary.compose.handle import attach_composed

    return attach_composed(tiny_llama(), 2, "int8", ladder=[parse_codec("int4"), parse_codec("int8")])


def without_module(name: str, call: Callable[[], object]) -> Callable[[], object]:
    """A trigger: ``call`` while ``import name`` fails (an environment that lacks the package)."""

    def trigger() -> object:
        saved = sys.modules.get(name)
        sys.modules[name] = None  # type: ignore[assignment]  # makes `import name` raise ImportError
        try:
            return call()
        finally:
            if saved is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = saved

    return trigger


def attach_composed_to_tiny(codec: str) -> Callable[[], object]:
    """A trigger: ``attach_composed`` of ``codec`` on the tiny Llama (H = 64) split in 2 stages."""
    from hf_meshtune.boundary.compose.handle import attach_composed

    return lambda: attach_composed(tiny_llama(), 2, codec)


def composed(call: str) -> Callable[[], object]:
    """A trigger on the composed codec's pieces at H = 64 (``call`` names which)."""
    from hf_meshtune.boundary.compose import ComposedCodec, parse_codec
    from hf_meshtune.boundary.compose.handle import attach_composed
    from hf_meshtune.boundary.masking import BoundaryMask
    from hf_meshtune.pipeline.stage import StageModule

    calls = {
        "mask spec": lambda: ComposedCodec(parse_codec("mask0.9"), 0, 64),
        "one token": lambda: ComposedCodec(parse_codec("outliers2+int4"), 0, 64).fit(torch.zeros(1, 64)),
        "other width": lambda: ComposedCodec(parse_codec("outliers2+int4"), 0, 64).fit(torch.zeros(4, 32)),
        "state": lambda: attach_composed(tiny_llama(), 4, "int4").load_state_dict({"step": 0, "codecs": []}),
        "both": lambda: StageModule(
            tiny_llama(), 0, 2, None, BoundaryMask(0, 0.5), None, ComposedCodec(parse_codec("int4"), 0, 64)
        ),
    }
    return calls[call]


def unfitted_codec_runs() -> object:
    from hf_meshtune.boundary.compose import ComposedCodec, parse_codec

    return ComposedCodec(parse_codec("outliers2+int4"), 0, 64).encode_activation(torch.zeros(1, 64))


def attach_codec_twice() -> None:
    from hf_meshtune.boundary.codecs import attach_codec

    model = tiny_llama()
    attach_codec(model, 2, "quant4")
    attach_codec(model, 2, "quant4")


def attach_unknown_codec() -> None:
    from hf_meshtune.boundary.codecs import attach_codec

    attach_codec(tiny_llama(), 2, "zip")


def pca_forward_unfitted() -> None:
    from hf_meshtune.boundary.codecs import PCACodec

    PCACodec(64, rank=4)(torch.zeros(1, 2, 64))


def pca_fit_on_too_few_tokens() -> None:
    from hf_meshtune.boundary.codecs import PCACodec

    PCACodec(64, rank=4).fit(torch.zeros(1, 2, 64))


def delta_quant_without_keys() -> None:
    from hf_meshtune.boundary.codecs import DeltaQuantCodec

    DeltaQuantCodec(64)(torch.zeros(2, 3, 64))


def codec_on_wrong_width() -> None:
    from hf_meshtune.boundary.codecs import QuantCodec

    QuantCodec(64)(torch.zeros(1, 2, 32))


def codec_state_of_other_mesh() -> None:
    from hf_meshtune.boundary.codecs import attach_codec

    attach_codec(tiny_llama(), 2, "quant4").load_state_dict({"codecs": []})


# --- mesh internals -----------------------------------------------------------------------------------


def wire_send(circuit: str) -> Callable[[], None]:
    from hf_meshtune.comm.wire import Wire

    return lambda: Wire().record_send(circuit, torch.zeros(1))


def wire_all_reduce_over_nobody() -> None:
    from hf_meshtune.comm.wire import Wire

    Wire().record_all_reduce("dp", torch.zeros(1), participants=0)


def powersgd(*args: object, **kwargs: object) -> Callable[[], object]:
    from hf_meshtune.dp.powersgd import PowerSGD

    return lambda: PowerSGD(*args, **kwargs)


def lockstep_delivery_off_schedule() -> None:
    """A lockstep fast rank expecting snapshot 2 at step 2 receives the gradient of snapshot 4."""
    from hf_meshtune.anchor.link import FastAnchorLink
    from hf_meshtune.comm.messages import DATA, GRADIENTS

    class Inbox:
        def next(self):
            return GRADIENTS.decode(GRADIENTS.encode(DATA, 4)), torch.zeros(0)

    link = FastAnchorLink.__new__(FastAnchorLink)  # the link's state without its gloo threads
    link.lockstep, link.expected, link.ended, link.lost_at, link.inbox = (2, 0), None, False, None, Inbox()
    link.drain(None, 2)


def update_with_missing_shapes() -> None:
    from hf_meshtune.dp.outer import OuterUpdate

    OuterUpdate(fragment=0, step=1, tensors=[torch.zeros(3)]).pseudo_gradients([])


def outer_follower(
    fragments: list[nn.Module] | None = None, lr: float = 0.7, momentum: float = 0.9
) -> Callable[[], object]:
    from hf_meshtune.anchor.follower import OuterFollower

    return lambda: OuterFollower(
        fragments if fragments is not None else [nn.Linear(2, 2)], outer_lr=lr, outer_momentum=momentum
    )


def follower_given_unknown_fragment() -> None:
    from hf_meshtune.anchor.follower import OuterFollower
    from hf_meshtune.dp.outer import OuterUpdate

    follower = OuterFollower([nn.Linear(2, 2)], outer_lr=0.7, outer_momentum=0.9)
    follower.apply(OuterUpdate(fragment=3, step=1, tensors=[]))


def int8_sync_unpacked(words: int, participants: float = 3.0) -> Callable[[], object]:
    """A trigger: an anchor-link payload of ``words`` float32 words read as an int8 sync of 1,000 values."""

    def trigger() -> None:
        from hf_meshtune.dp.quantize import Int8Codes

        payload = torch.zeros(words)
        payload[0] = participants
        Int8Codes.unpack(payload, [1000])

    return trigger


def diloco(fragments: object = None, **kwargs: object) -> Callable[[], object]:
    """A trigger: ``StreamingDiLoCo(manager, fragments, inner, ...)``; every check runs before the manager is used."""
    from hf_meshtune.dp.diloco import StreamingDiLoCo

    def trigger() -> object:
        parts = [nn.Linear(2, 2), nn.Linear(2, 2)] if fragments is None else fragments
        inner = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        return StreamingDiLoCo(None, parts, inner, **{"sync_every": 4, "powersgd_rank": None, **kwargs})

    return trigger


def lighthouse_for(min_replicas: int) -> Callable[[], object]:
    from hf_meshtune.dp.ft import start_lighthouse

    return lambda: start_lighthouse(min_replicas)


def manager(**kwargs: object) -> Callable[[], object]:
    from hf_meshtune.dp.ft import make_manager

    full = {
        "replica": 0,
        "stage": 0,
        "num_stages": 2,
        "lighthouse_addr": "http://localhost:1",
        "store_addr": "localhost",
        "store_port": 1,
        **kwargs,
    }
    return lambda: make_manager(**full)


def stage_split_into(count: int) -> None:
    from hf_meshtune.dp.fragments import stage_fragments
    from hf_meshtune.pipeline.stage import StageModule

    stage_fragments(StageModule(tiny_llama(), 0, 2, None, None), count)


def schedule_without_microbatches() -> None:
    from hf_meshtune.pipeline.schedule import build_schedule

    build_schedule(None, 0, lambda logits, labels: logits.sum())


# ---------------------------------------------------------------------------------------------------
# The rows
# ---------------------------------------------------------------------------------------------------

KNOBS = "MeshConfig / MeshTrainingArguments knobs"
SPECTRAL = "SpectralAdamW"
MESH = "mesh shape (MESHTUNE_MESH / WORLD_SIZE)"
RANKS = "ranks started with different mesh settings"
MODELS = "model types"
CLI = "meshtune CLI (ledger / launch / report / demo)"
CHECKPOINTS = "checkpoints and resume"
TRL = "TRL configs and trainers"
PEFT = "PEFT"
ACCELERATE = "MeshPlugin / MeshAccelerator"
RECIPES = "recipes"
ANCHOR = "anchor / AnchorBatches"
MASKS = "masks and boundaries (attach_boundaries, keep_indices, fills)"
LEDGER = "byte ledger API (LedgerSettings, settings_for_row)"
CODECS = "boundary codecs (hf_meshtune.boundary.codecs)"
COMPOSED = "composed boundary codec (boundary_codec)"
GOVERNOR = "fidelity governor and anchor cadence (boundary_codec='governed', anchor_cadence)"
CHANGE = "per-sample change coding (boundary_change_codec)"
INTERNALS = "mesh internals (dp, comm, pipeline)"

GROUP_NOTES: dict[str, str] = {
    KNOBS: "The same `validate_mesh()` runs in `MeshConfig`, `MeshTrainingArguments`, `MeshSFTConfig`, "
    "`MeshGRPOConfig`, `MeshGSPOConfig` and `MeshPlugin` (and so for every recipe flag `--<knob>`), at construction. "
    "Knob types are not checked beyond what each rule compares (the row with a string value shows what that gives).",
    SPECTRAL: "`SpectralAdamW(params, ...)` checks its defaults and every param group (constructor and "
    "`add_param_group`); `update_anchor` checks every entry before it changes anything.",
    MESH: "A launched job (`meshtune launch`, `torchrun`, `accelerate launch`: WORLD_SIZE > 1) checks its shape on "
    "every rank from facts every rank has, before any rendezvous, so an impossible mesh fails everywhere with one "
    "message instead of hanging. The rows run as one rank in this process with the launcher's variables set.",
    RANKS: "Each rank checks its own MESHTUNE_MESH, WORLD_SIZE and `--num_stages` before any rendezvous; the "
    "multi-process version (3 real ranks given MESHTUNE_MESH=2x2, all fail with the same message, none hangs) is "
    "`tests/test_mesh.py::test_a_mismatched_mesh_fails_on_every_rank_without_a_hang`. Not checked: ranks that agree on "
    "the shape but were started with different knobs (`--mask_ratio`, `--mask_seed`, `--anchor`, ...); nothing "
    "compares them across ranks.",
    MODELS: "Any causal LM with a decoder-layer list declared in `_no_split_modules` takes the masked boundaries "
    "(on one process); the distributed pipeline rebuilds the decoder families whose base-model forward it has read "
    "(Llama, Mistral, Qwen2/3, Gemma 1/2/3, Phi/Phi-3, OLMo 1/2, StableLM, GPT-NeoX; sliding-window layers and logit "
    "soft-capping included) and says why it refuses any other.",
    CLI: "`meshtune` prints `meshtune <command>: error: <message>` and exits with code 2 for every `ValueError` "
    "(and argparse does the same for malformed flags, after its usage line). Messages name the library's field "
    "(`global_batch` for `--batch-size`, `activation_dtype` for `--dtype`), not the flag.",
    CHECKPOINTS: "`trainer.train(resume_from_checkpoint=...)` continues bit-exactly only with the knobs it was saved "
    "with; `mesh_state.pt` must be there. A damaged `mesh_state.pt` is not validated by hf_meshtune: the rows record "
    "what torch or Python raise today.",
    TRL: "TRL's trainers take only their Mesh config (TRL would silently convert any other). GRPO/GSPO on the "
    "distributed mesh checks what it runs on every rank before any rendezvous: at the config (batch shapes, "
    "iterations, reference syncing, loss terms, sampling options) and before TRL's set-up in the trainer (reward "
    "functions, tools).",
    PEFT: "`peft_config=` works with `MeshTrainer`, `MeshSFTTrainer` and `MeshGRPOTrainer`; with "
    "`optim=\"spectral_adamw\"` the adapter must train weight matrices (LoRA).",
    ACCELERATE: "`MeshPlugin` validates like `MeshConfig`; a bad value that came from `MESHTUNE_<FIELD>` names the "
    "variable. `MeshAccelerator.prepare` checks everything before it changes the model or the optimizer.",
    RECIPES: "`recipes/sft.py`, `recipes/cpt.py` (`main(argv)` = `python recipes/<name>.py argv`) and the arithmetic "
    "task they train on. The rows run the recipes on a tiny local model folder (`--model_name_or_path`).",
    ANCHOR: "The anchor draws its own batches from the training dataset and differentiates the trainable matrices.",
    MASKS: "The single-process pieces `MeshTrainer` is built from, called directly.",
    LEDGER: "`meshtune ledger` passes its flags to these; the CLI rows above show the flags.",
    CODECS: "Baseline boundary codecs (`attach_codec`), used by the quality benchmark.",
    COMPOSED: "The `boundary_codec` string is parsed where the knobs are checked (`MeshConfig` and every config, "
    "plugin and recipe flag built on the same knobs); the rules that need the hidden size H are checked where a "
    "model meets the codec (`attach_composed`, `MeshTrainer`, every mesh rank's stage), before any step.",
    GOVERNOR: "The ladder, target and cadence knobs are checked with the other knobs (every config, plugin and "
    "recipe flag); the ladder's order needs the hidden size and is checked where a model meets it (`MeshTrainer`, "
    "`MeshAccelerator.prepare`, the TRL trainers).",
    CHANGE: "The change codec's string and its rule with `boundary_codec` are checked with the other knobs; the "
    "group size against H where a model meets it; the dataset (map-style, the caches' predicted size against "
    "`change_cache_gb`) when `train()` builds its dataloader, before the first step.",
    INTERNALS: "What every rank of the distributed mesh builds from the knobs: an error here, reached through "
    "`MeshTrainer`, would be a bug (the knobs are checked first), so these rows call the pieces directly.",
}


def _knob(message: str, **kwargs: object) -> Case:
    """A ``MeshConfig(**kwargs)`` row; the input is the kwargs as written."""
    text = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
    return Case(KNOBS, text, "`MeshConfig(...)`", lambda: MeshConfig(**kwargs), ValueError, message)


def _spectral(message: str, **kwargs: object) -> Case:
    text = ", ".join(f"{key}={value!r}" for key, value in kwargs.items())
    return Case(SPECTRAL, text, "`SpectralAdamW(params, ...)`", spectral(**kwargs), ValueError, message)


def _cli(input: str, message: str, trigger: Callable[..., None] | None = None, note: str = "") -> Case:
    """A ``meshtune`` row: ``input`` is the command line; exit code 2 and the last stderr line."""
    argv = input.split()[1:]
    return Case(CLI, input, f"`meshtune {argv[0]}`", trigger or cli(*argv), CliExit, f"exit 2: {message}", note=note)


_FILLS = "['gaussian', 'mean', 'zeros']"
_ADAMW_ENUM = "'adamw_torch'"  # the user's string, not transformers' enum
_RESUME = "to resume exactly (start a new run to change it)"
_ROWS = "['Dense', '+DP', 'M95', 'M90+AP', 'M95+AP']"
_DTYPES = "['bf16', 'bfloat16', 'float16', 'float32', 'float64', 'float8_e4m3fn', 'float8_e5m2', 'fp16', 'fp32']"
_RUN_RULE = (
    "contain at least one run: a folder with trainer_state.json (or checkpoint-N/trainer_state.json), "
    "mesh_summary.json or summary.json"
)
_PIPELINE = (
    "be one of ['llama', 'mistral', 'qwen2', 'qwen3', 'gemma', 'gemma2', 'gemma3_text', 'phi3', 'phi', 'olmo', "
    "'olmo2', 'stablelm', 'gpt_neox'] for the distributed pipeline: its base model has no rotary position embedding "
    "(rotary_emb): its positions (learned absolute ones, as GPT-2's wpe) are added to the embeddings inside its "
    "forward, which no stage rebuilds"
)
_NO_DECODER = (
    "is invalid: it must contain an nn.ModuleList of decoder blocks declared in _no_split_modules "
    "(found no _no_split_modules)"
)
_SPECTRAL_PEFT = (
    "with optim='spectral_adamw' (the spectral filter acts on weight matrices such as lora_A [r, in] and "
    "lora_B [out, r]); use another optim with anchor=False"
)


def _cases() -> list[Case]:
    """Every row, grouped; the order here is the order of the tables."""
    return [
        # --- MeshConfig / MeshTrainingArguments knobs --------------------------------------------------
        _knob("mask_ratio=1.0 is invalid: it must lie in [0, 1)", mask_ratio=1.0),
        _knob("mask_ratio=-0.1 is invalid: it must lie in [0, 1)", mask_ratio=-0.1),
        _knob("num_stages=0 is invalid: it must be >= 1", num_stages=0),
        _knob(
            "stage_layers=[4] is invalid: it must have one count per stage (num_stages = 2), not 1",
            num_stages=2,
            stage_layers=[4],
        ),
        _knob(
            "stage_layers=[4, 0] is invalid: it must give every stage at least one decoder layer",
            num_stages=2,
            stage_layers=[4, 0],
        ),
        _knob("stage_layers='3,1' is invalid: it must be of type list[int] or None", num_stages=2, stage_layers="3,1"),
        _knob("preset='fast' is invalid: it must be one of ['quality', 'paper']", preset="fast"),
        _knob(f"mask_fill='ones' is invalid: it must be one of {_FILLS}", mask_fill="ones"),
        _knob(
            "mask_fill='mean' is invalid: it must be 'zeros' when mask_rescale=True (a rescaled payload and a filled "
            "estimate would count the dropped dims twice)",
            mask_rescale=True,
            mask_fill="mean",
        ),
        _knob("mask_protect_dims=-1 is invalid: it must be >= 0", mask_protect_dims=-1),
        _knob("anchor_every=0 is invalid: it must be >= 1", anchor_every=0),
        _knob("anchor_delay=-1 is invalid: it must be >= 0", anchor_delay=-1),
        _knob("anchor_beta=1.5 is invalid: it must lie in [0, 1]", anchor_beta=1.5),
        _knob("anchor_microbatches=0 is invalid: it must be None or an int >= 1", anchor_microbatches=0),
        _knob("anchor_max_staleness=0 is invalid: it must be None or an int >= 1", anchor_max_staleness=0),
        _knob("spectral_tau=0.0 is invalid: it must be > 0", spectral_tau=0.0),
        _knob("spectral_alpha=1.5 is invalid: it must lie in [0, 1]", spectral_alpha=1.5),
        _knob("spectral_rank=0 is invalid: it must be None or an int >= 1", spectral_rank=0),
        _knob("max_memory_per_stage=0.0 is invalid: it must be None or > 0 (GiB)", max_memory_per_stage=0.0),
        _knob("num_replicas=0 is invalid: it must be >= 1", num_replicas=0, anchor=False),
        _knob(
            "num_replicas=1 is invalid: it must be >= 2 when anchor=True (one replica is the anchor)",
            num_replicas=1,
            anchor=True,
        ),
        _knob("dp_sync_every=0 is invalid: it must be >= 1", dp_sync_every=0),
        _knob("dp_powersgd_rank=-1 is invalid: it must be None or an int >= 1", dp_powersgd_rank=-1),
        _knob("dp_fragments=0 is invalid: it must be an int >= 1", dp_fragments=0),
        _knob(
            "dp_fragments=3 is invalid: it must divide dp_sync_every=20 (one fragment syncs every dp_sync_every / "
            "dp_fragments steps)",
            dp_fragments=3,
        ),
        _knob(
            "dp_sync_delay=5 is invalid: it must lie in [0, dp_sync_every / dp_fragments = 5) (a fragment's sync must "
            "land before the next one starts)",
            dp_fragments=4,
            dp_sync_delay=5,
        ),
        _knob(
            "dp_keep_overlapped=True is invalid: it must be False when dp_sync_delay=0 (no inner step overlaps a "
            "sync: there is nothing to keep)",
            dp_keep_overlapped=True,
        ),
        _knob("dp_keep_overlapped='yes' is invalid: it must be of type bool", dp_keep_overlapped="yes"),
        _knob("dp_outer_lr=0.0 is invalid: it must be > 0", dp_outer_lr=0.0),
        _knob("dp_outer_momentum=1.0 is invalid: it must lie in [0, 1)", dp_outer_momentum=1.0),
        _knob("dp_timeout_s=0 is invalid: it must be > 0 (seconds)", dp_timeout_s=0),
        _knob("dp_quantize='int4' is invalid: it must be None or one of ['int8']", dp_quantize="int4"),
        _knob(
            "dp_quantize='int8' is invalid: it must be None with 128 fast replicas (the int8 codes of n replicas sum "
            "inside int8 only for n <= 127)",
            num_replicas=128,
            anchor=False,
        ),
        _knob("anchor_payload='svd' is invalid: it must be one of ['gradient', 'factors']", anchor_payload="svd"),
        _knob("anchor_rate_mbit=0.0 is invalid: it must be None or > 0 (Mbit/s)", anchor_rate_mbit=0.0),
        _knob(
            "spectral_rank=None is invalid: it must be set with anchor_payload='factors' (the rank r of the factors "
            "U_r, s_r, V_r the anchor sends)",
            anchor_payload="factors",
        ),
        Case(
            KNOBS,
            "mask_ratio='0.5' (a string, from Python)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(mask_ratio="0.5"),
            ValueError,
            "mask_ratio='0.5' is invalid: it must be of type float or None",
        ),
        Case(
            KNOBS,
            "num_stages=2.5",
            "`MeshConfig(...)`",
            lambda: MeshConfig(num_stages=2.5),
            ValueError,
            "num_stages=2.5 is invalid: it must be of type int or None",
        ),
        Case(
            KNOBS,
            "anchor='yes'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(anchor="yes"),
            ValueError,
            "anchor='yes' is invalid: it must be of type bool or None",
        ),
        Case(
            KNOBS,
            "anchor_every=True",
            "`MeshConfig(...)`",
            lambda: MeshConfig(anchor_every=True),
            ValueError,
            "anchor_every=True is invalid: it must be of type int",
        ),
        Case(
            KNOBS,
            "mask_ratio=1.0",
            "`MeshTrainingArguments(...)`",
            lambda tmp: mesh_args(tmp, mask_ratio=1.0),
            ValueError,
            "mask_ratio=1.0 is invalid: it must lie in [0, 1)",
        ),
        Case(
            KNOBS,
            "optim='adamw_torch' (anchor=True)",
            "`MeshTrainingArguments(...)`",
            lambda tmp: mesh_args(tmp, optim="adamw_torch"),
            ValueError,
            f"optim={_ADAMW_ENUM} is invalid: it must be 'spectral_adamw' when anchor=True (the anchor's gradients "
            "feed its spectral filter); set anchor=False for another optimizer",
        ),
        Case(
            KNOBS,
            "ddp_backend='nccl'",
            "`MeshTrainingArguments(...)`",
            lambda tmp: mesh_args(tmp, ddp_backend="nccl"),
            ValueError,
            "ddp_backend='nccl' is invalid: it must be 'gloo' or unset: every link of the mesh (pipeline "
            "boundaries, DiLoCo syncs, the anchor) runs on gloo, over any TCP link, with GPU tensors staged "
            "through CPU memory; NCCL needs one fabric",
        ),
        Case(
            KNOBS,
            "optim='lamb'",
            "`MeshTrainingArguments(...)`",
            lambda tmp: mesh_args(tmp, optim="lamb"),
            ValueError,
            "optim='lamb' is invalid: it must be 'spectral_adamw' or one of transformers' OptimizerNames",
        ),
        Case(
            KNOBS,
            "args=TrainingArguments(...) (no mesh knobs)",
            "`MeshTrainer(model, args)`",
            lambda tmp: MeshTrainer(model=tiny_llama(), args=_plain_training_arguments(tmp)),
            ValueError,
            "args='TrainingArguments' is invalid: it must be a MeshTrainingArguments (or another MeshArguments config) "
            "for a Mesh trainer",
        ),
        Case(
            KNOBS,
            "optimizers=(torch.optim.AdamW(...), None) with anchor=True",
            "`MeshTrainer(...).train()`",
            _trainer_given_adamw,
            ValueError,
            "optimizers[0]='AdamW' is invalid: it must be a SpectralAdamW when anchor=True (the anchor's gradients "
            "feed its spectral filter); pass none (optim='spectral_adamw' builds one) or set anchor=False",
        ),
        # --- SpectralAdamW -------------------------------------------------------------------------------
        _spectral("lr=-1.0 is invalid: it must be >= 0", lr=-1.0),
        _spectral("betas=(0.9, 1.0) is invalid: it must be two values in [0, 1)", betas=(0.9, 1.0)),
        _spectral("betas=(0.9, 0.99, 0.999) is invalid: it must be two values in [0, 1)", betas=(0.9, 0.99, 0.999)),
        _spectral("eps=-1e-08 is invalid: it must be >= 0", eps=-1e-8),
        _spectral("weight_decay=-0.1 is invalid: it must be >= 0", weight_decay=-0.1),
        _spectral("alpha=1.5 is invalid: it must lie in [0, 1]", alpha=1.5),
        _spectral("tau=0.0 is invalid: it must be > 0", tau=0.0),
        _spectral("anchor_beta=2.0 is invalid: it must lie in [0, 1]", anchor_beta=2.0),
        _spectral("rank=0 is invalid: it must be None or an int >= 1", rank=0),
        _spectral("rank=True is invalid: it must be None or an int >= 1", rank=True),
        _spectral("relative_tau='yes' is invalid: it must be a bool", relative_tau="yes"),
        _spectral("svd_niter=-1 is invalid: it must be an int >= 0", svd_niter=-1),
        _spectral("svd_oversample=1.5 is invalid: it must be an int >= 0", svd_oversample=1.5),
        _spectral("seed='0' is invalid: it must be an int", seed="0"),
        _spectral("max_staleness=0 is invalid: it must be None or an int >= 1", max_staleness=0),
        Case(
            SPECTRAL,
            "a param group with spectral='no'",
            "`SpectralAdamW([{'params': ..., 'spectral': 'no'}])`",
            lambda: spectral_group(spectral="no"),
            ValueError,
            "spectral='no' is invalid: it must be a bool",
        ),
        Case(
            SPECTRAL,
            "add_param_group({..., 'lr': -1.0})",
            "`SpectralAdamW.add_param_group`",
            added_group_with_negative_lr,
            ValueError,
            "lr=-1.0 is invalid: it must be >= 0",
        ),
        Case(
            SPECTRAL,
            "update_anchor({other_param: G})",
            "`SpectralAdamW.update_anchor`",
            anchor_for_foreign_parameter,
            ValueError,
            "grads key of shape=(4, 3) is invalid: it must be a parameter of this optimizer",
        ),
        Case(
            SPECTRAL,
            "update_anchor({W [4, 3]: G [3, 4]})",
            "`SpectralAdamW.update_anchor`",
            anchor_of_wrong_shape,
            ValueError,
            "grads value shape=(3, 4) is invalid: it must equal its parameter's shape (4, 3)",
        ),
        Case(
            SPECTRAL,
            "update_anchor_factors({W [4, 3]: (U [4, 2], s [3], V [3, 2])})",
            "`SpectralAdamW.update_anchor_factors`",
            factors_of_wrong_shape,
            ValueError,
            "factors value shapes=((4, 2), (3,), (3, 2)) is invalid: it must be (U [m, r], s [r], V [n, r]) for its "
            "parameter (4, 3)",
        ),
        # --- mesh shape ----------------------------------------------------------------------------------
        Case(
            MESH,
            "WORLD_SIZE=4, MESHTUNE_MESH=3x2",
            "`MeshTrainer(...)` on a launched rank",
            mesh_trainer_in(4, "3x2"),
            ValueError,
            "world_size=4 is invalid: it must equal X·Y = 3·2 = 6 (one process per replica and stage)",
        ),
        Case(
            MESH,
            "a checkpoint without `model.layers.3.mlp.up_proj.weight`, loaded on stage 1 of a 2x2 mesh",
            "`hf_meshtune.load_causal_lm(path)` on a launched rank",
            load_stage_of(drop="model.layers.3.mlp.up_proj.weight"),
            ValueError,
            "checkpoint tensor 'model.layers.3.mlp.up_proj.weight' (stage 1)='missing' is invalid: it must be in the "
            "checkpoint at <tmp>/ckpt: stage 1 holds it",
        ),
        Case(
            MESH,
            "a checkpoint whose `model.layers.2.self_attn.q_proj.weight` does not match its config",
            "`hf_meshtune.load_causal_lm(path)` on a launched rank",
            load_stage_of(reshape="model.layers.2.self_attn.q_proj.weight"),
            ValueError,
            "checkpoint tensor 'model.layers.2.self_attn.q_proj.weight' (stage 1)=[1] is invalid: it must have the "
            "shape [64, 64] that the checkpoint's config gives it",
        ),
        Case(
            MESH,
            "WORLD_SIZE=4, no MESHTUNE_MESH, no num_stages",
            "`hf_meshtune.load_causal_lm(path)` on a launched rank",
            lambda tmp: _load_without_stages(tmp),
            ValueError,
            "num_stages=None is invalid: it must be given to load a stage on a launched job without MESHTUNE_MESH "
            "(e.g. accelerate launch)",
        ),
        Case(
            MESH,
            "WORLD_SIZE=5, num_stages=2 (no MESHTUNE_MESH)",
            "`MeshTrainer(...)` on a launched rank",
            mesh_trainer_in(5, None),
            ValueError,
            "num_stages=2 is invalid: it must divide the world size 5 (X = world size / Y replicas of Y stages)",
        ),
        Case(
            MESH,
            "WORLD_SIZE=2, num_stages=2, anchor=True (X = 1)",
            "`MeshTrainer(...)` on a launched rank",
            mesh_trainer_in(2, None),
            ValueError,
            "replicas=1 is invalid: it must be >= 2 when the anchor is on (replica X-1 is the anchor, at least one "
            "replica must be fast)",
        ),
        Case(
            MESH,
            "WORLD_SIZE=12, num_stages=6 on a 4-layer model",
            "`MeshTrainer(...)` on a launched rank",
            mesh_trainer_in(12, None, num_stages=6),
            ValueError,
            "num_stages=6 is invalid: it must be <= the model's 4 decoder layers (every stage holds at least one)",
        ),
        Case(
            MESH,
            "MESHTUNE_MESH=3by2",
            "`MeshTrainer(...)` on a launched rank",
            mesh_trainer_in(6, "3by2"),
            ValueError,
            "MESHTUNE_MESH='3by2' is invalid: it must look like XxY, e.g. 3x2 (X replicas, Y stages)",
        ),
        Case(
            MESH,
            "MESHTUNE_MESH=0x2",
            "`MeshTrainer(...)` on a launched rank",
            mesh_trainer_in(6, "0x2"),
            ValueError,
            "MESHTUNE_MESH='0x2' is invalid: it must have X >= 1 replicas and Y >= 1 stages",
        ),
        Case(
            MESH,
            "stage_layers=[3, 3] for a 4-layer model on a 2x2 mesh",
            "`MeshTrainer(...).train()` on a launched rank",
            mesh_train_in(4, "2x2", stage_layers=[3, 3]),
            ValueError,
            "stage_layers=[3, 3] is invalid: it must sum to the model's 4 decoder layers (they sum to 6)",
        ),
        Case(
            MESH,
            "max_steps unset (epochs) on the mesh",
            "`MeshTrainer(...).train()` on a launched rank",
            mesh_train_in(4, "2x2", max_steps=-1),
            ValueError,
            "max_steps=-1 is invalid: it must be > 0 on the distributed mesh (epochs are not counted there)",
        ),
        Case(
            MESH,
            "stage 0 with every parameter frozen",
            "`MeshTrainer(...).train()` on a launched rank",
            mesh_train_in(4, "2x2", embeddings_and_first_layers_frozen, anchor=False, optim="adamw_torch"),
            ValueError,
            "trainable parameters of stage=0 is invalid: it must include at least one (freeze fewer layers: every "
            "stage of the mesh trains)",
        ),
        Case(
            MESH,
            "max_memory_per_stage=0.0001 (GiB) on a 2x2 mesh of a tiny Llama",
            "`MeshTrainer(...).train()` on a launched rank",
            mesh_train_in(4, "2x2", anchor=False, optim="adamw_torch", max_memory_per_stage=0.0001),
            ValueError,
            "max_memory_per_stage=0.0001 is invalid: it must be >= the 0.00224 GiB the memory ledger predicts for the "
            "fast stage 0 (weights 0.0003, gradients 0.000299, optimizer 0.000599, dp 0.000898, activations "
            "0.000139; the Python runtime not included): use more stages, LoRA, a smaller batch or gradient "
            "checkpointing",
        ),
        Case(
            MESH,
            "WORLD_SIZE=4 but accelerate set up one process (no ACCELERATE_USE_CPU=true on CPU)",
            "`MeshTrainer(...).train()` on a launched rank",
            mesh_train_in(4, "2x2"),
            ValueError,
            "TrainingArguments.world_size=1 is invalid: it must equal WORLD_SIZE=4 (accelerate did not join the "
            "launched processes; on CPU export ACCELERATE_USE_CPU=true or pass --use_cpu, as `meshtune launch --cpu` "
            "does)",
        ),
        Case(
            MESH,
            "mask_fill='gaussian' on the mesh",
            "`RunSettings(...)`, `MeshTrainer(...)` (every rank)",
            run_settings(MeshConfig(preset="paper", mask_fill="gaussian")),
            ValueError,
            "mask_fill='gaussian' is invalid: it must be 'zeros' or 'mean' on the distributed mesh (the 'gaussian' "
            "fill needs the anchor's dense activations on every receiving stage, which the mesh does not send)",
            note="also refused by `MeshTrainer(...)` on every launched rank, before any rendezvous",
        ),
        Case(
            MESH,
            "mask_protect_dims=2 on the mesh",
            "`RunSettings(...)`, `MeshTrainer(...)` (every rank)",
            run_settings(MeshConfig(preset="paper", mask_protect_dims=2)),
            ValueError,
            "mask_protect_dims=2 is invalid: it must be 0 on the distributed mesh (choosing the dims needs a dense "
            "forward of the whole model)",
            note="also refused by `MeshTrainer(...)`, before any rendezvous",
        ),
        Case(
            MESH,
            "anchor_payload='factors' when resuming a mesh run with the anchor",
            "`RunSettings(...)`, `trainer.train(resume_from_checkpoint=...)` (every rank)",
            run_settings(
                MeshConfig(preset="paper", anchor_payload="factors", spectral_rank=8), resume_from="checkpoint-20"
            ),
            ValueError,
            "anchor_payload='factors' is invalid: it must be 'gradient' to resume a mesh run with the anchor (with "
            "'factors' the anchor replica holds M_anc, and anchor processes write no checkpoint: the resumed run "
            "would not continue exactly)",
        ),
        Case(
            MESH,
            "boundary_codec='governed' without the anchor on the mesh",
            "`RunSettings(...)`, `MeshTrainer(...)` (every rank)",
            run_settings(MeshConfig(boundary_codec="governed", anchor=False)),
            ValueError,
            "anchor=False is invalid: it must be True with boundary_codec='governed' on the distributed mesh (the "
            "governor's fidelity probes run on the anchor replica's pipeline)",
            note="also refused by `MeshTrainer(...)`, before any rendezvous",
        ),
        Case(
            MESH,
            "anchor_cadence='adaptive' on the mesh",
            "`RunSettings(...)`, `MeshTrainer(...)` (every rank)",
            run_settings(MeshConfig(preset="paper", anchor_cadence="adaptive")),
            ValueError,
            "anchor_cadence='adaptive' is invalid: it must be 'fixed' on the distributed mesh (the adaptive cadence "
            "runs on one process)",
            note="also refused by `MeshTrainer(...)`, before any rendezvous",
        ),
        Case(
            MESH,
            "seq_len=0",
            "`RunSettings(...)`",
            run_settings(seq_len=0),
            ValueError,
            "seq_len=0 is invalid: it must be an int >= 1",
        ),
        Case(
            MESH,
            "dp_mode='ddp'",
            "`RunSettings(...)`",
            run_settings(dp_mode="ddp"),
            ValueError,
            "dp_mode='ddp' is invalid: it must be one of ['streaming_diloco', 'allreduce', 'powersgd_hook']",
        ),
        Case(
            MESH,
            "dp_mode='allreduce' with the anchor on",
            "`RunSettings(...)`",
            run_settings(dp_mode="allreduce"),
            ValueError,
            "dp_mode='allreduce' is invalid: it must be 'streaming_diloco' when anchor=True (the anchor "
            "replica follows θ by replaying DiLoCo's outer updates)",
        ),
        Case(
            MESH,
            "GradientSync('streaming_diloco', ...)",
            "`dp.baselines.GradientSync`",
            lambda: GradientSync("streaming_diloco", [nn.Parameter(torch.zeros(2))], None, 2, Wire()),
            ValueError,
            "dp_mode='streaming_diloco' is invalid: it must be one of ['allreduce', 'powersgd_hook'] for a per-step "
            "sync",
        ),
        Case(
            MESH,
            "GradientSync('powersgd_hook', powersgd_rank=0)",
            "`dp.baselines.GradientSync`",
            lambda: GradientSync("powersgd_hook", [nn.Parameter(torch.zeros(2, 2))], None, 2, Wire(), powersgd_rank=0),
            ValueError,
            "dp_powersgd_rank=0 is invalid: it must be an integer >= 1 with dp_mode='powersgd_hook'",
        ),
        Case(
            MESH,
            "MeshTopology(replicas=0, stages=2)",
            "`MeshTopology(...)`",
            lambda: MeshTopology(0, 2),
            ValueError,
            "replicas=0 is invalid: it must be an int >= 1 (X)",
        ),
        Case(
            MESH,
            "MeshTopology(replicas=3, stages=0)",
            "`MeshTopology(...)`",
            lambda: MeshTopology(3, 0),
            ValueError,
            "stages=0 is invalid: it must be an int >= 1 (Y)",
        ),
        Case(
            MESH,
            "MeshTopology(replicas=3, stages=2).rank(3, 0)",
            "`MeshTopology.rank`",
            lambda: MeshTopology(3, 2).rank(3, 0),
            ValueError,
            "replica=3 is invalid: it must lie in [0, 3)",
        ),
        Case(
            MESH,
            "MeshTopology(replicas=3, stages=2).rank(0, 2)",
            "`MeshTopology.rank`",
            lambda: MeshTopology(3, 2).rank(0, 2),
            ValueError,
            "stage=2 is invalid: it must lie in [0, 2)",
        ),
        Case(
            MESH,
            "MeshTopology(replicas=3, stages=2).coords(6)",
            "`MeshTopology.coords`",
            lambda: MeshTopology(3, 2).coords(6),
            ValueError,
            "rank=6 is invalid: it must lie in [0, 6)",
        ),
        Case(
            MESH,
            "build_groups(timeout_s=0)",
            "`MeshTopology.build_groups`",
            lambda: MeshTopology(3, 2).build_groups(timeout_s=0),
            ValueError,
            "timeout_s=0 is invalid: it must be > 0 seconds (or None for the default)",
        ),
        Case(
            MESH,
            "build_groups() without a process group",
            "`MeshTopology.build_groups`",
            groups_without_process_group,
            ValueError,
            "torch.distributed='not initialized' is invalid: it must be initialized before building the mesh's groups",
        ),
        Case(
            MESH,
            "build_groups(dp_peers=True) in a replica job",
            "`MeshTopology.build_groups`",
            dp_peers_in_a_replica_job,
            ValueError,
            "dp_peers=True is invalid: it must be False when every replica is a job of its own (the per-step peers "
            "need one world)",
        ),
        # --- ranks started with different mesh settings --------------------------------------------------
        Case(
            RANKS,
            "a rank given MESHTUNE_MESH=2x2 in a job of 3 processes",
            "`MeshTopology.from_environment` (every rank)",
            from_environment(3, 2, "2x2"),
            ValueError,
            "world_size=3 is invalid: it must equal X·Y = 2·2 = 4 (one process per replica and stage)",
        ),
        Case(
            RANKS,
            "a rank given MESHTUNE_MESH=2x2 in a job of 6 processes",
            "`runtime.job.validate_mesh_job(model, args)`",
            _validate_job_on_other_mesh,
            ValueError,
            "world_size=6 is invalid: it must equal X·Y = 2·2 = 4 (one process per replica and stage)",
        ),
        Case(
            RANKS,
            "a rank started with --num_stages 4 under MESHTUNE_MESH=3x2",
            "`MeshTrainer(...)` on a launched rank",
            mesh_trainer_in(6, "3x2", num_stages=4),
            ValueError,
            "num_stages=4 is invalid: it must equal Y = 2 of the mesh 3x2 "
            "(one pipeline stage per process of a replica)",
        ),
        Case(
            RANKS,
            "a rank started with --num_stages 4 in a job of 6 (no MESHTUNE_MESH; the others use 2)",
            "`MeshTopology.from_environment` (every rank)",
            from_environment(6, 4, None),
            ValueError,
            "num_stages=4 is invalid: it must divide the world size 6 (X = world size / Y replicas of Y stages)",
        ),
        Case(
            RANKS,
            "rank 1 started with mask_ratio=0.95, the others with 0.9",
            "`runtime.bootstrap.run_worker` (every rank)",
            _ranks_with_different_knobs,
            ValueError,
            "config.mask_ratio (rank 1)=0.95 is invalid: it must equal rank 0's 0.9: every process of the mesh runs "
            "with the same settings (check that rank's command line and environment)",
        ),
        Case(
            RANKS,
            "MESHTUNE_REPLICA=1 without MESHTUNE_MESH",
            "`MeshTopology.from_environment` (every rank)",
            replica_job(2, 2, None, "1"),
            ValueError,
            "MESHTUNE_MESH=None is invalid: it must be set (XxY) when MESHTUNE_REPLICA is: a replica job needs the "
            "whole mesh's shape",
        ),
        Case(
            RANKS,
            "MESHTUNE_REPLICA=one",
            "`MeshTopology.from_environment` (every rank)",
            replica_job(2, 2, "3x2", "one"),
            ValueError,
            "MESHTUNE_REPLICA='one' is invalid: it must be a replica index (an integer >= 0)",
        ),
        Case(
            RANKS,
            "MESHTUNE_REPLICA=3 in a 3x2 mesh",
            "`MeshTopology.from_environment` (every rank)",
            replica_job(2, 2, "3x2", "3"),
            ValueError,
            "MESHTUNE_REPLICA=3 is invalid: it must lie in [0, 3) (a replica of the 3x2 mesh)",
        ),
        Case(
            RANKS,
            "a replica job of 3 processes under MESHTUNE_MESH=3x2",
            "`MeshTopology.from_environment` (every rank)",
            replica_job(3, 2, "3x2", "0"),
            ValueError,
            "world_size=3 is invalid: it must equal Y = 2 in a replica job (one process per stage of replica 0)",
        ),
        Case(
            RANKS,
            "`anchor_lockstep=True` with the anchor on in a replica job (`meshtune launch --max-restarts`)",
            "`runtime.bootstrap.run_worker` (every rank)",
            _fixed_link_knob_in_anchor_replica_job(anchor_lockstep=True),
            ValueError,
            "anchor_lockstep=True is invalid: it must be off when every replica is a job of its own with the anchor "
            "on (replica restarts: a fast step cannot wait for an anchor that is restarting)",
        ),
        Case(
            RANKS,
            "`codec_refit_every` with the anchor on in a replica job",
            "`runtime.bootstrap.run_worker` (every rank)",
            _fixed_link_knob_in_anchor_replica_job(boundary_codec="outliers8+int4g71", codec_refit_every=2),
            ValueError,
            "codec_refit_every=2 is invalid: it must be off when every replica is a job of its own with the anchor "
            "on (replica restarts: the anchor's refitted geometry goes to two stages at once, over links that do not "
            "restart)",
        ),
        Case(
            RANKS,
            "`boundary_codec='governed'` with the anchor on in a replica job",
            "`runtime.bootstrap.run_worker` (every rank)",
            _fixed_link_knob_in_anchor_replica_job(boundary_codec="governed", mask_ratio=0.0),
            ValueError,
            "boundary_codec='governed' is invalid: it must be off when every replica is a job of its own with the "
            "anchor on (replica restarts: the governor's levels travel over links that do not restart; pick a fixed "
            "codec)",
        ),
        Case(
            RANKS,
            "dp_mode='allreduce' in a replica job",
            "`runtime.bootstrap.run_worker` (every rank)",
            _allreduce_in_replica_job,
            ValueError,
            "dp_mode='allreduce' is invalid: it must be 'streaming_diloco' when every replica is a job of its own "
            "(the per-step peers need one world)",
        ),
        Case(
            RANKS,
            "dp_mode='allreduce' with groups built without dp_peers",
            "`runtime.bootstrap.run_worker` (every rank)",
            _allreduce_without_peer_groups,
            ValueError,
            "dp_peer_group=None is invalid: it must be built (MeshTopology.build_groups(dp_peers=True)) for "
            "dp_mode='allreduce'",
        ),
        Case(
            RANKS,
            "a replica job without TORCHFT_LIGHTHOUSE",
            "`MeshTrainer(...).train()` (every rank)",
            _replica_job_without_lighthouse,
            ValueError,
            "TORCHFT_LIGHTHOUSE=None is invalid: it must be set when every replica is a job of its own (the replicas "
            "meet only at a shared lighthouse; `meshtune launch` starts one)",
        ),
        Case(
            RANKS,
            "MESHTUNE_JOB_STORE=nowhere",
            "`runtime.bootstrap.run_worker` (every rank of a replica job)",
            _job_store_without_port,
            ValueError,
            "MESHTUNE_JOB_STORE='nowhere' is invalid: it must be host:port of the launcher's TCPStore",
        ),
        Case(
            RANKS,
            "MESHTUNE_HOST=no-such-host.invalid",
            "`comm.listen.listen_address` (every server a mesh process or the launcher starts)",
            _unresolvable_host,
            ValueError,
            "MESHTUNE_HOST='no-such-host.invalid' is invalid: it must resolve to an address of this machine for the "
            "mesh's servers to listen on",
        ),
        Case(
            RANKS,
            "MESHTUNE_DP_HOST=192.0.2.7 (not an address of this machine)",
            "`comm.listen.dp_gloo_device` (the DiLoCo sync's process group of every fast process)",
            _foreign_dp_host,
            ValueError,
            "MESHTUNE_DP_HOST='192.0.2.7' is invalid: it must be an address of this machine (it resolves to "
            "192.0.2.7, which cannot be bound here: Cannot assign requested address; the DiLoCo sync's gloo pairs "
            "bind to it)",
        ),
        Case(
            RANKS,
            "MESHTUNE_DP_HOST=no-such-host.invalid",
            "`comm.listen.dp_gloo_device` (the DiLoCo sync's process group of every fast process)",
            lambda: _foreign_dp_host("no-such-host.invalid"),
            ValueError,
            "MESHTUNE_DP_HOST='no-such-host.invalid' is invalid: it must resolve to an address of this machine for "
            "the mesh's servers to listen on",
        ),
        Case(
            RANKS,
            "MESHTUNE_SECRET_FILE and MESHTUNE_SECRET both set",
            "`meshtune launch` and every process of a mesh launched with a secret (`comm.gate.secret_key`)",
            lambda tmp: _secret_in(tmp, "s" * 32, MESHTUNE_SECRET="s" * 32),
            ValueError,
            f"MESHTUNE_SECRET_FILE='{TMP}/secret' is invalid: it must be unset when MESHTUNE_SECRET is set (one "
            "secret, one source)",
        ),
        Case(
            RANKS,
            "MESHTUNE_SECRET_FILE naming no file",
            "`meshtune launch` and every process of a mesh launched with a secret (`comm.gate.secret_key`)",
            lambda tmp: _secret_in(tmp, None),
            ValueError,
            f"MESHTUNE_SECRET_FILE='{TMP}/secret' is invalid: it must name a readable file holding the mesh's secret "
            "(No such file or directory)",
        ),
        Case(
            RANKS,
            "MESHTUNE_SECRET_FILE holding 5 bytes",
            "`meshtune launch` and every process of a mesh launched with a secret (`comm.gate.secret_key`)",
            lambda tmp: _secret_in(tmp, "short\n"),
            ValueError,
            f"MESHTUNE_SECRET_FILE='{TMP}/secret' is invalid: it must hold a secret of at least 16 bytes (it holds 5)",
        ),
        Case(
            RANKS,
            "MESHTUNE_SECRET without MESHTUNE_GATE (e.g. under torchrun)",
            "`MeshTrainingArguments(...)` in a launched process (`comm.gate.guard_launched_process`)",
            lambda: _guarded_process(MESHTUNE_SECRET="s" * 32),
            ValueError,
            "MESHTUNE_GATE=None is invalid: it must be set when MESHTUNE_SECRET or MESHTUNE_SECRET_FILE is: a secret "
            "needs `meshtune launch`, whose gate admits the mesh's processes (torchrun's own rendezvous store cannot "
            "be guarded)",
        ),
        Case(
            RANKS,
            "MESHTUNE_GATE set, no secret",
            "`MeshTrainingArguments(...)` in a launched process (`comm.gate.guard_launched_process`)",
            lambda: _guarded_process(MESHTUNE_GATE="127.0.0.1:1"),
            ValueError,
            "MESHTUNE_SECRET=None is invalid: it must be set (or MESHTUNE_SECRET_FILE) in every process of a mesh "
            "with a gate (MESHTUNE_GATE=127.0.0.1:1): the mesh admits only processes holding its secret",
        ),
        # --- model types ---------------------------------------------------------------------------------
        Case(
            MODELS,
            "a module without a decoder-layer list",
            "`attach_boundaries(model, Y)`",
            lambda: attach_boundaries(TwoLayerMLP(), 2),
            ValueError,
            f"model=TwoLayerMLP {_NO_DECODER}",
        ),
        Case(
            MODELS,
            "num_stages=5 on a 4-layer model",
            "`MeshTrainer(...)`",
            lambda tmp: mesh_trainer(tmp, num_stages=5),
            ValueError,
            "num_stages=5 is invalid: it must be <= the number of decoder layers (4)",
        ),
        Case(
            MODELS,
            "mask_ratio=0.995 on H = 64 (K = 0)",
            "`MeshTrainer(...)`",
            lambda tmp: mesh_trainer(tmp, mask_ratio=0.995),
            ValueError,
            "mask_ratio=0.995 is invalid: it must keep at least one of hidden_size=64 dims per token "
            "(K = round((1-p)·H) = 0)",
        ),
        Case(
            MODELS,
            "mask_protect_dims=40 with K = 32 (p = 0.5, H = 64)",
            "`MeshTrainer(...).train()`",
            protect_dims_at_train,
            ValueError,
            "mask_protect_dims=40 is invalid: it must be < K=32, the dims kept per token",
        ),
        Case(
            MODELS,
            "stage_layers=[2, 1] for a 4-layer model",
            "`MeshTrainer(model, args)`",
            lambda tmp: mesh_trainer(tmp, stage_layers=[2, 1]),
            ValueError,
            "stage_layers=[2, 1] is invalid: it must sum to the model's 4 decoder layers (they sum to 3)",
        ),
        Case(
            MODELS,
            "a multimodal model (LlavaForConditionalGeneration)",
            "`attach_boundaries(model, Y)`",
            lambda: attach_boundaries(tiny_llava(), 2),
            ValueError,
            "config.hidden_size=None is invalid: it must be a positive int",
            note="weak spot: the text model's H is in config.text_config, and the layer search finds the vision "
            "tower's encoder layers first",
        ),
        Case(
            MODELS,
            "GPT-2 on the distributed mesh",
            "`MeshTrainer(...).train()` on a launched rank",
            mesh_train_in(4, "2x2", lambda: make_tiny_causal_lm("gpt2")),
            ValueError,
            f"model.config.model_type='gpt2' is invalid: it must {_PIPELINE}",
        ),
        Case(
            MODELS,
            "Gemma 3 with use_bidirectional_attention=True on the distributed mesh",
            "`MeshTrainer(...).train()` on a launched rank",
            mesh_train_in(4, "2x2", bidirectional_gemma3),
            ValueError,
            "model.config.use_bidirectional_attention=True is invalid: it must be False in the distributed pipeline "
            "(its stages build causal masks only)",
        ),
        Case(
            MODELS,
            "a bare LlamaModel (no LM head) on the distributed mesh",
            "`MeshTrainer(...).train()` on a launched rank",
            mesh_train_in(4, "2x2", llama_without_head),
            ValueError,
            "model.get_output_embeddings()=None is invalid: it must be an LM head (load the model with "
            "AutoModelForCausalLM, not its bare base model)",
        ),
        # --- meshtune CLI --------------------------------------------------------------------------------
        _cli(
            "meshtune ledger --memory --mesh 2x2 --stage-layers 10,a",
            "meshtune ledger: error: --stage-layers='10,a' is invalid: it must be comma-separated decoder-layer "
            "counts, one per stage (e.g. 20,10)",
        ),
        _cli(
            "meshtune ledger --memory --mesh 2x2 --stage-layers 10,5",
            "meshtune ledger: error: --stage-layers=[10, 5] is invalid: it must sum to the model's 16 decoder layers "
            "(they sum to 15)",
        ),
        _cli(
            "meshtune ledger --mesh 8by4",
            "meshtune ledger: error: --mesh='8by4' is invalid: it must be XxY with X >= 1 replicas and Y >= 1 stages, "
            "e.g. 8x4",
        ),
        _cli(
            "meshtune ledger --mesh 0x4",
            "meshtune ledger: error: --mesh='0x4' is invalid: it must be XxY with X >= 1 replicas and Y >= 1 stages, "
            "e.g. 8x4",
        ),
        _cli(
            "meshtune ledger --mesh 1x4",
            "meshtune ledger: error: num_replicas=1 is invalid: it must be >= 2 when anchor=True (replica X-1 is the "
            "anchor)",
        ),
        _cli(
            "meshtune ledger --preset gpt-5",
            "meshtune ledger: error: --preset='gpt-5' is invalid: it must be one of ['llama-3.2-1b', 'smollm2-135m']",
        ),
        _cli(
            "meshtune ledger --config <tmp>/missing.json",
            f"meshtune ledger: error: --config='{TMP}/missing.json' is invalid: it must be an existing config.json "
            "file or model directory",
            cli_in("ledger", "--config", f"{TMP}/missing.json"),
        ),
        _cli(
            "meshtune ledger --dtype int8",
            f"meshtune ledger: error: activation_dtype='int8' is invalid: it must be one of {_DTYPES}",
        ),
        _cli(
            "meshtune ledger --seq-len 0", "meshtune ledger: error: --seq-len=0 is invalid: it must be an integer >= 1"
        ),
        _cli(
            "meshtune ledger --seq-len abc",
            "meshtune ledger: error: argument --seq-len: invalid int value: 'abc'",
            note="argparse's own check",
        ),
        _cli(
            "meshtune ledger --batch-size 0",
            "meshtune ledger: error: global_batch=0 is invalid: it must be an integer >= 1",
        ),
        _cli(
            "meshtune ledger --sync-every 0",
            "meshtune ledger: error: --sync-every=0 is invalid: it must be an integer >= 1",
        ),
        _cli(
            "meshtune ledger --memory --lora-r 0",
            "meshtune ledger: error: --lora-r=0 is invalid: it must be an integer >= 1",
        ),
        _cli(
            "meshtune ledger --memory --lora-r 4 --lora-target-modules ,",
            "meshtune ledger: error: --lora-target-modules=',' is invalid: it must name at least one module, or "
            "all-linear",
        ),
        _cli(
            "meshtune ledger --powersgd-rank 0",
            "meshtune ledger: error: --powersgd-rank=0 is invalid: it must be None or an integer >= 1",
        ),
        _cli(
            "meshtune ledger --anchor-every 0",
            "meshtune ledger: error: --anchor-every=0 is invalid: it must be an integer >= 1",
        ),
        _cli(
            "meshtune ledger --anchor-payload svd",
            "meshtune ledger: error: --anchor-payload='svd' is invalid: it must be one of ['gradient', 'factors']",
        ),
        _cli(
            "meshtune ledger --dp-quantize int4",
            "meshtune ledger: error: --dp-quantize='int4' is invalid: it must be None or one of ['int8']",
        ),
        _cli(
            "meshtune ledger --anchor-rank 0",
            "meshtune ledger: error: --anchor-rank=0 is invalid: it must be an integer >= 1",
        ),
        _cli(
            "meshtune ledger --boundary-codec mask0.9",
            "meshtune ledger: error: --boundary-codec='mask0.9' is invalid: it must be a composed codec (a mask is "
            "mask_ratio)",
        ),
        _cli(
            "meshtune ledger --boundary-codec outliers8+int4g71 (H = 2048)",
            "meshtune ledger: error: --boundary-codec='outliers8+int4g71' is invalid: it must use a group size that "
            "divides the 2040 coded values per token (g71 does not; H=2048, outliers=8, rank=None)",
            cli("ledger", "--boundary-codec", "outliers8+int4g71"),
        ),
        _cli(
            "meshtune ledger --rows M99", f"meshtune ledger: error: --rows='M99' is invalid: it must be one of {_ROWS}"
        ),
        _cli(
            "meshtune ledger --rows ,",
            f"meshtune ledger: error: --rows=',' is invalid: it must name at least one of {_ROWS}",
        ),
        _cli(
            "meshtune ledger --config <tmp> (a folder without config.json)",
            f"meshtune ledger: error: Unrecognized model in {TMP}. Should have a `model_type` key in its config.json.",
            cli_in("ledger", "--config", TMP),
            note="transformers' message (exit code 2 all the same)",
        ),
        Case(
            CLI,
            "meshtune ledger --config <tmp>/config.json (holding '{nope')",
            "`meshtune ledger`",
            _ledger_on_bad_json,
            CliExit,
            f"exit 2: meshtune ledger: error: --config='{TMP}/config.json' is invalid: it must be a readable "
            f"transformers config (It looks like the config file at '{TMP}/config.json' is not a valid JSON file.)",
        ),
        _cli(
            "meshtune ledger --mesh 8x40 (Llama-3.2-1B has 16 layers)",
            "meshtune ledger: error: --mesh='8x40' is invalid: it must have Y <= the model's 16 decoder layers (each "
            "stage holds at least one)",
            cli("ledger", "--mesh", "8x40"),
        ),
        _cli(
            "meshtune launch --mesh 3by2 -- train.py",
            "meshtune launch: error: --mesh='3by2' is invalid: it must be XxY with X >= 1 replicas and Y >= 1 stages, "
            "e.g. 8x4",
        ),
        _cli(
            "meshtune launch -- train.py",
            "meshtune launch: error: --mesh=None is invalid: it must be given (--mesh XxY), or --hosts FILE with "
            "--this-host NAME",
        ),
        _cli(
            "meshtune launch --mesh 3x2",
            "meshtune launch: error: script='' is invalid: it must be given after `--`: a "
            "Python file or `-m module`, followed by its arguments",
        ),
        _cli(
            "meshtune launch --mesh 3x2 -- <tmp>/missing.py",
            f"meshtune launch: error: script='{TMP}/missing.py' is invalid: it must be an existing Python file",
            cli_in("launch", "--mesh", "3x2", "--", f"{TMP}/missing.py"),
        ),
        _cli(
            "meshtune launch --mesh 3x2 -- -c 'print(1)'",
            "meshtune launch: error: script='-c' is invalid: it must be a "
            "Python file or `-m module` (other interpreter flags are not supported)",
            cli("launch", "--mesh", "3x2", "--", "-c", "print(1)"),
        ),
        _cli(
            "meshtune launch --mesh 3x2 -- -m",
            "meshtune launch: error: script='-m' is invalid: it must name a module after -m, e.g. `-m recipes.sft`",
        ),
        _cli(
            "meshtune launch --mesh 3x2 --master-port 70000 -- <tmp>/train.py",
            "meshtune launch: error: --master-port=70000 is invalid: it must be an integer in [1, 65535]",
            lambda tmp: _launch_script(tmp, "--master-port", "70000"),
        ),
        _cli(
            "meshtune launch --mesh 3x2 --lighthouse nowhere -- <tmp>/train.py",
            "meshtune launch: error: --lighthouse='nowhere' is invalid: it must be host:port or http://host:port of a "
            "running torchft lighthouse",
            lambda tmp: _launch_script(tmp, "--lighthouse", "nowhere"),
        ),
        _cli(
            "meshtune launch --mesh 3x2 -- <tmp>/train.py (MESHTUNE_SECRET=short)",
            "meshtune launch: error: MESHTUNE_SECRET='<hidden>' is invalid: it must be at least 16 bytes long (it is "
            "5), e.g. `openssl rand -hex 32`",
            lambda tmp: _launch_with_secret(tmp, "short"),
        ),
        _cli(
            "meshtune launch --mesh 3x2 --lighthouse 127.0.0.1:1 -- <tmp>/train.py (a MESHTUNE_SECRET set)",
            "meshtune launch: error: --lighthouse='127.0.0.1:1' is invalid: it must be unset when MESHTUNE_SECRET "
            "is: with a secret the launcher starts and guards its own lighthouse (another one would accept anyone)",
            lambda tmp: _launch_with_secret(tmp, "s" * 32, "--lighthouse", "127.0.0.1:1"),
        ),
        _cli(
            "meshtune launch --mesh 3x2 --max-restarts -1 -- <tmp>/train.py",
            "meshtune launch: error: --max-restarts=-1 is invalid: it must be an integer >= 0 (restarts per replica)",
            lambda tmp: _launch_script(tmp, "--max-restarts", "-1"),
        ),
        _cli(
            "meshtune launch --mesh 3x2 --max-restarts 1 --master-port 2900 -- <tmp>/train.py",
            "meshtune launch: error: --master-port=2900 is invalid: it must be unset with max_restarts > 0 (every "
            "replica, and every restart of one, gets a free port of its own)",
            lambda tmp: _launch_script(tmp, "--max-restarts", "1", "--master-port", "2900"),
        ),
        _cli(
            "meshtune launch --mesh 3x2 --optional-replica 3 -- <tmp>/train.py",
            "meshtune launch: error: --optional-replica=[3] is invalid: "
            "it must name replicas in [0, 3) of the 3x2 mesh",
            lambda tmp: _launch_script(tmp, "--optional-replica", "3"),
        ),
        Case(
            CLI,
            "launch_mesh((0, 2), ['train.py'], cpu=True)",
            "`hf_meshtune.launch.launch_mesh`",
            _launch_mesh_without_replicas,
            ValueError,
            "mesh=(0, 2) is invalid: it must be a pair (X, Y) of integers >= 1 (X replicas, Y stages)",
        ),
        _cli(
            "meshtune report <tmp>/missing",
            f"meshtune report: error: run_dir='{TMP}/missing' is invalid: it must be an existing folder",
            cli_in("report", f"{TMP}/missing"),
        ),
        _cli(
            "meshtune report <tmp> (no run inside)",
            f"meshtune report: error: run_dir='{TMP}' is invalid: it must {_RUN_RULE}",
            cli_in("report", TMP),
        ),
        _cli(
            "meshtune report <tmp> --out <tmp>/run/trainer_state.json",
            f"meshtune report: error: out_dir='{TMP}/run/trainer_state.json' is invalid: it must be a folder (or not "
            "exist yet)",
            lambda tmp: _report_on(tmp, "{}", "--out", f"{tmp}/run/trainer_state.json"),
        ),
        _cli(
            "meshtune report <tmp> (trainer_state.json = '{')",
            f"meshtune report: error: file='{TMP}/run/trainer_state.json' is invalid: it must hold valid JSON "
            "(Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
            lambda tmp: _report_on(tmp, "{"),
        ),
        _cli(
            "meshtune report <tmp> (trainer_state.json = '[]')",
            f"meshtune report: error: file='{TMP}/run/trainer_state.json' is invalid: it must hold a JSON object",
            lambda tmp: _report_on(tmp, "[]"),
        ),
        _cli(
            "meshtune report <tmp> (log_history = 3)",
            f"meshtune report: error: file='{TMP}/run/trainer_state.json' is invalid: it must hold a log_history list "
            "of log dicts, as Trainer.save_state() writes it",
            lambda tmp: _report_on(tmp, '{"log_history": 3}'),
        ),
        _cli(
            "meshtune report <tmp> (checkpoint-4/trainer_state.json truncated)",
            f"meshtune report: error: file='{TMP}/run/checkpoint-4/trainer_state.json' is invalid: it must hold valid "
            "JSON (Unterminated string starting at: line 1 column 2 (char 1))",
            lambda tmp: _report_on(tmp, '{"log_hist', file="checkpoint-4/trainer_state.json"),
        ),
        _cli("meshtune demo --max-steps 0", "meshtune demo: error: --max-steps=0 is invalid: it must be >= 1"),
        _cli("meshtune demo --batch-size 0", "meshtune demo: error: --batch-size=0 is invalid: it must be >= 1"),
        _cli("meshtune demo --seq-len 0", "meshtune demo: error: --seq-len=0 is invalid: it must be >= 1"),
        _cli(
            "meshtune demo --train-last-layers 0",
            "meshtune demo: error: --train-last-layers=0 is invalid: it must be >= 1",
        ),
        _cli("meshtune demo --eval-items 0", "meshtune demo: error: --eval-items=0 is invalid: it must be >= 1"),
        _cli(
            "meshtune demo --mask-ratio 1.0",
            "meshtune demo: error: --mask-ratio=1.0 is invalid: it must lie in [0, 1)",
            note="every mesh knob is checked before the model loads",
        ),
        _cli(
            "meshtune demo --spectral-rank -1",
            "meshtune demo: error: --spectral-rank=-1 is invalid: it must be >= 0 (0 = full rank)",
        ),
        Case(
            CLI,
            "meshtune demo --seq-len 1 (no answer token left)",
            "`hf_meshtune.apps.demo.gsm8k_splits` (after the model loads)",
            _gsm8k_splits_of_one_token,
            ValueError,
            "seq_len=1 is invalid: it must leave answer tokens in more than eval_items=32 GSM8K examples",
        ),
        # --- checkpoints and resume ----------------------------------------------------------------------
        Case(
            CHECKPOINTS,
            "resume with mask_ratio=0.75 (saved with 0.5)",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            lambda tmp: resume(tmp, saved_checkpoint(), mask_ratio=0.75),
            ValueError,
            f"mask_ratio=0.75 is invalid: it must equal the checkpoint's value 0.5 {_RESUME}",
        ),
        Case(
            CHECKPOINTS,
            "resume with num_stages=4 (saved with 2)",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            lambda tmp: resume(tmp, saved_checkpoint(), num_stages=4),
            ValueError,
            f"num_stages=4 is invalid: it must equal the checkpoint's value 2 {_RESUME}",
        ),
        Case(
            CHECKPOINTS,
            "resume with anchor_every=2 (saved with 1)",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            lambda tmp: resume(tmp, saved_checkpoint(), anchor_every=2),
            ValueError,
            f"anchor_every=2 is invalid: it must equal the checkpoint's value 1 {_RESUME}",
        ),
        Case(
            CHECKPOINTS,
            "a checkpoint without mesh_state.pt (e.g. a plain Trainer's)",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            resume_with_mesh_state,
            ValueError,
            f"resume_from_checkpoint='{TMP}/checkpoint-2' is invalid: it must contain mesh_state.pt (written by a Mesh "
            "trainer) to resume a mesh run exactly",
        ),
        Case(
            CHECKPOINTS,
            "mesh_state.pt cut to half its size",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            truncated_mesh_state,
            ValueError,
            f"mesh_state.pt='{TMP}/checkpoint-2/mesh_state.pt' is invalid: it must be a readable file written by a "
            "Mesh trainer (RuntimeError: PytorchStreamReader failed reading zip archive",
            prefix=True,
        ),
        Case(
            CHECKPOINTS,
            "mesh_state.pt empty (0 bytes)",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            lambda tmp: resume_with_mesh_state(tmp, content=b""),
            ValueError,
            f"mesh_state.pt='{TMP}/checkpoint-2/mesh_state.pt' is invalid: it must be a readable file written by a "
            "Mesh trainer (EOFError: no message: the file is empty or cut short)",
        ),
        Case(
            CHECKPOINTS,
            "mesh_state.pt holding text, not a torch file",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            lambda tmp: resume_with_mesh_state(tmp, content=b"not a torch file\n"),
            ValueError,
            f"mesh_state.pt='{TMP}/checkpoint-2/mesh_state.pt' is invalid: it must be a readable file written by a "
            "Mesh trainer (UnpicklingError: Weights only load failed.",
            prefix=True,
        ),
        Case(
            CHECKPOINTS,
            "mesh_state.pt = torch.save({})",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            lambda tmp: resume_with_mesh_state(tmp, obj={"not": "a mesh state"}),
            ValueError,
            f"mesh_state.pt='{TMP}/checkpoint-2/mesh_state.pt' is invalid: it must hold a dict with keys "
            "['anchor', 'boundaries', 'config'] as a Mesh trainer writes it",
        ),
        Case(
            CHECKPOINTS,
            "resume with other trainable matrices (q_proj frozen instead of o_proj)",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            lambda tmp: resume(tmp, saved_checkpoint(), frozen(tiny_llama(), Q_PROJ)),
            ValueError,
            "anchor state=['model.layers.0.self_attn.q_proj.weight'] is invalid: it must only name parameters of this "
            "model's spectral matrices",
        ),
        Case(
            CHECKPOINTS,
            "resume a H = 32 model from a H = 64 checkpoint",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            lambda tmp: resume(tmp, saved_checkpoint(), tiny_llama(hidden=32)),
            RuntimeError,
            "Error(s) in loading state_dict for LlamaForCausalLM:\n\tsize mismatch for model.embed_tokens.weight: "
            "copying a param with shape torch.Size([100, 64]) from checkpoint, the shape in current model is "
            "torch.Size([100, 32]).",
            prefix=True,
            note="transformers' own check",
        ),
        Case(
            CHECKPOINTS,
            "resume_from_checkpoint='<tmp>/nowhere'",
            "`MeshTrainer.train(resume_from_checkpoint=...)`",
            lambda tmp: resume(tmp, tmp / "nowhere"),
            ValueError,
            f"Can't find a valid checkpoint at {TMP}/nowhere",
            note="transformers' own check",
        ),
        Case(
            CHECKPOINTS,
            "resume_from_checkpoint=True with no checkpoint in output_dir",
            "`MeshTrainer.train(resume_from_checkpoint=True)`",
            lambda tmp: resume(tmp, True),
            ValueError,
            f"No valid checkpoint found in output directory ({TMP}/out)",
            note="transformers' own check",
        ),
        Case(
            CHECKPOINTS,
            "resume_from_checkpoint on the distributed mesh (WORLD_SIZE=4, MESHTUNE_MESH=2x2)",
            "`MeshTrainer.train(resume_from_checkpoint=...)` on a launched rank",
            mesh_train_in(4, "2x2", resume_from="checkpoint-2"),
            ValueError,
            "resume_from_checkpoint='checkpoint-2' is invalid: it must be a mesh checkpoint folder (checkpoint-N "
            "holding mesh/rank<r>.pt, written by a distributed mesh run)",
        ),
        Case(
            CHECKPOINTS,
            "resume_from_checkpoint=True on the mesh with no mesh checkpoint in output_dir",
            "`MeshTrainer.train(resume_from_checkpoint=True)` on a launched rank",
            mesh_train_in(4, "2x2", resume_from=True),
            ValueError,
            f"resume_from_checkpoint=True is invalid: it must find a complete mesh checkpoint (checkpoint-N/mesh/) in "
            f"output_dir='{TMP}/out' (there is none)",
        ),
        Case(
            CHECKPOINTS,
            "a mesh checkpoint whose rank 2 never finished its save",
            "`MeshTrainer.train(resume_from_checkpoint=...)` on a launched rank (every rank)",
            _incomplete_mesh_checkpoint,
            ValueError,
            f"resume_from_checkpoint='{TMP}/checkpoint-8' is invalid: it must hold the state of every fast rank "
            "(missing mesh/rank{r}.pt for r in [2]: a save that did not complete; resume from an older checkpoint)",
        ),
        Case(
            CHECKPOINTS,
            "a 3x2 mesh checkpoint resumed on a 2x2 mesh",
            "`runtime.bootstrap.run_worker` (every rank, resuming)",
            _checkpoint_of_another_mesh,
            ValueError,
            "mesh='2x2' is invalid: it must equal the checkpoint's mesh 3x2 (anchor=True) to resume from "
            f"{TMP}/checkpoint-4",
        ),
        Case(
            CHECKPOINTS,
            "a damaged rank file in a mesh checkpoint",
            "`runtime.bootstrap.run_worker` (every rank, resuming)",
            _damaged_rank_file,
            ValueError,
            f"mesh checkpoint file='{TMP}/checkpoint-4/mesh/rank0.pt' is invalid: it must be a readable file written "
            "by a mesh process (",
            prefix=True,
            note="the rest is torch's own message",
        ),
        Case(
            CHECKPOINTS,
            "a mesh checkpoint resumed with mask_ratio=0.5 (saved with 0.9)",
            "`runtime.bootstrap.run_worker` (every rank, resuming)",
            _mesh_resume_with_changed_knob,
            ValueError,
            "mask_ratio=0.5 is invalid: it must equal the checkpoint's value 0.9 to resume from checkpoint-4 (start a "
            "new run to change it)",
        ),
        Case(
            CHECKPOINTS,
            "save_strategy='epoch' on the distributed mesh",
            "`MeshTrainer.train()` on a launched rank",
            mesh_train_in(4, "2x2", save_strategy="epoch"),
            ValueError,
            "save_strategy='epoch' is invalid: it must be 'no' or 'steps' on the distributed mesh (it counts fast "
            "steps, not epochs or evaluations)",
        ),
        Case(
            CHECKPOINTS,
            "checkpoint_every=3 with dp_sync_every=4, dp_fragments=2",
            "`RunSettings(...)` (every rank)",
            run_settings(MeshConfig(dp_sync_every=4, dp_fragments=2), checkpoint_dir=".", checkpoint_every=3),
            ValueError,
            "checkpoint_every=3 is invalid: it must be a multiple of dp_sync_every / dp_fragments = 2 (a checkpoint is "
            "taken between DiLoCo syncs)",
        ),
        Case(
            CHECKPOINTS,
            "checkpoint_every=4 without checkpoint_dir",
            "`RunSettings(...)` (every rank)",
            run_settings(checkpoint_every=4),
            ValueError,
            "checkpoint_dir=None is invalid: it must be set when checkpoint_every is (the folder the checkpoint-N "
            "folders go to)",
        ),
        Case(
            CHECKPOINTS,
            "mesh checkpoints with dp_mode='powersgd_hook'",
            "`RunSettings(...)` (every rank)",
            run_settings(MeshConfig(anchor=False), dp_mode="powersgd_hook", checkpoint_dir=".", checkpoint_every=20),
            ValueError,
            "dp_mode='powersgd_hook' is invalid: it must be 'streaming_diloco' or 'allreduce' with mesh "
            "checkpoints (torch's PowerSGD hook state is not saved)",
        ),
        Case(
            CHECKPOINTS,
            "load_state with mask_ratio=0.75 (saved with 0.5)",
            "`MeshAccelerator.load_state`",
            accelerate_resume_with_changed_knob,
            ValueError,
            f"mask_ratio=0.75 is invalid: it must equal the checkpoint's value 0.5 {_RESUME}",
        ),
        # --- TRL -----------------------------------------------------------------------------------------
        Case(
            TRL,
            "trl.SFTConfig(optim='spectral_adamw')",
            "`trl.SFTConfig(...)`",
            lambda tmp: trl_config("SFTConfig", tmp, optim="spectral_adamw"),
            ValueError,
            "spectral_adamw is not a valid OptimizerNames, please select one of",
            prefix=True,
            note="transformers' own check: TRL's config does not know the Mesh optimizer (use MeshSFTConfig)",
        ),
        Case(
            TRL,
            "MeshSFTTrainer(args=trl.SFTConfig(...))",
            "`MeshSFTTrainer(...)`",
            sft_trainer_with_trl_config,
            ValueError,
            "args='SFTConfig' is invalid: it must be a MeshSFTConfig for MeshSFTTrainer (its mesh knobs and "
            "optim='spectral_adamw' live there; TRL's own config does not accept optim='spectral_adamw')",
        ),
        Case(
            TRL,
            "MeshGRPOTrainer(args=trl.GRPOConfig(...))",
            "`MeshGRPOTrainer(...)`",
            grpo_trainer_with_trl_config,
            ValueError,
            "args='GRPOConfig' is invalid: it must be a MeshGRPOConfig for MeshGRPOTrainer (its mesh knobs and "
            "optim='spectral_adamw' live there; TRL's own config does not accept optim='spectral_adamw')",
        ),
        Case(
            TRL,
            "MeshSFTConfig(mask_ratio=1.0)",
            "`MeshSFTConfig(...)`",
            mesh_config_of("MeshSFTConfig", mask_ratio=1.0),
            ValueError,
            "mask_ratio=1.0 is invalid: it must lie in [0, 1)",
        ),
        Case(
            TRL,
            "MeshGRPOConfig(optim='adamw_torch', anchor=True)",
            "`MeshGRPOConfig(...)`",
            mesh_config_of("MeshGRPOConfig", optim="adamw_torch", anchor=True),
            ValueError,
            f"optim={_ADAMW_ENUM} is invalid: it must be 'spectral_adamw' when anchor=True (the anchor's gradients "
            "feed its spectral filter); set anchor=False for another optimizer",
        ),
        Case(
            TRL,
            "MeshGRPOConfig(anchor_microbatches=1, num_generations=8) on a launched 3x2 mesh",
            "`MeshGRPOConfig(...)` on a launched rank",
            grpo_config_on_mesh(
                "MeshGRPOConfig",
                anchor=True,
                per_device_train_batch_size=4,
                gradient_accumulation_steps=2,
                anchor_microbatches=1,
                num_generations=8,
            ),
            ValueError,
            "num_generations=8 is invalid: it must divide per_device_train_batch_size · anchor_microbatches = 4 on the "
            "distributed mesh (each replica's step generates whole groups of completions for its own prompts)",
            note="the fast replicas' rows (per_device_train_batch_size · gradient_accumulation_steps) are checked the "
            "same way; on one process TRL's own check of the generation batch refuses them first",
        ),
        Case(
            TRL,
            "MeshGRPOConfig(beta=0.04, sync_ref_model=True) on a launched 3x2 mesh",
            "`MeshGRPOConfig(...)` on a launched rank",
            grpo_config_on_mesh("MeshGRPOConfig", beta=0.04, sync_ref_model=True),
            ValueError,
            "sync_ref_model=True is invalid: it must be False on the distributed mesh (each stage keeps its own "
            "layers of the reference model, never synced)",
        ),
        Case(
            TRL,
            "MeshGSPOConfig(num_iterations=2) on a launched 3x2 mesh",
            "`MeshGSPOConfig(...)` on a launched rank",
            grpo_config_on_mesh("MeshGSPOConfig", num_iterations=2),
            ValueError,
            "num_iterations=2 is invalid: it must be 1 on the distributed mesh (each fast step trains once on "
            "rollouts it has just generated)",
        ),
        Case(
            TRL,
            "MeshGRPOConfig(steps_per_generation=4, gradient_accumulation_steps=2) on a launched 3x2 mesh",
            "`MeshGRPOConfig(...)` on a launched rank",
            grpo_config_on_mesh("MeshGRPOConfig", steps_per_generation=4, gradient_accumulation_steps=2),
            ValueError,
            "steps_per_generation=4 is invalid: it must equal gradient_accumulation_steps = 2 on the distributed mesh "
            "(a fast step is one generation batch, trained as that many microbatches)",
        ),
        Case(
            TRL,
            "MeshGRPOConfig(top_entropy_quantile=0.2) on a launched 3x2 mesh",
            "`MeshGRPOConfig(...)` on a launched rank",
            grpo_config_on_mesh("MeshGRPOConfig", top_entropy_quantile=0.2),
            ValueError,
            "top_entropy_quantile=0.2 is invalid: it must be 1.0 on the mesh (the entropy mask is not applied there)",
        ),
        Case(
            TRL,
            "MeshGSPOConfig(repetition_penalty=1.2) on a launched 3x2 mesh",
            "`MeshGSPOConfig(...)` on a launched rank",
            grpo_config_on_mesh("MeshGSPOConfig", repetition_penalty=1.2),
            ValueError,
            "generation_config.repetition_penalty=1.2 is invalid: it must be 1.0 for generation through the pipeline "
            "(it samples with temperature, top_k, top_p and min_p only)",
        ),
        Case(
            TRL,
            "MeshGRPOTrainer(reward_funcs='a/reward-model') on a launched 3x2 mesh",
            "`MeshGRPOTrainer(...)` on a launched rank",
            grpo_trainer_on_mesh(reward_funcs="a/reward-model"),
            ValueError,
            "reward_funcs='a/reward-model' is invalid: it must hold only functions on the distributed mesh (a reward "
            "model is not run on the last stage yet)",
        ),
        Case(
            TRL,
            "MeshGRPOTrainer(tools=[...]) on a launched 3x2 mesh",
            "`MeshGRPOTrainer(...)` on a launched rank",
            grpo_trainer_on_mesh(tools=[len]),
            ValueError,
            "tools='list' is invalid: it must be None on the distributed mesh (its rollouts are single-turn "
            "generations through the pipeline)",
        ),
        Case(
            TRL,
            "MeshGRPOConfig(mask_ratio=0.95, mask_protect_dims=2)",
            "`MeshGRPOConfig(...)`",
            mesh_config_of("MeshGRPOConfig", mask_ratio=0.95, mask_protect_dims=2),
            ValueError,
            "mask_protect_dims=2 is invalid: it must be 0 for GRPO/GSPO (protected dims are chosen on a training batch "
            "before the first rollout exists)",
        ),
        Case(
            TRL,
            "MeshGRPOConfig(mask_fill='gaussian')",
            "`MeshGRPOConfig(...)`",
            mesh_config_of("MeshGRPOConfig", preset="paper", mask_fill="gaussian"),
            ValueError,
            "mask_fill='gaussian' is invalid: it must be 'zeros' or 'mean' for GRPO/GSPO (the Gaussian fill is "
            "calibrated on a training batch before the first rollout exists)",
        ),
        Case(
            TRL,
            "MeshGRPOConfig(steps_per_generation=2, gradient_accumulation_steps=1), mask_ratio > 0",
            "`MeshGRPOConfig(...)`",
            mesh_config_of(
                "MeshGRPOConfig",
                steps_per_generation=2,
                gradient_accumulation_steps=1,
                per_device_train_batch_size=8,
                num_generations=8,
            ),
            ValueError,
            "gradient_accumulation_steps=1 is invalid: it must be a multiple of steps_per_generation·num_iterations = "
            "2 when the boundaries compress (otherwise TRL computes π_old in a separate dense forward and the "
            "importance ratio compares the dense model with the masked one)",
        ),
        Case(
            TRL,
            "MeshSFTTrainer with --num_stages 4 under MESHTUNE_MESH=3x2",
            "`MeshSFTTrainer(...)` on a launched rank",
            sft_trainer_on_mismatched_mesh,
            ValueError,
            "num_stages=4 is invalid: it must equal Y = 2 of the mesh 3x2 "
            "(one pipeline stage per process of a replica)",
        ),
        # --- PEFT ----------------------------------------------------------------------------------------
        Case(
            PEFT,
            "peft_config=IA3Config(...) with optim='spectral_adamw'",
            "`MeshTrainer(..., peft_config=...)`",
            peft_trainer("IA3Config", target_modules=["q_proj", "down_proj"], feedforward_modules=["down_proj"]),
            ValueError,
            f"peft_config['default'].peft_type='IA3' is invalid: it must be one of ['LORA'] {_SPECTRAL_PEFT}",
        ),
        Case(
            PEFT,
            "peft_config=PromptTuningConfig(...) with optim='spectral_adamw'",
            "`MeshTrainer(..., peft_config=...)`",
            peft_trainer("PromptTuningConfig", num_virtual_tokens=4),
            ValueError,
            f"peft_config['default'].peft_type='PROMPT_TUNING' is invalid: it must be one of ['LORA'] {_SPECTRAL_PEFT}",
        ),
        Case(
            PEFT,
            "model='HuggingFaceTB/SmolLM2-135M' (a name) with peft_config",
            "`MeshTrainer(..., peft_config=...)`",
            peft_trainer("LoraConfig", model="HuggingFaceTB/SmolLM2-135M"),
            ValueError,
            "model='str' is invalid: it must be a loaded PreTrainedModel when peft_config is given",
        ),
        Case(
            PEFT,
            "model=None with peft_config",
            "`MeshTrainer(..., peft_config=...)`",
            peft_trainer("LoraConfig", model=None),
            ValueError,
            "model='NoneType' is invalid: it must be a loaded PreTrainedModel when peft_config is given",
        ),
        # --- MeshPlugin / MeshAccelerator ----------------------------------------------------------------
        Case(
            ACCELERATE,
            "MeshPlugin(mask_ratio=1.0)",
            "`MeshPlugin(...)`",
            plugin(mask_ratio=1.0),
            ValueError,
            "mask_ratio=1.0 is invalid: it must lie in [0, 1)",
        ),
        Case(
            ACCELERATE,
            "MESHTUNE_MASK_RATIO=1.5",
            "`MeshPlugin()`",
            plugin_from_env("MESHTUNE_MASK_RATIO", "1.5"),
            ValueError,
            "mask_ratio=1.5 is invalid: it must lie in [0, 1) (the value came from $MESHTUNE_MASK_RATIO)",
        ),
        Case(
            ACCELERATE,
            "MESHTUNE_MASK_RATIO=high",
            "`MeshPlugin()`",
            plugin_from_env("MESHTUNE_MASK_RATIO", "high"),
            ValueError,
            "MESHTUNE_MASK_RATIO='high' is invalid: it must be a number or 'none'",
        ),
        Case(
            ACCELERATE,
            "MESHTUNE_NUM_STAGES=2.5",
            "`MeshPlugin()`",
            plugin_from_env("MESHTUNE_NUM_STAGES", "2.5"),
            ValueError,
            "MESHTUNE_NUM_STAGES='2.5' is invalid: it must be an int or 'none'",
        ),
        Case(
            ACCELERATE,
            "MESHTUNE_STAGE_LAYERS=3;1",
            "`MeshPlugin()`",
            plugin_from_env("MESHTUNE_STAGE_LAYERS", "3;1"),
            ValueError,
            "MESHTUNE_STAGE_LAYERS='3;1' is invalid: it must be comma-separated ints (e.g. 20,10) or 'none'",
        ),
        Case(
            ACCELERATE,
            "MESHTUNE_SPECTRAL_RANK=full",
            "`MeshPlugin()`",
            plugin_from_env("MESHTUNE_SPECTRAL_RANK", "full"),
            ValueError,
            "MESHTUNE_SPECTRAL_RANK='full' is invalid: it must be an int or 'none'",
        ),
        Case(
            ACCELERATE,
            "MESHTUNE_ANCHOR=maybe",
            "`MeshPlugin()`",
            plugin_from_env("MESHTUNE_ANCHOR", "maybe"),
            ValueError,
            "MESHTUNE_ANCHOR='maybe' is invalid: it must be one of true/1/yes/false/0/no",
        ),
        Case(
            ACCELERATE,
            "MeshPlugin(anchor_seed=True)",
            "`MeshPlugin(...)`",
            plugin(anchor_seed=True),
            ValueError,
            "anchor_seed=True is invalid: it must be an int",
        ),
        Case(
            ACCELERATE,
            "MeshPlugin(anchor_loss_fn=3)",
            "`MeshPlugin(...)`",
            plugin(anchor_loss_fn=3),
            ValueError,
            "anchor_loss_fn=3 is invalid: it must be None or a callable (model, batch) → loss",
        ),
        Case(
            ACCELERATE,
            "MeshAccelerator(mesh_plugin=MeshConfig())",
            "`MeshAccelerator(...)`",
            accelerator_with_plain_config,
            ValueError,
            "mesh_plugin='MeshConfig' is invalid: it must be a MeshPlugin (or None)",
        ),
        Case(
            ACCELERATE,
            "prepare(model, loader) (no optimizer)",
            "`MeshAccelerator.prepare`",
            prepare(loader()),
            ValueError,
            "optimizers passed with the model=0 is invalid: it must be exactly 1 in the first prepare() call that "
            "holds the model (its steps drive the mask clock and the anchor)",
        ),
        Case(
            ACCELERATE,
            "prepare(model, other_model, AdamW(neither))",
            "`MeshAccelerator.prepare`",
            prepare(lambda net: tiny_llama(), lambda net: torch.optim.AdamW(nn.Linear(2, 2).parameters()), loader()),
            ValueError,
            "models holding the optimizer's parameters=0 is invalid: it must be exactly 1 (the model that "
            "trains on the mesh)",
        ),
        Case(
            ACCELERATE,
            "prepare(a module without decoder layers, ...)",
            "`MeshAccelerator.prepare`",
            prepare(lambda net: torch.optim.AdamW(net.parameters()), loader(), model=TwoLayerMLP),
            ValueError,
            f"model=TwoLayerMLP {_NO_DECODER}",
        ),
        Case(
            ACCELERATE,
            "prepare(model, SGD, loader) with anchor=True",
            "`MeshAccelerator.prepare`",
            prepare(sgd, loader()),
            ValueError,
            "optimizer='SGD' is invalid: it must be torch.optim.AdamW or Adam (replaced by SpectralAdamW) or a "
            "SpectralAdamW when anchor=True (the anchor's gradients feed SpectralAdamW's spectral filter); set "
            "anchor=False to keep another optimizer",
        ),
        Case(
            ACCELERATE,
            "AdamW(amsgrad=True)",
            "`MeshAccelerator.prepare`",
            prepare(adamw(amsgrad=True), loader()),
            ValueError,
            "amsgrad=True is invalid: it must be False (SpectralAdamW is AdamW without amsgrad)",
        ),
        Case(
            ACCELERATE,
            "AdamW(maximize=True)",
            "`MeshAccelerator.prepare`",
            prepare(adamw(maximize=True), loader()),
            ValueError,
            "maximize=True is invalid: it must be False (SpectralAdamW minimises)",
        ),
        Case(
            ACCELERATE,
            "Adam(weight_decay=0.1) (L2, not decoupled)",
            "`MeshAccelerator.prepare`",
            prepare(adam(weight_decay=0.1), loader()),
            ValueError,
            "weight_decay=0.1 is invalid: it must be 0 for Adam without decoupled_weight_decay (its L2 penalty is not "
            "AdamW's decoupled decay); use AdamW",
        ),
        Case(
            ACCELERATE,
            "an AdamW that has already stepped",
            "`MeshAccelerator.prepare`",
            prepare(stepped_adamw, loader()),
            ValueError,
            "optimizer='AdamW' is invalid: it must have taken no step yet when MeshAccelerator replaces it by "
            "SpectralAdamW (its moments would be lost)",
        ),
        Case(
            ACCELERATE,
            "prepare(model, optimizer) with anchor=True (no DataLoader)",
            "`MeshAccelerator.prepare`",
            prepare(adamw()),
            ValueError,
            "DataLoader=None is invalid: it must be passed to the same prepare() call as the "
            "model when anchor=True (the mesh draws its own batches from the training loader's dataset); pass the "
            "training DataLoader there",
        ),
        Case(
            ACCELERATE,
            "prepare(model, optimizer) with anchor=False, mask_fill='gaussian'",
            "`MeshAccelerator.prepare`",
            prepare(adamw(), anchor=False, mask_fill="gaussian"),
            ValueError,
            "DataLoader=None is invalid: it must be passed to the same prepare() call as the model when "
            "mask_fill='gaussian' (the mesh draws its own batches from the training loader's dataset); pass the "
            "training DataLoader there",
        ),
        Case(
            ACCELERATE,
            "a DataLoader over an IterableDataset with anchor=True",
            "`MeshAccelerator.prepare`",
            prepare(adamw(), lambda net: train_loader(CountingStream())),
            ValueError,
            "train DataLoader dataset='CountingStream' is invalid: it must be map-style (__len__ and __getitem__) so "
            "the anchor can draw its own batches; use anchor=False with an iterable dataset",
        ),
        Case(
            ACCELERATE,
            "DataLoader(batch_size=None)",
            "`MeshAccelerator.prepare`",
            prepare(adamw(), loader(batch_size=None)),
            ValueError,
            "train DataLoader batch_size=None is invalid: it must be a positive int (the anchor draws batches "
            "of the same size)",
        ),
        # --- recipes -------------------------------------------------------------------------------------
        Case(
            RECIPES,
            "recipes/cpt.py --mask_ratio 1.5",
            "`recipes/cpt.py`",
            lambda tmp: cpt(tmp, "--mask_ratio", "1.5"),
            ValueError,
            "mask_ratio=1.5 is invalid: it must lie in [0, 1)",
        ),
        Case(
            RECIPES,
            "recipes/cpt.py --block_size 1",
            "`recipes/cpt.py`",
            lambda tmp: cpt(tmp, "--block_size", "1"),
            ValueError,
            "block_size=1 is invalid: it must be >= 2 (a causal-LM row predicts its tokens 2..T)",
        ),
        Case(
            RECIPES,
            "recipes/cpt.py --text_files '<tmp>/*.md' (no match)",
            "`recipes/cpt.py`",
            lambda tmp: cpt(tmp, "--text_files", f"{TMP}/*.md"),
            ValueError,
            f"text_files='{TMP}/*.md' is invalid: it must match at least one existing file (a path or a glob of local "
            "text files)",
        ),
        Case(
            RECIPES,
            "group_blocks(tokens, block_size=1)",
            "`recipes/cpt.py: group_blocks`",
            lambda: load_recipe("cpt").group_blocks([5, 6, 7], 1),
            ValueError,
            "block_size=1 is invalid: it must be >= 2 (a causal-LM row predicts its tokens 2..T)",
        ),
        Case(
            RECIPES,
            "read_text_files([])",
            "`recipes/cpt.py: read_text_files`",
            read_no_text_files,
            ValueError,
            "text_files=[] is invalid: it must name at least one file or glob",
        ),
        Case(
            RECIPES,
            "recipes/cpt.py --block_size 65 (max_position_embeddings 64)",
            "`recipes/cpt.py`",
            lambda tmp: cpt_on_text(tmp, "--block_size", "65"),
            ValueError,
            "block_size=65 is invalid: it must be <= the model's max_position_embeddings=64",
        ),
        Case(
            RECIPES,
            "recipes/cpt.py --block_size 64 on 101 tokens of text",
            "`recipes/cpt.py`",
            lambda tmp: cpt_on_text(tmp, "--block_size", "64", words=100),
            ValueError,
            "block_size=64 is invalid: it must fit at least 2 times into the corpus of 101 tokens (one block to train "
            "on and one to evaluate; give more text or a smaller block_size)",
        ),
        Case(
            RECIPES,
            "recipes/cpt.py --eval_blocks 0",
            "`recipes/cpt.py`",
            lambda tmp: cpt_on_text(tmp, "--block_size", "8", "--eval_blocks", "0"),
            ValueError,
            "eval_blocks=0 is invalid: it must be >= 1",
        ),
        Case(
            RECIPES,
            "recipes/cpt.py --eval_blocks 32 (25 blocks of 8 tokens)",
            "`recipes/cpt.py`",
            lambda tmp: cpt_on_text(tmp, "--block_size", "8"),
            ValueError,
            "eval_blocks=32 is invalid: it must be smaller than the corpus's 25 blocks of 8 tokens (leave blocks to "
            "train on)",
        ),
        Case(
            RECIPES,
            "recipes/cpt.py --train_last_layers 9 (a 4-layer model)",
            "`recipes/cpt.py`",
            lambda tmp: cpt_on_text(tmp, "--block_size", "8", "--eval_blocks", "2", "--train_last_layers", "9"),
            ValueError,
            "train_last_layers=9 is invalid: it must lie in [1, 4] (the model's decoder layers)",
        ),
        Case(
            RECIPES,
            "recipes/sft.py --dataset squad",
            "`recipes/sft.py`",
            lambda tmp: sft(tmp, "--dataset", "squad"),
            ValueError,
            "dataset='squad' is invalid: it must be one of ['gsm8k', 'arithmetic']",
            note="checked before the model loads",
        ),
        Case(
            RECIPES,
            "recipes/sft.py --eval_items 0",
            "`recipes/sft.py`",
            lambda tmp: sft(tmp, "--eval_items", "0"),
            ValueError,
            "eval_items=0 is invalid: it must be >= 1",
            note="checked before the model loads",
        ),
        Case(
            RECIPES,
            "recipes/sft.py --eval_items 5000 (GSM8K)",
            "`recipes/sft.py`",
            lambda tmp: sft(tmp, "--eval_items", "5000"),
            ValueError,
            "eval_items=5000 is invalid: it must be < 1319 GSM8K problems",
            note="checked before the model loads",
        ),
        Case(
            RECIPES,
            "arithmetic.problems(0)",
            "`hf_meshtune.apps.arithmetic.problems`",
            arithmetic_problems(count=0),
            ValueError,
            "count=0 is invalid: it must be >= 1",
        ),
        Case(
            RECIPES,
            "arithmetic.problems(4, max_operand=0)",
            "`hf_meshtune.apps.arithmetic.problems`",
            arithmetic_problems(max_operand=0),
            ValueError,
            "max_operand=0 is invalid: it must be >= 1",
        ),
        Case(
            RECIPES,
            "arithmetic.problems(4, operators='/')",
            "`hf_meshtune.apps.arithmetic.problems`",
            arithmetic_problems(operators="/"),
            ValueError,
            "operators='/' is invalid: it must be a non-empty string of +-*",
        ),
        Case(
            RECIPES,
            "HF_MESHTUNE_CACHE=<tmp>/file/cache, where <tmp>/file is a file",
            "`hf_meshtune.apps.assets.smollm2_checkpoint` (recipes, `meshtune demo`: the embedded model's first use)",
            unwritable_cache,
            ValueError,
            "HF_MESHTUNE_CACHE='<tmp>/file/cache' is invalid: it must be a folder this process can create and write "
            "(the first use fills smollm2-135m-instruct there; NotADirectoryError: Not a directory)",
            note="checked before the conversion starts; an interrupted conversion is redone, never read "
            "(`tests/test_cache.py`)",
        ),
        Case(
            RECIPES,
            "a first-use fill that writes config.json only",
            "`hf_meshtune.apps.cache.filled_once` (the embedded model's conversion, the tiny-Llama pretrain)",
            partial_fill,
            ValueError,
            "fill='config_only' is invalid: it must write config.json, model.safetensors into the folder it is given",
            note="nothing is renamed into place: the cache keeps no incomplete folder",
        ),
        # --- anchor / AnchorBatches ----------------------------------------------------------------------
        Case(
            ANCHOR,
            "anchor=True with every matrix frozen",
            "`MeshTrainer(...).train()`",
            lambda tmp: mesh_trainer(tmp, only_vectors_trainable()).train(),
            ValueError,
            "anchor params=0 is invalid: it must include at least one matrix (2-D trainable parameter)",
        ),
        Case(
            ANCHOR,
            "AnchorBatches([], ...)",
            "`AnchorBatches(dataset, collate, batch_size, microbatches, seed)`",
            lambda: AnchorBatches([], list, 2, 1, 0),
            ValueError,
            "train_dataset='list' is invalid: it must be a non-empty map-style dataset (with __len__) so the anchor "
            "can draw its own batches",
        ),
        Case(
            ANCHOR,
            "AnchorBatches(a generator, ...)",
            "`AnchorBatches(dataset, collate, batch_size, microbatches, seed)`",
            lambda: AnchorBatches(no_rows(), list, 2, 1, 0),
            ValueError,
            "train_dataset='generator' is invalid: it must be a non-empty map-style dataset (with __len__) so the "
            "anchor can draw its own batches",
        ),
        Case(
            ANCHOR,
            "AnchorBatches(rows, batch_size=0)",
            "`AnchorBatches(...)`",
            lambda: AnchorBatches(pattern_dataset(4, 4), list, 0, 1, 0),
            ValueError,
            "batch_size=0 is invalid: it must be an int >= 1",
        ),
        Case(
            ANCHOR,
            "AnchorBatches(rows, microbatches=0)",
            "`AnchorBatches(...)`",
            lambda: AnchorBatches(pattern_dataset(4, 4), list, 2, 0, 0),
            ValueError,
            "microbatches=0 is invalid: it must be an int >= 1",
        ),
        Case(
            ANCHOR,
            "AnchorCircuit(every=0)",
            "`AnchorCircuit(...)`",
            lambda: anchor_circuit(every=0),
            ValueError,
            "anchor_every=0 is invalid: it must be >= 1",
        ),
        Case(
            ANCHOR,
            "AnchorCircuit(delay=-1)",
            "`AnchorCircuit(...)`",
            lambda: anchor_circuit(delay=-1),
            ValueError,
            "anchor_delay=-1 is invalid: it must be >= 0",
        ),
        Case(
            ANCHOR,
            "AnchorCircuit(params={})",
            "`AnchorCircuit(...)`",
            lambda: AnchorCircuit(tiny_llama(), {}, None, 1, 0, list, None),
            ValueError,
            "anchor params=0 is invalid: it must include at least one matrix (2-D trainable parameter)",
        ),
        Case(
            ANCHOR,
            "batches(round) returning no microbatch",
            "`AnchorCircuit.on_step`",
            anchor_round_without_batches,
            ValueError,
            "anchor batches=0 is invalid: it must be at least one microbatch per round",
        ),
        # --- masks and boundaries ------------------------------------------------------------------------
        Case(
            MASKS,
            "fill='ones'",
            "`attach_boundaries(model, Y, ...)`",
            attach(fill="ones"),
            ValueError,
            f"mask_fill='ones' is invalid: it must be one of {_FILLS}",
        ),
        Case(
            MASKS,
            "rescale=True, fill='gaussian'",
            "`attach_boundaries(model, Y, ...)`",
            attach(rescale=True, fill="gaussian"),
            ValueError,
            "mask_fill='gaussian' is invalid: it must be 'zeros' when mask_rescale=True (a rescaled payload "
            "and a filled estimate would count the dropped dims twice)",
        ),
        Case(
            MASKS,
            "num_stages=0",
            "`attach_boundaries(model, Y, ...)`",
            attach(0),
            ValueError,
            "num_stages=0 is invalid: it must be >= 1",
        ),
        Case(
            MASKS,
            "mask_ratio=1.0",
            "`attach_boundaries(model, Y, ...)`",
            attach(mask_ratio=1.0),
            ValueError,
            "mask_ratio=1.0 is invalid: it must lie in [0, 1)",
        ),
        Case(
            MASKS,
            "keep_count(64, 0.999)",
            "`keep_count(hidden_size, mask_ratio)`",
            lambda: keep_count(64, 0.999),
            ValueError,
            "mask_ratio=0.999 is invalid: it must keep at least one of hidden_size=64 dims per token (K = "
            "round((1-p)·H) = 0)",
        ),
        Case(
            MASKS,
            "keep_indices(..., keep=0)",
            "`keep_indices(...)`",
            lambda: keep_indices(0, 0, 0, 4, 8, 0, 0),
            ValueError,
            "keep=0 is invalid: it must lie in [1, hidden_size=8]",
        ),
        Case(
            MASKS,
            "keep_indices(..., keep=2, protected=[0, 1, 2])",
            "`keep_indices(...)`",
            lambda: keep_indices(0, 0, 0, 4, 8, 2, 0, protected=torch.tensor([0, 1, 2])),
            ValueError,
            "mask_protect_dims=3 is invalid: it must be < K=2, the dims kept per token",
        ),
        Case(
            MASKS,
            "BoundaryMask(0, mask_ratio=1.0)",
            "`BoundaryMask(...)`",
            lambda: BoundaryMask(0, 1.0),
            ValueError,
            "mask_ratio=1.0 is invalid: it must lie in [0, 1)",
        ),
        Case(
            MASKS,
            "protect_largest_dims(model, batch, -1)",
            "`BoundaryHandle.protect_largest_dims`",
            protect_negative_dims,
            ValueError,
            "mask_protect_dims=-1 is invalid: it must be >= 0",
        ),
        Case(
            MASKS,
            "MeanFill(momentum=0)",
            "`fills.MeanFill(...)`",
            fill("MeanFill", momentum=0.0),
            ValueError,
            "mask_fill_momentum=0.0 is invalid: it must lie in (0, 1]",
        ),
        Case(
            MASKS,
            "GaussianFill(momentum=1.5)",
            "`fills.GaussianFill(...)`",
            fill("GaussianFill", momentum=1.5),
            ValueError,
            "mask_fill_momentum=1.5 is invalid: it must lie in (0, 1]",
        ),
        Case(
            MASKS,
            "GaussianFill(ridge=0)",
            "`fills.GaussianFill(...)`",
            fill("GaussianFill", ridge=0.0),
            ValueError,
            "mask_fill_ridge=0.0 is invalid: it must be > 0",
        ),
        # --- byte ledger API -----------------------------------------------------------------------------
        Case(
            LEDGER,
            "LedgerSettings(num_replicas=0, anchor=False)",
            "`LedgerSettings(...)`",
            lambda: LedgerSettings(num_replicas=0, anchor=False),
            ValueError,
            "num_replicas=0 is invalid: it must be an integer >= 1",
        ),
        Case(
            LEDGER,
            "LedgerSettings(coding_ratio=0) (or `meshtune ledger --coding-ratio 0`)",
            "`LedgerSettings(...)`",
            lambda: LedgerSettings(boundary_codec="outliers8+rot+int4g64e8m0+zstd", coding_ratio=0),
            ValueError,
            "coding_ratio=0 is invalid: it must be None, a finite number > 0 or a (forward, backward) pair of them "
            "(bytes before the coder / bytes after, as a run measured them)",
        ),
        Case(
            LEDGER,
            "LedgerSettings(num_stages=0)",
            "`LedgerSettings(...)`",
            lambda: LedgerSettings(num_stages=0),
            ValueError,
            "num_stages=0 is invalid: it must be an integer >= 1",
        ),
        Case(
            LEDGER,
            "LedgerSettings(mask_ratio=True)",
            "`LedgerSettings(...)`",
            lambda: LedgerSettings(mask_ratio=True),
            ValueError,
            "mask_ratio=True is invalid: it must lie in [0, 1)",
        ),
        Case(
            LEDGER,
            "LedgerSettings(tokens_per_step=0)",
            "`LedgerSettings(...)`",
            lambda: LedgerSettings(tokens_per_step=0),
            ValueError,
            "tokens_per_step=0 is invalid: it must be an integer >= 1",
        ),
        Case(
            LEDGER,
            "LedgerSettings(grad_dtype='int8')",
            "`LedgerSettings(...)`",
            lambda: LedgerSettings(grad_dtype="int8"),
            ValueError,
            f"grad_dtype='int8' is invalid: it must be one of {_DTYPES}",
        ),
        Case(
            LEDGER,
            "LedgerSettings(param_dtype='int8')",
            "`LedgerSettings(...)`",
            lambda: LedgerSettings(param_dtype="int8"),
            ValueError,
            f"param_dtype='int8' is invalid: it must be one of {_DTYPES}",
        ),
        Case(
            LEDGER,
            "LedgerSettings(anchor='yes')",
            "`LedgerSettings(...)`",
            lambda: LedgerSettings(anchor="yes"),
            ValueError,
            "anchor='yes' is invalid: it must be True or False",
        ),
        Case(
            LEDGER,
            "LedgerSettings(anchor_tokens_per_round=0)",
            "`LedgerSettings(...)`",
            lambda: LedgerSettings(anchor_tokens_per_round=0),
            ValueError,
            "anchor_tokens_per_round=0 is invalid: it must be None or an integer >= 1",
        ),
        Case(
            LEDGER,
            "settings_for_row('M95', mask_ratio=0.9)",
            "`settings_for_row(...)`",
            lambda: settings_for_row("M95", mask_ratio=0.9),
            ValueError,
            "mask_ratio=0.9 is invalid: it must be left to the row 'M95'; change it with dataclasses.replace on the "
            "result",
        ),
        Case(
            LEDGER,
            "format_table({})",
            "`format_table(ledgers)`",
            lambda: format_table({}),
            ValueError,
            "ledgers={} is invalid: it must hold at least one ledger",
        ),
        # --- composed boundary codec ----------------------------------------------------------------------
        Case(
            COMPOSED,
            "boundary_codec='int4+zip'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="int4+zip"),
            ValueError,
            "boundary_codec='int4+zip' is invalid: it must be stages joined by '+' from outliers<N>, pca<r>/spca<r>, "
            "rot[<b>], int<b>[g<G>|x<K>][e8m0][sr], fp8[g<G>|x<K>][e8m0], then optionally /<backward> and a coder "
            "(zstd/zlib), or mask<p>[+fill] ('zip' is none of them)",
        ),
        Case(
            COMPOSED,
            "boundary_codec=''",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec=""),
            ValueError,
            "boundary_codec='' is invalid: it must be a non-empty string such as 'outliers8+int4'",
        ),
        Case(
            COMPOSED,
            "boundary_codec='int4+outliers8'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="int4+outliers8"),
            ValueError,
            "boundary_codec='int4+outliers8' is invalid: it must order its stages as outliers, then a projection, then "
            "a rotation, then a quantiser ('outliers8' comes too late)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers8+int8+int4'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8+int8+int4"),
            ValueError,
            "boundary_codec='outliers8+int8+int4' is invalid: it must have at most one quantiser (int/fp8)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='int4+gaussian' (a fill without a mask)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="int4+gaussian"),
            ValueError,
            "boundary_codec='int4+gaussian' is invalid: it must use the fill 'gaussian' only after mask<p> (a fill "
            "rebuilds the dims a mask dropped)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='mask0.9+int4'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="mask0.9+int4"),
            ValueError,
            "boundary_codec='mask0.9+int4' is invalid: it must follow mask<p> with at most one fill, one of "
            "['gaussian', 'mean', 'zeros'] (a mask composes with nothing else yet)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='mask1.5'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="mask1.5"),
            ValueError,
            "boundary_codec='mask1.5' is invalid: it must give a mask ratio p in [0, 1) (mask0.95 = the paper)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='int7'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="int7"),
            ValueError,
            "boundary_codec='int7' is invalid: it must quantise to one of [2, 3, 4, 5, 6, 8] bits (int7 is not "
            "supported)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers8+rot' (a rotation without a quantiser after it)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8+rot"),
            ValueError,
            "boundary_codec='outliers8+rot' is invalid: it must follow a rotation with a quantiser (rot only spreads "
            "values for one to code)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='rot48+int4' (a Hadamard block that is not a power of 2)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="rot48+int4"),
            ValueError,
            "boundary_codec='rot48+int4' is invalid: it must rotate in blocks of a power of 2 >= 2 (rot48 is not: a "
            "Hadamard block)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers8+zstd+int4' (an entropy stage that is not last)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8+zstd+int4"),
            ValueError,
            "boundary_codec='outliers8+zstd+int4' is invalid: it must end with the coder 'zstd': lossless coding is "
            "the last stage (it codes the bytes)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='zstd' (a coder with nothing to code)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="zstd"),
            ValueError,
            "boundary_codec='zstd' is invalid: it must code something before the coder: stages from outliers<N>, "
            "pca<r>/spca<r>, rot[<b>], int<b>[g<G>|x<K>][e8m0][sr], fp8[g<G>|x<K>][e8m0], then optionally "
            "/<backward> and a coder (zstd/zlib), or mask<p>[+fill]",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers8+int4+zstd' without the zstandard package",
            "`MeshConfig(...)`",
            without_module("zstandard", lambda: MeshConfig(boundary_codec="outliers8+int4+zstd")),
            ValueError,
            "boundary_codec='outliers8+int4+zstd' is invalid: it must name a coder this environment has (zstd needs "
            "the zstandard package: pip install 'zstandard>=0.22')",
        ),
        Case(
            COMPOSED,
            "boundary_codec='mask0.95/int8' (a backward spec on a codec that has no backward codec)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="mask0.95/int8"),
            ValueError,
            "boundary_codec='mask0.95/int8' is invalid: it must not spell a backward part on a mask (its gradient "
            "has the mask's support: no codec)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers8+int4/outliers4+int8' (outliers in the backward part)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8+int4/outliers4+int8"),
            ValueError,
            "boundary_codec='outliers8+int4/outliers4+int8' is invalid: it must spell only a rotation and a quantiser "
            "after '/' (the backward shares the forward's outliers and projection; 'outliers4' is the forward part's "
            "outliers<N> stage)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers8+int4sr/int8' (stochastic rounding on the forward part)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8+int4sr/int8"),
            ValueError,
            "boundary_codec='outliers8+int4sr/int8' is invalid: it must put 'sr' on the backward part: stochastic "
            "rounding codes the backward message",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers2+rot16+int4g12' at H = 64 (a group that does not divide the rotation's "
            "padded width)",
            "`attach_composed(model, 2, codec)`",
            attach_composed_to_tiny("outliers2+rot16+int4g12"),
            ValueError,
            "boundary_codec='outliers2+rot16+int4g12' is invalid: it must use a group size that divides the 64 coded "
            "values per token (g12 does not; H=64, outliers=2, rank=None, padded to whole rot16 blocks)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers8'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8"),
            ValueError,
            "boundary_codec='outliers8' is invalid: it must compress the non-outlier dims too: follow outliers<N> with "
            "a projection or a quantiser",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers8+int4', mask_fill='mean'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8+int4", mask_fill="mean"),
            ValueError,
            "mask_fill='mean' is invalid: it must stay 'zeros' with boundary_codec='outliers8+int4' (it acts on masks, "
            "and a composed codec sends none; outliers<N> is the codec's way to keep the largest dims)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='outliers8+int4', mask_ratio=0.9",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8+int4", mask_ratio=0.9),
            ValueError,
            "mask_ratio=0.9 is invalid: it must stay 0.0 with boundary_codec='outliers8+int4' (it acts on masks, "
            "and a composed codec sends none; outliers<N> is the codec's way to keep the largest dims)",
        ),
        Case(
            COMPOSED,
            "preset='quality', mask_fill='mean' (its codec sends no mask)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(preset="quality", mask_fill="mean"),
            ValueError,
            f"mask_fill='mean' is invalid: it must stay 'zeros' with boundary_codec='{QUALITY_CODEC}' (it acts on "
            "masks, and a composed codec sends none; outliers<N> is the codec's way to keep the largest dims; it is "
            "preset='quality''s boundary: give a mask_ratio or preset='paper' for masks)",
        ),
        Case(
            COMPOSED,
            "'outliers8+int4g64' at H = 64 (group size does not divide)",
            "`attach_composed(model, Y, codec)`",
            attach_composed_to_tiny("outliers8+int4g64"),
            ValueError,
            "boundary_codec='outliers8+int4g64' is invalid: it must use a group size that divides the 56 coded values "
            "per token (g64 does not; H=64, outliers=8, rank=None)",
        ),
        Case(
            COMPOSED,
            "'outliers8+int4x64' at H = 64 (more groups than coded values)",
            "`attach_composed(model, Y, codec)`",
            attach_composed_to_tiny("outliers8+int4x64"),
            ValueError,
            "boundary_codec='outliers8+int4x64' is invalid: it must split the 56 coded values per token into at most "
            "56 groups (x64 has more; H=64, outliers=8, rank=None)",
        ),
        Case(
            COMPOSED,
            "codec_refit_every=1 with anchor=False",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8+int8", anchor=False, codec_refit_every=1),
            ValueError,
            "codec_refit_every=1 is invalid: it must be 0 or None when anchor=False (the anchor's dense passes supply "
            "the refit; without the anchor the codec keeps the calibration made at the start)",
        ),
        Case(
            COMPOSED,
            "codec_refit_every=2 with a codec that fits nothing",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="int8", anchor=True, codec_refit_every=2),
            ValueError,
            "codec_refit_every=2 is invalid: it must be 0 or None with boundary_codec='int8' (only a codec with "
            "outliers<N> or a projection fits geometry to refit)",
        ),
        Case(
            COMPOSED,
            "codec_refit_every=-1",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="outliers8+int8", anchor=True, codec_refit_every=-1),
            ValueError,
            "codec_refit_every=-1 is invalid: it must be >= 0",
        ),
        Case(
            GOVERNOR,
            "codec_ladder without boundary_codec='governed'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(codec_ladder="int4,int8"),
            ValueError,
            "codec_ladder='int4,int8' is invalid: it must be None unless boundary_codec='governed' (the ladder is "
            "what the governor picks from)",
        ),
        Case(
            GOVERNOR,
            "codec_ladder='int8' (one level)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="governed", codec_ladder="int8"),
            ValueError,
            "codec_ladder='int8' is invalid: it must name at least two levels for the governor to choose from",
        ),
        Case(
            GOVERNOR,
            "codec_ladder='mask0.9,int8' (a mask level)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="governed", codec_ladder="mask0.9,int8"),
            ValueError,
            "codec_ladder='mask0.9,int8' is invalid: it must hold composed codecs only ('mask0.9' is a mask)",
        ),
        Case(
            GOVERNOR,
            "codec_ladder='int4,int4' (a level twice)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="governed", codec_ladder="int4,int4"),
            ValueError,
            "codec_ladder='int4,int4' is invalid: it must name every level once",
        ),
        Case(
            GOVERNOR,
            "codec_ladder='int4,,int8' (an empty level)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="governed", codec_ladder="int4,,int8"),
            ValueError,
            "codec_ladder='int4,,int8' is invalid: it must name a codec between every two commas",
        ),
        Case(
            GOVERNOR,
            "codec_ladder='int4,int9' (a level that is no codec)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="governed", codec_ladder="int4,int9"),
            ValueError,
            "codec_ladder='int4,int9' is invalid: it must hold valid codecs (level 'int9': boundary_codec='int9' is "
            "invalid: it must quantise to one of [2, 3, 4, 5, 6, 8] bits (int9 is not supported))",
        ),
        Case(
            GOVERNOR,
            "codec_ladder='int8,int4' (dearest first)",
            "`MeshTrainer(...)`",
            lambda: MeshTrainer(
                model=tiny_llama(),
                args=MeshTrainingArguments(
                    "unused", boundary_codec="governed", codec_ladder="int8,int4", num_stages=2, report_to=[]
                ),
                train_dataset=pattern_dataset(),
            ),
            ValueError,
            "codec_ladder='int8,int4' is invalid: it must list levels cheapest first, each dearer than the one before "
            "(bf16 bytes per token forward + backward at H=64: [132, 68])",
        ),
        Case(
            GOVERNOR,
            "fidelity_target=1.5",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="governed", fidelity_target=1.5),
            ValueError,
            "fidelity_target=1.5 is invalid: it must lie in (0, 1] (a gradient cosine)",
        ),
        Case(
            GOVERNOR,
            "fidelity_hysteresis=-0.1",
            "`MeshConfig(...)`",
            lambda: MeshConfig(fidelity_hysteresis=-0.1),
            ValueError,
            "fidelity_hysteresis=-0.1 is invalid: it must lie in [0, 1)",
        ),
        Case(
            GOVERNOR,
            "boundary_codec='governed' with mask_ratio=0.5",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="governed", mask_ratio=0.5),
            ValueError,
            "mask_ratio=0.5 is invalid: it must stay 0.0 with boundary_codec='governed' (it acts on masks, and a "
            "composed codec sends none; outliers<N> is the codec's way to keep the largest dims)",
        ),
        Case(
            GOVERNOR,
            "levels on a handle that is not governed",
            "`ComposedHandle.set_levels`",
            lambda: attach_composed_to_tiny("int8")().set_levels([1]),
            ValueError,
            "levels=[1] is invalid: it must be set only on a governed boundary_codec",
        ),
        Case(
            GOVERNOR,
            "a level past the ladder",
            "`ComposedHandle.set_levels`",
            lambda: _governed_handle().set_levels([2]),
            ValueError,
            "levels=[2] is invalid: it must give one level in [0, 2) per boundary (1)",
        ),
        Case(
            GOVERNOR,
            "anchor_cadence='sometimes'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(anchor_cadence="sometimes"),
            ValueError,
            "anchor_cadence='sometimes' is invalid: it must be one of ['fixed', 'adaptive']",
        ),
        Case(
            GOVERNOR,
            "anchor_cadence='adaptive' with anchor=False",
            "`MeshConfig(...)`",
            lambda: MeshConfig(anchor_cadence="adaptive"),
            ValueError,
            "anchor_cadence='adaptive' is invalid: it must be 'fixed' when anchor=False (the adaptive cadence reads "
            "the drift of the anchor momentum's subspace)",
        ),
        Case(
            GOVERNOR,
            "anchor_every_min with the fixed cadence",
            "`MeshConfig(...)`",
            lambda: MeshConfig(anchor_every_min=2),
            ValueError,
            "anchor_every_min=2 is invalid: it must be None unless anchor_cadence='adaptive' (a fixed cadence is "
            "anchor_every)",
        ),
        Case(
            GOVERNOR,
            "anchor_every_min=8 above anchor_every_max=4",
            "`MeshConfig(...)`",
            lambda: MeshConfig(preset="paper", anchor_cadence="adaptive", anchor_every_min=8, anchor_every_max=4),
            ValueError,
            "anchor_every_max=4 is invalid: it must be >= anchor_every_min=8",
        ),
        # --- per-sample change coding --------------------------------------------------------------------
        Case(
            CHANGE,
            "boundary_change_codec='rot+int2' (a boundary codec, not a change codec)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_change_codec="rot+int2"),
            ValueError,
            "boundary_change_codec='rot+int2' is invalid: it must be [rot[<b>]+]delta<bits>[g<G>]+<coder>: the change "
            "rounded on the step int<bits> would use on the cached value (bits 2..8), in groups of G values (default "
            "64), then a lossless coder (zstd/zlib), e.g. 'rot+delta5g64+zstd'",
        ),
        Case(
            CHANGE,
            "boundary_change_codec='rot+delta9g64+zstd'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_change_codec="rot+delta9g64+zstd"),
            ValueError,
            "boundary_change_codec='rot+delta9g64+zstd' is invalid: it must use delta<bits> with bits in 2..8 (not 9)",
        ),
        Case(
            CHANGE,
            "boundary_change_codec='rot+delta4g64+lz4' (a coder hf_meshtune does not have)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_change_codec="rot+delta4g64+lz4"),
            ValueError,
            "boundary_change_codec='rot+delta4g64+lz4' is invalid: it must name a coder from ['zstd', 'zlib'] ('lz4')",
        ),
        Case(
            CHANGE,
            "boundary_change_codec with boundary_codec='mask0.95'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="mask0.95", boundary_change_codec="rot+delta4g64+zstd"),
            ValueError,
            "boundary_change_codec='rot+delta4g64+zstd' is invalid: it must be None unless boundary_codec is a "
            "composed codec (not a mask or 'governed'; it is 'mask0.95'): a first visit sends boundary_codec's message",
        ),
        Case(
            CHANGE,
            "change_cache_gb=0",
            "`MeshConfig(...)`",
            lambda: MeshConfig(change_cache_gb=0),
            ValueError,
            'change_cache_gb=0 is invalid: it must be > 0',
        ),
        Case(
            CHANGE,
            "'rot+delta4g48+zstd' at H = 64 (groups that do not divide a token)",
            "`MeshTrainer(...)`",
            lambda tmp: _change_trainer(tmp, change="rot+delta4g48+zstd"),
            ValueError,
            "boundary_change_codec='rot+delta4g48+zstd' is invalid: it must use a group size g48 that divides the 64 "
            "values a token codes (its 62 non-outlier values, padded to whole blocks of 64)",
        ),
        Case(
            CHANGE,
            "boundary_change_codec with a streamed (iterable) train_dataset",
            "`MeshTrainer(...).train()`",
            lambda tmp: _change_trainer(tmp, dataset=_Stream()).train(),
            ValueError,
            "train_dataset='_Stream' is invalid: it must be a map-style dataset (with __len__ and __getitem__: a "
            "datasets.Dataset or a torch Dataset) when boundary_change_codec is set: its rows are keyed by their "
            "index, which a streamed dataset does not give",
        ),
        Case(
            CHANGE,
            "change_cache_gb=1e-06 below the caches' predicted size",
            "`MeshTrainer(...).train()`",
            lambda tmp: _change_trainer(tmp, change_cache_gb=1e-6).train(),
            ValueError,
            "change_cache_gb=1e-06 is invalid: it must be at least the change caches' predicted size, 3.2768e-05 GB "
            "(16 rows, 128 tokens × H=64 × 1 boundaries × 4 bytes): raise it, train on fewer rows, or leave "
            "boundary_change_codec unset",
        ),
        Case(
            CHANGE,
            "a training forward without row ids",
            "`attach_composed(model, Y, codec, change=...)`",
            _forward_without_row_ids,
            ValueError,
            "row ids=None is invalid: it must be given for every training forward when boundary_change_codec is set: "
            "train through MeshTrainer or MeshSFTTrainer, which give every row its index in the training dataset (or "
            "call set_rows(ids) before each training forward)",
        ),
        Case(
            CHANGE,
            "a receiver asked to decode a change for a row it does not hold",
            "`decode_change(...)`",
            _decode_without_the_row,
            ValueError,
            "change cache='row 5' is invalid: it must be held by the receiver for the same tokens when the sender "
            "codes it as a revisit",
        ),
        Case(
            CHANGE,
            "boundary_change_codec='rot48+delta4g16+zstd' (a Hadamard block that is not a power of 2)",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_change_codec="rot48+delta4g16+zstd"),
            ValueError,
            "boundary_change_codec='rot48+delta4g16+zstd' is invalid: it must rotate in blocks of a power of 2",
        ),
        Case(
            CHANGE,
            "a torch-style train_dataset whose rows hold their own meshtune_row_id (a datasets.Dataset's unused "
            "column is dropped first)",
            "`MeshTrainer(...).train()`",
            lambda tmp: _change_trainer(
                tmp, dataset=[dict(row, meshtune_row_id=0) for row in pattern_dataset(16, 8)]
            ).train(),
            ValueError,
            "train_dataset column='meshtune_row_id' is invalid: it must not be a column of the dataset (it is "
            "reserved)",
        ),
        Case(
            CHANGE,
            "boundary_change_codec with GRPO/GSPO",
            "`MeshGRPOTrainer(...)`",
            _grpo_with_change_coding,
            ValueError,
            "boundary_change_codec='rot+delta4g32+zstd' is invalid: it must be None for GRPO/GSPO: a row's "
            "completions are new at every visit, so no row is revisited with the same tokens (change coding is for "
            "SFT data seen more than once)",
        ),
        Case(
            CHANGE,
            "boundary_change_codec on the distributed mesh",
            "`RunSettings(...)`, `MeshTrainer(...)` (every rank)",
            run_settings(MeshConfig(boundary_change_codec="rot+delta4g64+zstd")),
            ValueError,
            "boundary_change_codec='rot+delta4g64+zstd' is invalid: it must be None on the distributed mesh (change "
            "coding runs on one process in this version)",
        ),
        Case(
            COMPOSED,
            "boundary_codec='int4x0'",
            "`MeshConfig(...)`",
            lambda: MeshConfig(boundary_codec="int4x0"),
            ValueError,
            "boundary_codec='int4x0' is invalid: it must split into at least 1 group (x<K>, K >= 1)",
        ),
        Case(
            COMPOSED,
            "'outliers64+int4' at H = 64",
            "`attach_composed(model, Y, codec)`",
            attach_composed_to_tiny("outliers64+int4"),
            ValueError,
            "boundary_codec='outliers64+int4' is invalid: it must keep fewer outlier dims than hidden_size=64 "
            "(outliers64)",
        ),
        Case(
            COMPOSED,
            "'outliers4+spca60+int4' at H = 64",
            "`attach_composed(model, Y, codec)`",
            attach_composed_to_tiny("outliers4+spca60+int4"),
            ValueError,
            "boundary_codec='outliers4+spca60+int4' is invalid: it must project on fewer than the 60 non-outlier dims "
            "(spca60 at H=64)",
        ),
        Case(
            COMPOSED,
            "ComposedCodec(parse_codec('mask0.9'), 0, 64)",
            "`ComposedCodec(...)`",
            composed("mask spec"),
            ValueError,
            "boundary_codec='mask0.9' is invalid: it must be a composed codec here (masks run on the mask path)",
        ),
        Case(
            COMPOSED,
            "fit on one token",
            "`ComposedCodec.fit`",
            composed("one token"),
            ValueError,
            "calibration tokens=1 is invalid: it must be >= 2 to fit the codec's geometry",
        ),
        Case(
            COMPOSED,
            "fit on activations of another width",
            "`ComposedCodec.fit`",
            composed("other width"),
            ValueError,
            "hidden_size=32 is invalid: it must equal the codec's hidden_size=64",
        ),
        Case(
            COMPOSED,
            "a codec state with another number of boundaries",
            "`ComposedHandle.load_state_dict`",
            composed("state"),
            ValueError,
            "state['codecs']=0 is invalid: it must hold one entry per codec (3: every boundary, and governed every "
            "level of each)",
        ),
        Case(
            COMPOSED,
            "StageModule with a mask and a codec",
            "`StageModule(...)`",
            composed("both"),
            ValueError,
            "boundary='a mask and a codec' is invalid: it must be masks (mask_in/mask_out) or composed codecs "
            "(codec_in/codec_out) on one stage, not both",
        ),
        Case(
            COMPOSED,
            "a codec with outliers run before any calibration",
            "`ComposedCodec.encode_activation`",
            unfitted_codec_runs,
            ValueError,
            "boundary_codec='outliers2+int4' is invalid: it must be fitted before it runs (its outlier dims / basis "
            "come from a calibration pass on a training batch, which MeshTrainer, MeshAccelerator and the mesh run "
            "before the first step; alone: fit() or calibrate())",
        ),
        Case(
            COMPOSED,
            "prepare(model, optimizer) with boundary_codec='outliers8+int4'",
            "`MeshAccelerator.prepare`",
            prepare(adamw(), anchor=False, mask_ratio=None, boundary_codec="outliers8+int4"),
            ValueError,
            "DataLoader=None is invalid: it must be passed to the same prepare() call as the model when "
            "boundary_codec='outliers8+int4' (the mesh draws its own batches from the training loader's dataset); "
            "pass the training DataLoader there",
        ),
        # --- boundary codecs -----------------------------------------------------------------------------
        Case(
            CODECS,
            "attach_codec(model, 2, 'zip')",
            "`attach_codec(...)`",
            attach_unknown_codec,
            ValueError,
            "codec='zip' is invalid: it must be one of ['bottleneck', 'delta_quant', 'pca', 'quant4', 'topk']",
        ),
        Case(
            CODECS,
            "attach_codec twice on one model",
            "`attach_codec(...)`",
            attach_codec_twice,
            ValueError,
            "boundary_codecs='attached' is invalid: it must be absent: remove() the codecs already attached",
        ),
        Case(
            CODECS,
            "QuantCodec(64, bits=9)",
            "`QuantCodec(...)`",
            codec("QuantCodec", 64, bits=9),
            ValueError,
            "bits=9 is invalid: it must be an int in [2, 8] (b bits: 2^(b-1) - 1 levels each side of 0)",
        ),
        Case(
            CODECS,
            "QuantCodec(64, grad_bits=0)",
            "`QuantCodec(...)`",
            codec("QuantCodec", 64, grad_bits=0),
            ValueError,
            "grad_bits=0 is invalid: it must be an int in [2, 8] (b bits: 2^(b-1) - 1 levels each side of 0)",
        ),
        Case(
            CODECS,
            "QuantCodec(1)",
            "`QuantCodec(...)`",
            codec("QuantCodec", 1),
            ValueError,
            "hidden_size=1 is invalid: it must be an int >= 2",
        ),
        Case(
            CODECS,
            "QuantCodec(64, dtype_bytes=0)",
            "`QuantCodec(...)`",
            codec("QuantCodec", 64, dtype_bytes=0),
            ValueError,
            "dtype_bytes=0 is invalid: it must be an int >= 1",
        ),
        Case(
            CODECS,
            "TopKCodec(70000)",
            "`TopKCodec(...)`",
            codec("TopKCodec", 70000),
            ValueError,
            "hidden_size=70000 is invalid: it must be <= 65536 (indices travel as int16)",
        ),
        Case(
            CODECS,
            "TopKCodec(64, k=4, compression=2.0)",
            "`TopKCodec(...)`",
            codec("TopKCodec", 64, k=4, compression=2.0),
            ValueError,
            "compression=2.0 is invalid: it must be None when k is given",
        ),
        Case(
            CODECS,
            "TopKCodec(64, compression=0)",
            "`TopKCodec(...)`",
            codec("TopKCodec", 64, compression=0),
            ValueError,
            "compression=0 is invalid: it must be > 0",
        ),
        Case(
            CODECS,
            "TopKCodec(64, k=64)",
            "`TopKCodec(...)`",
            codec("TopKCodec", 64, k=64),
            ValueError,
            "k=64 is invalid: it must be an int in [1, hidden_size - 1 = 63]",
        ),
        Case(
            CODECS,
            "PCACodec(64, rank=0)",
            "`PCACodec(...)`",
            codec("PCACodec", 64, rank=0),
            ValueError,
            "rank=0 is invalid: it must be an int in [1, hidden_size - 1 = 63]",
        ),
        Case(
            CODECS,
            "a PCACodec forward before fit",
            "`PCACodec.forward`",
            pca_forward_unfitted,
            ValueError,
            "pca.basis=None is invalid: it must be fitted (CodecHandle.fit(model, batch) or codec.fit(hidden)) before "
            "a training forward",
        ),
        Case(
            CODECS,
            "PCACodec(64, rank=4).fit(2 tokens)",
            "`PCACodec.fit`",
            pca_fit_on_too_few_tokens,
            ValueError,
            "fit tokens=2 is invalid: it must be >= rank K=4",
        ),
        Case(
            CODECS,
            "DeltaQuantCodec forward without keys",
            "`DeltaQuantCodec.forward`",
            delta_quant_without_keys,
            ValueError,
            "keys=None is invalid: it must be one bytes key per batch row (2 rows; CodecHandle derives them from "
            "input_ids)",
        ),
        Case(
            CODECS,
            "QuantCodec(64) on a [1, 2, 32] hidden state",
            "`QuantCodec.forward`",
            codec_on_wrong_width,
            ValueError,
            "hidden_size=32 is invalid: it must equal the codec's hidden_size=64",
        ),
        Case(
            CODECS,
            "CodecHandle.load_state_dict({'codecs': []}) (1 boundary)",
            "`CodecHandle.load_state_dict`",
            codec_state_of_other_mesh,
            ValueError,
            "state['codecs']=0 is invalid: it must hold one entry per boundary (1)",
        ),
        # --- mesh internals ------------------------------------------------------------------------------
        Case(
            INTERNALS,
            "GenerationConfig(repetition_penalty=1.1) for generation through the pipeline",
            "`RolloutSettings.from_generation_config`",
            rollout_settings(repetition_penalty=1.1),
            ValueError,
            "generation_config.repetition_penalty=1.1 is invalid: it must be 1.0 for generation through the pipeline "
            "(it samples with temperature, top_k, top_p and min_p only)",
        ),
        Case(
            INTERNALS,
            "GenerationConfig(num_beams=4) for generation through the pipeline",
            "`RolloutSettings.from_generation_config`",
            rollout_settings(num_beams=4),
            ValueError,
            "generation_config.num_beams=4 is invalid: it must be 1 for generation through the pipeline (it samples "
            "with temperature, top_k, top_p and min_p only)",
        ),
        Case(
            INTERNALS,
            "GenerationConfig() without max_new_tokens for generation through the pipeline",
            "`RolloutSettings.from_generation_config`",
            rollout_settings(max_new_tokens=None),
            ValueError,
            "max_new_tokens=None is invalid: it must be set (the number of tokens to generate)",
        ),
        Case(
            INTERNALS,
            "GenerationConfig(max_new_tokens=8) with neither pad_token_id nor eos_token_id",
            "`RolloutSettings.from_generation_config`",
            rollout_settings(pad_token_id=None, eos_token_id=None),
            ValueError,
            "generation_config.pad_token_id=None is invalid: it must be set (or an eos_token_id to pad with)",
        ),
        Case(
            INTERNALS,
            "RolloutSettings(top_p=0)",
            "`RolloutSettings`",
            lambda: RolloutSettings(max_new_tokens=4, pad_token_id=0, top_p=0.0),
            ValueError,
            "top_p=0.0 is invalid: it must lie in (0, 1]",
        ),
        Case(
            INTERNALS,
            "pipelined_generate on stage 0 without prompts",
            "`pipelined_generate`",
            generate_without_prompts,
            ValueError,
            "prompt_ids=None is invalid: it must be a [B, T] tensor of token ids on the first stage",
        ),
        Case(
            INTERNALS,
            "GRPOConfig(loss_type='sapo') for the policy loss on the mesh",
            "`PolicyLossSettings.from_grpo_config`",
            policy_loss_settings(loss_type="sapo"),
            ValueError,
            "loss_type='sapo' is invalid: it must be one of ['dapo', 'grpo', 'bnpo', 'dr_grpo', 'luspo'] on the mesh",
        ),
        Case(
            INTERNALS,
            "GRPOConfig(top_entropy_quantile=0.2) for the policy loss on the mesh",
            "`PolicyLossSettings.from_grpo_config`",
            policy_loss_settings(top_entropy_quantile=0.2),
            ValueError,
            "top_entropy_quantile=0.2 is invalid: it must be 1.0 on the mesh (the entropy mask is not applied there)",
        ),
        Case(
            INTERNALS,
            "pack_rollouts(..., seq_len=8) of 11-token rollouts",
            "`pack_rollouts`",
            rollouts_longer_than_seq_len,
            ValueError,
            "seq_len=8 is invalid: it must be >= the longest prompt + completion in the batch (11 tokens)",
        ),
        Case(
            INTERNALS,
            'RolloutSettings(max_new_tokens=0)',
            '`RolloutSettings`',
            lambda: RolloutSettings(max_new_tokens=0, pad_token_id=0),
            ValueError,
            'max_new_tokens=0 is invalid: it must be an int >= 1',
        ),
        Case(
            INTERNALS,
            'RolloutSettings(temperature=0)',
            '`RolloutSettings`',
            lambda: RolloutSettings(max_new_tokens=4, pad_token_id=0, temperature=0.0),
            ValueError,
            'temperature=0.0 is invalid: it must be > 0',
        ),
        Case(
            INTERNALS,
            'RolloutSettings(top_k=-1)',
            '`RolloutSettings`',
            lambda: RolloutSettings(max_new_tokens=4, pad_token_id=0, top_k=-1),
            ValueError,
            'top_k=-1 is invalid: it must be an int >= 0 (0: off)',
        ),
        Case(
            INTERNALS,
            'RolloutSettings(min_p=2)',
            '`RolloutSettings`',
            lambda: RolloutSettings(max_new_tokens=4, pad_token_id=0, min_p=2.0),
            ValueError,
            'min_p=2.0 is invalid: it must be None or lie in [0, 1]',
        ),
        Case(
            INTERNALS,
            'pipelined_generate with 3 stage ranks for a 2-stage split',
            '`pipelined_generate`',
            generate_with_wrong_stage_ranks,
            ValueError,
            "stage_ranks=[0, 1, 2] is invalid: it must name the 2 stages of this replica's pipeline (this is stage 0)",
        ),
        Case(
            INTERNALS,
            'pipelined_generate with a [2, 3] attention mask for [2, 4] prompts',
            '`pipelined_generate`',
            generate_with_mismatched_mask,
            ValueError,
            "attention_mask=(2, 3) is invalid: it must have the prompts' shape (2, 4)",
        ),
        Case(
            INTERNALS,
            "PolicyLossSettings(importance_sampling_level='batch')",
            '`PolicyLossSettings`',
            lambda: PolicyLossSettings(importance_sampling_level='batch'),
            ValueError,
            "importance_sampling_level='batch' is invalid: it must be 'token' or 'sequence'",
        ),
        Case(
            INTERNALS,
            'PolicyLossSettings(temperature=0)',
            '`PolicyLossSettings`',
            lambda: PolicyLossSettings(temperature=0.0),
            ValueError,
            'temperature=0.0 is invalid: it must be > 0',
        ),
        Case(
            INTERNALS,
            'PolicyLossSettings(max_completion_length=0)',
            '`PolicyLossSettings`',
            lambda: PolicyLossSettings(max_completion_length=0),
            ValueError,
            'max_completion_length=0 is invalid: it must be >= 1',
        ),
        Case(
            INTERNALS,
            'PolicyLoss(settings, microbatches=0)',
            '`PolicyLoss`',
            lambda: PolicyLoss(PolicyLossSettings(), microbatches=0),
            ValueError,
            'microbatches=0 is invalid: it must be >= 1',
        ),
        Case(
            INTERNALS,
            'layer_cache_argument of a layer whose forward takes no KV cache',
            '`layer_cache_argument`',
            lambda: layer_cache_argument(nn.Linear(2, 2)),
            ValueError,
            "decoder layer='Linear' is invalid: it must take a KV cache as one of ['cache', 'past_key_values', "
            "'layer_past'] in its forward (generation through the pipeline)",
        ),
        Case(
            INTERNALS,
            "record_send('telemetry', ...)",
            "`Wire.record_send`",
            wire_send("telemetry"),
            ValueError,
            "circuit='telemetry' is invalid: it must be one of ['pp_fwd', 'pp_bwd', 'dp', 'anchor', 'rollout', "
            "'local']",
        ),
        Case(
            INTERNALS,
            "a lockstep anchor gradient of another snapshot than the schedule's next",
            "`FastAnchorLink.drain`",
            lockstep_delivery_off_schedule,
            ValueError,
            "anchor gradient snapshot=4 is invalid: it must be the lockstep schedule's next one, 2 (anchor_every=2)",
        ),
        Case(
            INTERNALS,
            "record_all_reduce('dp', ..., participants=0)",
            "`Wire.record_all_reduce`",
            wire_all_reduce_over_nobody,
            ValueError,
            "participants=0 is invalid: it must be >= 1",
        ),
        Case(
            INTERNALS,
            "PowerSGD(rank=0)",
            "`PowerSGD(...)`",
            powersgd(0),
            ValueError,
            "powersgd_rank=0 is invalid: it must be an integer >= 1",
        ),
        Case(
            INTERNALS,
            "PowerSGD(rank=2, seed=-1)",
            "`PowerSGD(...)`",
            powersgd(2, seed=-1),
            ValueError,
            "seed=-1 is invalid: it must be an integer >= 0",
        ),
        Case(
            INTERNALS,
            "OuterUpdate(tensors=[t]).pseudo_gradients([])",
            "`OuterUpdate.pseudo_gradients`",
            update_with_missing_shapes,
            ValueError,
            "shapes=[] is invalid: it must describe all 1 tensors of the update (consumed 0)",
        ),
        Case(
            INTERNALS,
            "OuterFollower([])",
            "`OuterFollower(...)`",
            outer_follower([]),
            ValueError,
            "fragments=0 is invalid: it must hold at least one module",
        ),
        Case(
            INTERNALS,
            "OuterFollower(..., outer_lr=0)",
            "`OuterFollower(...)`",
            outer_follower(lr=0),
            ValueError,
            "outer_lr=0 is invalid: it must be > 0",
        ),
        Case(
            INTERNALS,
            "OuterFollower(..., outer_momentum=1.0)",
            "`OuterFollower(...)`",
            outer_follower(momentum=1.0),
            ValueError,
            "outer_momentum=1.0 is invalid: it must lie in [0, 1)",
        ),
        Case(
            INTERNALS,
            "OuterFollower.apply(update of fragment 3) (1 fragment)",
            "`OuterFollower.apply`",
            follower_given_unknown_fragment,
            ValueError,
            "update.fragment=3 is invalid: it must lie in [0, 1)",
        ),
        Case(
            INTERNALS,
            "an int8 outer update of the wrong size on the anchor link",
            "`Int8Codes.unpack`",
            int8_sync_unpacked(100),
            ValueError,
            "int8 sync size=100 is invalid: it must equal 261 words for rounds of [1000] values",
        ),
        Case(
            INTERNALS,
            "an int8 outer update coded by 0 replicas",
            "`Int8Codes.unpack`",
            int8_sync_unpacked(261, 0.0),
            ValueError,
            "int8 sync participants=0 is invalid: it must lie in [1, 127]",
        ),
        Case(
            INTERNALS,
            "StreamingDiLoCo(manager, [], ...)",
            "`StreamingDiLoCo(...)`",
            diloco([]),
            ValueError,
            "fragments=0 is invalid: it must be a non-empty list of modules",
        ),
        Case(
            INTERNALS,
            "StreamingDiLoCo(manager, [nn.ReLU()], ...)",
            "`StreamingDiLoCo(...)`",
            diloco([nn.ReLU()]),
            ValueError,
            "fragments[0]='ReLU' is invalid: it must own at least one parameter",
        ),
        Case(
            INTERNALS,
            "StreamingDiLoCo(..., sync_every=0)",
            "`StreamingDiLoCo(...)`",
            diloco(sync_every=0),
            ValueError,
            "sync_every=0 is invalid: it must be an integer >= 1",
        ),
        Case(
            INTERNALS,
            "StreamingDiLoCo(2 fragments, sync_every=3)",
            "`StreamingDiLoCo(...)`",
            diloco(sync_every=3),
            ValueError,
            "sync_every=3 is invalid: it must be a multiple of the number of fragments (2)",
        ),
        Case(
            INTERNALS,
            "StreamingDiLoCo(2 fragments, sync_every=4, fragment_sync_delay=2)",
            "`StreamingDiLoCo(...)`",
            diloco(fragment_sync_delay=2),
            ValueError,
            "fragment_sync_delay=2 is invalid: it must be an integer in [0, sync_every / fragments) = [0, 2)",
        ),
        Case(
            INTERNALS,
            "StreamingDiLoCo(..., outer_lr=-1.0)",
            "`StreamingDiLoCo(...)`",
            diloco(outer_lr=-1.0),
            ValueError,
            "outer_lr=-1.0 is invalid: it must be > 0",
        ),
        Case(
            INTERNALS,
            "StreamingDiLoCo(..., powersgd_rank=0)",
            "`StreamingDiLoCo(...)`",
            diloco(powersgd_rank=0),
            ValueError,
            "powersgd_rank=0 is invalid: it must be None or an integer >= 1",
        ),
        Case(
            INTERNALS,
            "StreamingDiLoCo(..., fragment_update_alpha=2)",
            "`StreamingDiLoCo(...)`",
            diloco(fragment_update_alpha=2),
            ValueError,
            "fragment_update_alpha=2 is invalid: it must lie in [0, 1]",
        ),
        Case(
            INTERNALS,
            "StreamingDiLoCo(..., keep_overlapped=True, fragment_update_alpha=0.5)",
            "`StreamingDiLoCo(...)`",
            diloco(keep_overlapped=True, fragment_update_alpha=0.5),
            ValueError,
            "fragment_update_alpha=0.5 is invalid: it must be 0 with keep_overlapped (the overlapped steps are kept "
            "whole, not mixed)",
        ),
        Case(
            INTERNALS,
            "start_lighthouse(min_replicas=0)",
            "`start_lighthouse(...)`",
            lighthouse_for(0),
            ValueError,
            "min_replicas=0 is invalid: it must be an integer >= 1",
        ),
        Case(
            INTERNALS,
            "make_manager(num_stages=0, ...)",
            "`make_manager(...)`",
            manager(num_stages=0),
            ValueError,
            "num_stages=0 is invalid: it must be an integer >= 1",
        ),
        Case(
            INTERNALS,
            "make_manager(stage=2, num_stages=2, ...)",
            "`make_manager(...)`",
            manager(stage=2),
            ValueError,
            "stage=2 is invalid: it must lie in [0, 2)",
        ),
        Case(
            INTERNALS,
            "make_manager(replica=-1, ...)",
            "`make_manager(...)`",
            manager(replica=-1),
            ValueError,
            "replica=-1 is invalid: it must be an integer >= 0",
        ),
        Case(
            INTERNALS,
            "make_manager(timeout_s=0, ...)",
            "`make_manager(...)`",
            manager(timeout_s=0),
            ValueError,
            "timeout_s=0 is invalid: it must be > 0",
        ),
        Case(
            INTERNALS,
            "make_manager(min_replica_size=0, ...)",
            "`make_manager(...)`",
            manager(min_replica_size=0),
            ValueError,
            "min_replica_size=0 is invalid: it must be an integer >= 1",
        ),
        Case(
            INTERNALS,
            "stage_fragments(stage 0 of 2, 999)",
            "`dp.fragments.stage_fragments`",
            lambda: stage_split_into(999),
            ValueError,
            "dp_fragments=999 is invalid: it must be <= the 19 trainable parameter tensors of stage 0",
        ),
        Case(
            INTERNALS,
            "build_schedule(stage, microbatches=0, loss)",
            "`pipeline.build_schedule`",
            schedule_without_microbatches,
            ValueError,
            "microbatches=0 is invalid: it must be >= 1",
        ),
        *host_cases(Case, CliExit, CLI, meshtune),
    ]


def _stage_checkpoint(tmp: Path, drop: str | None = None, reshape: str | None = None) -> str:
    """A tiny Llama saved to ``tmp/ckpt`` with tensor ``drop`` left out or ``reshape`` cut to [1]."""
    from safetensors.torch import load_file, save_file

    folder = tmp / "ckpt"
    tiny_llama(seed=0, layers=4, hidden=64).save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    if drop is not None:
        del tensors[drop]
    if reshape is not None:
        tensors[reshape] = torch.zeros(1)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


def load_stage_of(drop: str | None = None, reshape: str | None = None, rank: str = "1") -> Callable[[Path], object]:
    def trigger(tmp: Path) -> object:
        from hf_meshtune import load_causal_lm

        folder = _stage_checkpoint(tmp, drop, reshape)
        with environ(WORLD_SIZE="4", RANK=rank, MESHTUNE_MESH="2x2", MESHTUNE_REPLICA=None):
            return load_causal_lm(folder)

    return trigger


def _load_without_stages(tmp: Path) -> object:
    from hf_meshtune import load_causal_lm

    folder = _stage_checkpoint(tmp)
    with environ(WORLD_SIZE="4", RANK="0", MESHTUNE_MESH=None, MESHTUNE_REPLICA=None):
        return load_causal_lm(folder)


def _validate_job_on_other_mesh(tmp: Path) -> None:
    """What every Mesh trainer runs first on a launched rank: the job's topology from its environment."""
    from hf_meshtune.runtime.job import validate_mesh_job

    args = mesh_args(tmp)
    with launched(6, "2x2"):
        validate_mesh_job(tiny_llama(), args)


def _plain_training_arguments(tmp: Path) -> object:
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp / "out"), report_to=[], use_cpu=True)


def _trainer_given_adamw(tmp: Path) -> None:
    """``optimizers=(AdamW, None)`` with the anchor on: the Trainer keeps the AdamW, the anchor finds
    no SpectralAdamW.
    """
    model = tiny_llama()
    args = mesh_args(tmp)
    MeshTrainer(
        model=model,
        args=args,
        train_dataset=pattern_dataset(16, 8),
        optimizers=(torch.optim.AdamW(model.parameters(), lr=1e-3), None),
    ).train()


def _ledger_on_bad_json(tmp: Path) -> None:
    (tmp / "config.json").write_text("{nope", encoding="utf-8")
    meshtune("ledger", "--config", str(tmp / "config.json"))


def _launch_mesh_without_replicas(tmp: Path) -> None:
    from hf_meshtune.launch import launch_mesh

    launch_mesh((0, 2), [str(tmp / "train.py")], cpu=True)


def _gsm8k_splits_of_one_token() -> None:
    """What ``meshtune demo --seq-len 1`` reaches once SmolLM2 is loaded (here with the tiny tokenizer)."""
    from transformers import AutoTokenizer

    from hf_meshtune.apps.demo import gsm8k_splits

    gsm8k_splits(AutoTokenizer.from_pretrained(tiny_model_folder()), 1, 32)


def tiny_llava() -> nn.Module:
    """A multimodal model: a 2-layer CLIP vision tower and a 4-layer Llama (H = 64) text model."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    vision = CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8
    )
    text = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
        max_position_embeddings=64,
    )
    return LlavaForConditionalGeneration(LlavaConfig(vision_config=vision, text_config=text, image_token_index=99))


def _launch_script(tmp: Path, *flags: str) -> None:
    """``meshtune launch --mesh 3x2 *flags -- <tmp>/train.py`` with the script present (so the flag is what fails)."""
    script = tmp / "train.py"
    script.write_text("print('never run')\n", encoding="utf-8")
    meshtune("launch", "--mesh", "3x2", *flags, "--", str(script))


def _launch_with_secret(tmp: Path, secret: str, *flags: str) -> None:
    with environ(MESHTUNE_SECRET=secret, MESHTUNE_SECRET_FILE=None):
        _launch_script(tmp, *flags)


def _report_on(tmp: Path, content: str, *flags: str, file: str = "trainer_state.json") -> None:
    """``meshtune report <tmp> *flags`` where ``<tmp>/run/<file>`` holds ``content``."""
    path = tmp / "run" / file
    path.parent.mkdir(parents=True)
    path.write_text(content, encoding="utf-8")
    meshtune("report", str(tmp), *flags)


CASES: list[Case] = _cases()
"""Every row, in table order."""

GROUPS: list[str] = list(dict.fromkeys(case.group for case in CASES))
"""The groups in the order of their first row."""


# ---------------------------------------------------------------------------------------------------
# The document
# ---------------------------------------------------------------------------------------------------

INTRO = """\
# Bad input: what hf_meshtune refuses, and the exact error

Every input that hf_meshtune validates, the entry point that refuses it and the exact error it raises.
This file is generated from `tests/bad_input_cases.py` (`python -m tests.bad_input_cases > docs/bad_input.md`);
`tests/test_bad_input.py` triggers every row through the entry point named under "where" and checks the
exception type and the exact message, and checks that this file is what the generator writes now, so the
table cannot drift from the code.

Every error hf_meshtune raises itself names the field, the value and the rule, in one form:
`ValueError: <field>=<value> is invalid: it must <rule>` (`hf_meshtune._validation.require`).
`meshtune` prints it as `meshtune <command>: error: <message>` and exits with code 2.
A note after an error says whose message it is when it is not hf_meshtune's (torch, transformers, argparse,
Python), or what is weak about it ("weak spot": a message that misleads, names no field, or comes late).
`<tmp>` stands for the folder the input lives in; a message ending in `…` is checked by its beginning
(a third-party message that runs on).
"""


def _code(text: str) -> str:
    """``text`` as a Markdown code span inside a table cell."""
    text = re.sub(r"\s*\n\s*", " ", text).replace("|", "\\|")
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _error_cell(case: Case) -> str:
    """The error column: exception and message (or exit code and stderr for the CLI), then the note."""
    message = case.message + (" …" if case.prefix else "")
    if case.error is CliExit:
        code, _, line = message.partition(": ")
        cell = f"{code.replace('exit', 'exit code')}, stderr {_code(line)}"
    elif message:
        cell = _code(f"{case.error.__name__}: {message}")
    else:
        cell = f"{_code(case.error.__name__)} (no message)"
    return f"{cell} — {case.note}" if case.note else cell


def render() -> str:
    """``docs/bad_input.md``: the intro, then per group its note and a table | input | where | error |."""
    parts = [INTRO, "| group | rows |", "|---|---:|"]
    parts += [f"| [{group}](#{_anchor(group)}) | {sum(c.group == group for c in CASES)} |" for group in GROUPS]
    for group in GROUPS:
        parts += ["", f"## {group}", "", GROUP_NOTES[group], "", "| input | where | error |", "|---|---|---|"]
        parts += [f"| {_code(c.input)} | {c.where} | {_error_cell(c)} |" for c in CASES if c.group == group]
    return "\n".join(parts) + "\n"


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to dashes."""
    kept = "".join(ch for ch in heading.lower() if ch.isalnum() or ch in " -_")
    return kept.replace(" ", "-")


if __name__ == "__main__":
    sys.stdout.write(render())
