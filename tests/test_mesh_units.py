"""Single-process pieces of the distributed mesh: refusals with the rule, fragments, untying, padding."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hf_meshtune import MeshTrainer, MeshTrainingArguments
from hf_meshtune.anchor.follower import update_shapes
from hf_meshtune.boundary.masking import BoundaryMask
from hf_meshtune.comm.wire import Wire
from hf_meshtune.config import MeshConfig
from hf_meshtune.dp.fragments import stage_fragments
from hf_meshtune.pipeline.stage import StageModule, untie_embeddings
from hf_meshtune.runtime.job import _fixed_length, _pad_rows
from hf_meshtune.runtime.settings import RunSettings
from tests.tiny import make_tiny_causal_lm, pattern_dataset, tiny_llama


@pytest.mark.parametrize(
    "knob, value, rule",
    [
        ("mask_fill", "gaussian", "be 'zeros' or 'mean' on the distributed mesh"),
        ("mask_protect_dims", 2, "be 0 on the distributed mesh"),
    ],
)
def test_run_settings_refuse_what_the_mesh_cannot_do(knob, value, rule):
    with pytest.raises(ValueError, match=f"{knob}={value!r} is invalid: it must {rule}"):
        RunSettings(
            config=MeshConfig(preset="paper", **{knob: value}),
            microbatch_size=1,
            microbatches=1,
            seq_len=8,
            max_steps=1,
        )


def test_run_settings_need_positive_sizes():
    with pytest.raises(ValueError, match="seq_len=0 is invalid: it must be an int >= 1"):
        RunSettings(config=MeshConfig(), microbatch_size=1, microbatches=1, seq_len=0, max_steps=1)


def test_the_dp_timeout_comes_from_the_config_unless_the_run_settings_set_it(tmp_path):
    """A MeshTrainer user sets how long the survivors wait for a lost replica with ``dp_timeout_s``; it reaches
    the mesh process's settings (the quorum, the all-reduces and the bootstrap barriers take it from there)."""
    from hf_meshtune.runtime.job import _run_settings
    from hf_meshtune.topology import MeshTopology

    sizes = dict(microbatch_size=1, microbatches=1, seq_len=8, max_steps=1)
    assert RunSettings(config=MeshConfig(), **sizes).dp_timeout_s == 60
    config = MeshConfig(dp_timeout_s=7.5)
    assert RunSettings(config=config, **sizes).dp_timeout_s == 7.5
    assert RunSettings(config=config, **sizes, dp_timeout_s=3.0).dp_timeout_s == 3.0
    args = MeshTrainingArguments(
        str(tmp_path), num_stages=2, report_to="none", use_cpu=True, max_steps=2, anchor=False, dp_timeout_s=7.5
    )
    settings = _run_settings(args, MeshTopology(2, 2), 8, "http://127.0.0.1:1", None, None)
    assert settings.dp_timeout_s == 7.5
    with pytest.raises(ValueError, match=r"dp_timeout_s=0.0 is invalid: it must be > 0 \(seconds\)"):
        RunSettings(config=config, **sizes, dp_timeout_s=0.0)
    # a timeout does not shape the numerics: a run resumes with another one (a mask ratio it refuses)
    from hf_meshtune.config import require_saved_knobs

    saved = dataclasses.asdict(MeshConfig())
    require_saved_knobs(saved, config)
    with pytest.raises(ValueError, match=r"mask_ratio=0.5 is invalid: it must equal the checkpoint's value 0.0"):
        require_saved_knobs(saved, MeshConfig(mask_ratio=0.5, dp_timeout_s=7.5))


def _tiny_t5() -> torch.nn.Module:
    from transformers import T5Config, T5ForConditionalGeneration

    return T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))


def _tiny_granite() -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    sizes = dict(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("granite", **sizes))


@pytest.mark.parametrize(
    "build, field, why",
    [
        (lambda: make_tiny_causal_lm("gpt2"), "model.config.model_type='gpt2'", "no rotary position embedding"),
        (_tiny_t5, "model.config.model_type='t5'", "it is an encoder-decoder"),
        (_tiny_granite, "model.config.model_type='granite'", "Granite's embedding_multiplier"),
        (
            lambda: make_tiny_causal_lm("gemma3_text", use_bidirectional_attention=True),
            "model.config.use_bidirectional_attention=True",
            "build causal masks only",
        ),
        (lambda: tiny_llama().model, r"model.get_output_embeddings\(\)=None", "be an LM head"),
    ],
)
def test_pipeline_refuses_layouts_it_does_not_rebuild_saying_why(build, field, why):
    with pytest.raises(ValueError, match=f"{field} is invalid: it must .*{why}"):
        StageModule(build(), 0, 2, None, None)


def test_pipeline_refuses_a_layer_type_it_builds_no_mask_for():
    model = make_tiny_causal_lm("qwen2")
    model.config.layer_types = ["full_attention", "chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types=\['chunked_attention'\] is invalid: it must name only"):
        StageModule(model, 0, 2, None, None)


def test_stage_split_owns_embeddings_first_and_head_last():
    model = tiny_llama()
    first, last = (
        StageModule(model, 0, 2, None, BoundaryMask(0, 0.9)),
        StageModule(model, 1, 2, BoundaryMask(0, 0.9), None),
    )
    assert first.embed_tokens is model.model.embed_tokens and first.lm_head is None
    assert last.lm_head is model.lm_head and last.norm is model.model.norm and last.embed_tokens is None
    assert list(first.layer_range) == [0, 1] and list(last.layer_range) == [2, 3]
    assert first.payload_width("out") == last.payload_width("in") == round(0.1 * 64)


def test_fragments_are_contiguous_balanced_and_cover_the_stage_once():
    stage = StageModule(tiny_llama(), 0, 2, None, None)
    params = [p for p in stage.parameters() if p.requires_grad]
    fragments = stage_fragments(stage, 3)
    flat = [p for f in fragments for p in f.parameters()]
    assert [id(p) for p in flat] == [id(p) for p in params]  # same tensors, model order, no copies
    assert all(len(list(f.parameters())) > 0 for f in fragments)
    with pytest.raises(ValueError, match="dp_fragments=999 is invalid"):
        stage_fragments(stage, 999)


def test_update_shapes_follow_the_powersgd_rule():
    assert update_shapes([torch.Size([64, 32]), torch.Size([64])], 2) == [(64, 2), (32, 2), (64,)]
    assert update_shapes([torch.Size([4, 4])], 2) == [(4, 4)]  # r·(m+n) = 16 is not smaller
    assert update_shapes([torch.Size([64, 32])], None) == [(64, 32)]


def test_tied_embeddings_are_untied_into_two_equal_copies():
    model = tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    model.config.tie_word_embeddings = True
    assert untie_embeddings(model)
    assert model.lm_head.weight is not model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert model.config.tie_word_embeddings is False
    assert not untie_embeddings(model)


def test_rows_are_padded_to_the_fixed_length_and_pads_never_count():
    batch = {
        "input_ids": torch.tensor([[5, 6, 7]]),
        "labels": torch.tensor([[5, 6, 7]]),
        "attention_mask": torch.tensor([[1, 1, 0]]),
    }
    ids, labels = _pad_rows(batch, 5, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 0, 0]] and labels.tolist() == [[5, 6, -100, -100, -100]]
    with pytest.raises(ValueError, match="batch sequence length=3 is invalid: it must be <= the mesh's fixed length 2"):
        _pad_rows(batch, 2, pad_id=0)
    assert _fixed_length(pattern_dataset(4, 9)) == 9
    with pytest.raises(ValueError, match="train_dataset='list' is invalid: it must be a tokenized datasets.Dataset"):
        _fixed_length([{"text": "a"}])


def test_wire_keeps_measured_sends_and_booked_all_reduces_apart_and_books_only_known_circuits():
    wire = Wire()
    wire.record_all_reduce("dp", torch.zeros(10), participants=4)
    assert wire.handed["dp"] == 40 and wire.booked["dp"] == 2 * 3 / 4 * 40 and wire.sent["dp"] == 0
    wire.record_send("dp", torch.zeros(3, dtype=torch.float16))
    assert wire.sent["dp"] == 6 and wire.on_wire("dp") == 6 + 60 and wire.handed["dp"] == 46
    with pytest.raises(ValueError, match="circuit='telemetry' is invalid"):
        wire.record_send("telemetry", torch.zeros(1))


def test_meshtrainer_refuses_a_mesh_launch_it_cannot_run(tmp_path, monkeypatch):
    """Launched (WORLD_SIZE > 1), MeshTrainer checks the mesh before any rendezvous."""
    args = MeshTrainingArguments(str(tmp_path), num_stages=2, report_to="none", use_cpu=True, max_steps=2)
    no_steps = MeshTrainingArguments(str(tmp_path), num_stages=2, report_to="none", use_cpu=True)
    data = pattern_dataset(8, 8)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MESHTUNE_MESH", "3x2")
    with pytest.raises(ValueError, match="world_size=4 is invalid: it must equal X·Y = 3·2 = 6"):
        MeshTrainer(model=tiny_llama(), args=args, train_dataset=data)
    monkeypatch.setenv("MESHTUNE_MESH", "2x2")
    with pytest.raises(ValueError, match="resume_from_checkpoint='ckpt' is invalid"):
        MeshTrainer(model=tiny_llama(), args=args, train_dataset=data).train(resume_from_checkpoint="ckpt")
    with pytest.raises(ValueError, match="max_steps=-1 is invalid: it must be > 0 on the distributed mesh"):
        MeshTrainer(model=tiny_llama(), args=no_steps, train_dataset=data).train()
    # accelerate set up this process alone (as without ACCELERATE_USE_CPU=true): refused, not run 4 times
    with pytest.raises(ValueError, match="TrainingArguments.world_size=1 is invalid: it must equal WORLD_SIZE=4"):
        MeshTrainer(model=tiny_llama(), args=args, train_dataset=data).train()


def test_fast_replicas_draw_disjoint_shares_of_each_step_and_differ_from_the_anchor():
    from hf_meshtune.anchor import AnchorBatches
    from hf_meshtune.runtime.job import _ReplicaBatches

    data = pattern_dataset(64, 8)
    collate = lambda rows: {"input_ids": torch.tensor([r["input_ids"] for r in rows])}  # noqa: E731
    replicas = [_ReplicaBatches(data, collate, 4, r, 2, seed=3, seq_len=8, pad_id=0) for r in range(2)]
    rows = [{tuple(row) for row in replica(step)[0].tolist()} for step in range(8) for replica in replicas]
    assert len(set().union(*rows)) == 64  # 8 steps × 2 replicas × 4 rows = one pass, no row twice
    anchor = AnchorBatches(data, collate, 4, 1, seed=3)(0)[0]["input_ids"]
    assert not torch.equal(anchor, replicas[0](0)[0])


def test_an_anchor_message_of_the_wrong_size_is_refused():
    from hf_meshtune.comm.messages import flatten, unflatten

    flat = flatten([torch.ones(2, 3), torch.ones(4)])
    assert [t.shape for t in unflatten(flat, [torch.Size([2, 3]), torch.Size([4])])] == [(2, 3), (4,)]
    with pytest.raises(ValueError, match="anchor message size=10 is invalid: it must equal the expected 6 values"):
        unflatten(flat, [torch.Size([2, 3])])


def test_a_stage_with_nothing_to_train_is_refused_on_every_rank(tmp_path, monkeypatch):
    """Each process holds the whole model, so every rank reaches the same verdict before any rendezvous."""
    args = MeshTrainingArguments(
        str(tmp_path), num_stages=2, report_to="none", use_cpu=True, max_steps=2, anchor=False, optim="adamw_torch"
    )
    model = tiny_llama()
    for param in [*model.model.embed_tokens.parameters(), *model.model.layers[:2].parameters()]:
        param.requires_grad_(False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MESHTUNE_MESH", "2x2")
    trainer = MeshTrainer(model=model, args=args, train_dataset=pattern_dataset(8, 8))
    with pytest.raises(ValueError, match="trainable parameters of stage=0 is invalid: it must include at least one"):
        trainer.train()


def test_only_network_failures_are_reported_as_a_lost_pipeline_link():
    import torch.distributed as dist

    from hf_meshtune.comm.errors import is_link_error

    gloo = (
        "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] "
        "Timed out waiting 8000ms for send operation to complete"
    )
    assert is_link_error(RuntimeError(gloo))
    # a send still pending when its pair timed out (waited at the end of the step by the variable-size wire)
    assert is_link_error(RuntimeError("Application timeout caused pair closure"))
    assert is_link_error(dist.DistNetworkError("anything"))
    assert not is_link_error(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 16x2)"))
    assert not is_link_error(ValueError("Timed out waiting"))  # only backend RuntimeErrors


def test_a_link_error_in_the_gradient_norm_all_reduce_names_every_stage_it_waited_on():
    """The clip's all-reduce spans the replica's whole pipeline: a cut there (not only in the schedule's
    sends) fails with the pipeline-link message naming the other stages and their addresses."""
    from types import SimpleNamespace

    from hf_meshtune.runtime.stage import StageWorker
    from hf_meshtune.topology import MeshTopology

    topology = MeshTopology(2, 3, anchor=False)
    worker = SimpleNamespace(
        topology=topology,
        rank=4,
        replica=1,
        stage=1,
        role="fast",
        module=SimpleNamespace(step=7),
        settings=SimpleNamespace(link_timeout_s=8.0),
        peer_hosts={3: "10.77.0.13", 5: "10.77.0.15"},
    )
    timeout = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 8000ms for recv operation to complete"
    with pytest.raises(RuntimeError) as caught:
        with StageWorker.naming_link_failure(worker, "the gradient-norm all-reduce with", [3, 5]):
            raise RuntimeError(timeout)
    assert str(caught.value).startswith(
        "rank 4 (fast replica 1, stage 1) lost its pipeline link at step 7: the gradient-norm all-reduce with rank 3 "
        "(replica 1, stage 0) at 10.77.0.13, rank 5 (replica 1, stage 2) at 10.77.0.15 did not complete (timeout 8.0 s"
    )
    with pytest.raises(ValueError, match="not a link"):  # anything else passes unchanged
        with StageWorker.naming_link_failure(worker, "x", [3]):
            raise ValueError("not a link")


def test_a_replica_job_that_never_starts_fails_the_first_start_barrier_naming_the_count(monkeypatch):
    """The first start waits for all X·Y processes in the launcher's store; one that never comes
    fails it within dp_timeout_s with how many were ready. A restarted replica does not wait."""
    from datetime import timedelta

    import torch.distributed as dist

    from hf_meshtune.runtime.bootstrap import _job_barrier
    from hf_meshtune.topology import MeshTopology

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5))
    topology = MeshTopology(2, 1, anchor=False, job_replica=0)
    monkeypatch.setenv("MESHTUNE_RESTART", "0")
    with pytest.raises(
        ValueError,
        match=r"mesh start='1 of 2 processes ready' is invalid: it must complete within "
        r"dp_timeout_s = 0.5 s \(a replica job did not start\)",
    ):
        _job_barrier(server, topology, 0.5)
    monkeypatch.setenv("MESHTUNE_RESTART", "1")
    _job_barrier(server, topology, 0.5)  # returns at once
    assert server.add("hf_meshtune/ready", 0) == 1


def test_a_restarted_replica_job_heals_instead_of_resuming_from_its_command_lines_checkpoint(monkeypatch, capsys):
    from hf_meshtune.runtime.bootstrap import _restart_heals
    from hf_meshtune.topology import MeshTopology

    settings = RunSettings(
        config=MeshConfig(anchor=True, num_stages=2),
        microbatch_size=1,
        microbatches=1,
        seq_len=8,
        max_steps=4,
        resume_from="/gone/checkpoint-340",
    )
    job = MeshTopology(3, 2, anchor=True, job_replica=1)
    monkeypatch.setenv("MESHTUNE_RESTART", "0")
    assert _restart_heals(job, 2, settings) is settings  # a first start resumes as asked
    assert _restart_heals(MeshTopology(3, 2), 2, settings) is settings  # so does one world (no restarts)
    monkeypatch.setenv("MESHTUNE_RESTART", "2")
    healed = _restart_heals(job, 2, settings)
    assert healed.resume_from is None and healed.max_steps == 4
    assert "rank 2 is a restart of replica 1: it heals from the running mesh instead of resuming from /gone" in (
        capsys.readouterr().err
    )


def test_the_summary_splits_each_ranks_step_into_computing_and_waiting_and_names_the_slowest_stage():
    from hf_meshtune.runtime.console import summary_table
    from hf_meshtune.runtime.results import MeshResult, stage_time_split

    def rank(rank: int, stage: int, compute: list[float]) -> MeshResult:
        result = MeshResult(rank=rank, replica=rank // 2, stage=stage, role="fast")
        result.step_seconds, result.pipeline_seconds = [9.0, 1.2, 1.2], [8.0, 1.0, 1.0]  # step 0: warm-up
        result.compute_seconds = compute
        return result

    # stage 1 computes 0.8 s a step on both replicas, stage 0 0.3 / 0.5 s: stage 0 waits for stage 1
    fast = [
        rank(0, 0, [5.0, 0.3, 0.3]),
        rank(1, 1, [5.0, 0.8, 0.8]),
        rank(2, 0, [5.0, 0.5, 0.5]),
        rank(3, 1, [5, 0.8, 0.8]),
    ]
    split = stage_time_split(fast)
    first = split["step_split_per_rank"][0]
    assert (first["rank"], first["stage"], first["step_s"], first["pipeline_s"]) == (0, 0, 1.2, 1.0)
    assert first["compute_s"] == pytest.approx(0.3) and first["wait_s"] == pytest.approx(0.7)
    assert split["compute_s_per_stage"] == pytest.approx([0.4, 0.8])
    assert split["slowest_stage"] == {"stage": 1, "compute_s": pytest.approx(0.8)}
    line = summary_table({"mesh": "2x2", "steps": 3, "fast_tokens": 10, **split}, "s.json").splitlines()[0]
    assert line.endswith("stage 1 computes longest (0.8 s a step; per stage 0.4 / 0.8 s)")
    assert stage_time_split([]) == {}
