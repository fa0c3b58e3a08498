"""The step-time model's schedule (``plan.schedule``) against hand-computed cases and torch's own order."""

from __future__ import annotations

import pytest

from hf_meshtune.plan.schedule import LinkSpec, StageCost, schedule_order, simulate_step

FAST = LinkSpec(rate=1e18)  # a link that takes no time


def test_one_stage_runs_its_microbatches_back_to_back():
    result = simulate_step([StageCost(1.0, 2.0)], [], 3, [], [])
    assert result.step_s == pytest.approx(9.0)
    assert result.compute_s == [pytest.approx(9.0)] and result.wait_s == [pytest.approx(0.0)]


def test_one_microbatch_over_one_link_pays_both_transfers_and_both_latencies():
    # stage 0 forward 1 s, 1 MB at 1 MB/s and 0.1 s one way, stage 1 forward 2 + backward 3, 0.5 MB back, stage 0
    # backward 4: 1 + (1 + 0.1) + 2 + 3 + (0.5 + 0.1) + 4
    link = LinkSpec(rate=1e6, latency_s=0.1)
    result = simulate_step([StageCost(1.0, 4.0), StageCost(2.0, 3.0)], [link], 1, [1e6], [0.5e6])
    assert result.step_s == pytest.approx(11.7)
    assert result.link_busy_s == [(pytest.approx(1.0), pytest.approx(0.5))]
    assert result.wait_s == [pytest.approx(11.7 - 5.0), pytest.approx(11.7 - 5.0)]


def test_two_stages_two_microbatches_with_latency():
    # f = 1, b = 2 on both stages, 0.5 s one way, no transfer time. Stage 0 runs F0 F1 B0 B1, stage 1 F0 B0 F1 B1:
    # s0 F0 [0,1] F1 [1,2]; s1 F0 [1.5,2.5] B0 [2.5,4.5] F1 [4.5,5.5] B1 [5.5,7.5]; s0 B0 [5,7] B1 [8,10]
    link = LinkSpec(rate=1e18, latency_s=0.5)
    result = simulate_step([StageCost(1.0, 2.0), StageCost(1.0, 2.0)], [link], 2, [0.0], [0.0])
    assert result.step_s == pytest.approx(10.0)
    assert result.compute_s == [pytest.approx(6.0), pytest.approx(6.0)]


def test_messages_queue_on_a_busy_link_one_direction_at_a_time():
    # stage 0 forwards take 1 s, each forward message 3 s on the link: the second waits for the first
    # (ready at 2, leaves at 4, arrives at 7); nothing else takes time
    link = LinkSpec(rate=1.0)
    result = simulate_step([StageCost(1.0, 0.0), StageCost(0.0, 0.0)], [link], 2, [3.0], [0.0])
    assert result.step_s == pytest.approx(7.0)
    assert result.link_busy_s[0][0] == pytest.approx(6.0)


def test_a_slow_stage_sets_the_pace_and_is_named():
    costs = [StageCost(0.1, 0.2), StageCost(1.0, 2.0), StageCost(0.1, 0.2)]
    result = simulate_step(costs, [FAST, FAST], 8, [0.0, 0.0], [0.0, 0.0])
    assert result.bottleneck_stage == 1
    # the slow stage's 8 × 3 s, plus the fill before it and the drain after it: 0.1 + 24 + 0.2 (stage 2's
    # last forward and backward overlap the slow stage's own chunks except the last)
    assert 24.0 < result.step_s < 24.0 + 0.1 + 0.2 + 0.1 + 0.2 + 1e-9


@pytest.mark.parametrize(("stages", "microbatches"), [(1, 3), (2, 2), (3, 4), (4, 8), (4, 2)])
def test_the_order_is_what_torchs_schedule_runs(stages, microbatches):
    """Replays torch's Schedule1F1B warm-up / 1B1F / cool-down counters (GPipe when M < Y, as build_schedule)."""
    for stage in range(stages):
        order = schedule_order(stage, stages, microbatches)
        assert sorted(order) == sorted([(k, m) for k in "FB" for m in range(microbatches)])
        if microbatches < stages:
            assert [k for k, _ in order] == ["F"] * microbatches + ["B"] * microbatches
            continue
        warmup = min(microbatches, stages - stage)
        assert [k for k, _ in order[:warmup]] == ["F"] * warmup
        assert order[warmup] == ("B", 0)
        for kind in "FB":  # each kind in microbatch order
            assert [m for k, m in order if k == kind] == list(range(microbatches))


def test_bad_schedules_and_links_are_refused():
    with pytest.raises(ValueError, match="rate=0 is invalid: it must be bytes per second > 0"):
        LinkSpec(rate=0)
    with pytest.raises(ValueError, match=r"forward_s=-1 is invalid"):
        StageCost(-1, 0)
    with pytest.raises(ValueError, match=r"links=\[\] is invalid: it must have one entry per boundary \(1\)"):
        simulate_step([StageCost(1, 1), StageCost(1, 1)], [], 2, [0.0], [0.0])


def test_stage_flops_count_every_matrix_of_the_layers_the_attention_and_the_head():
    from transformers import LlamaConfig

    from hf_meshtune.plan.flops import stage_flops

    h, i, heads, kv, vocab, layers, seq = 64, 128, 4, 2, 100, 4, 9
    config = LlamaConfig(hidden_size=h, intermediate_size=i, num_attention_heads=heads, num_key_value_heads=kv,
                         num_hidden_layers=layers, vocab_size=vocab)  # fmt: skip
    head_dim = h // heads
    weights = h * h + 2 * h * kv * head_dim + h * h + 3 * h * i  # q, k, v, o; gate, up, down
    layer = 2 * weights + 4 * heads * head_dim * (seq + 1) / 2  # causal average context
    stages = stage_flops(config, 2, seq, [3, 1])
    assert stages[0].forward == pytest.approx(3 * layer)
    assert stages[1].forward == pytest.approx(layer + 2 * h * vocab)
    assert stages[0].backward == pytest.approx(2 * stages[0].forward)
    lora = stage_flops(config, 2, seq, [3, 1], lora=True, checkpointing=True)
    assert lora[1].backward == pytest.approx(2 * lora[1].forward)  # activations only, plus the recompute
    with pytest.raises(ValueError, match="config.model_type='bert' is invalid: it must be a family"):
        stage_flops(type("C", (), {"model_type": "bert"})(), 2, seq)


def test_the_step_model_adds_the_sync_compute_does_not_hide_and_names_the_bottleneck():
    from transformers import LlamaConfig

    from hf_meshtune.plan.model import Placement, TrainingShape, predict_step

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=4, vocab_size=100)  # fmt: skip
    shape = TrainingShape(num_replicas=4, num_stages=2, microbatch_size=2, microbatches=4, seq_len=32,
                          dp_sync_every=4, dp_fragments=1)  # fmt: skip
    slow_link = predict_step(config, shape, Placement.uniform(2, 1e-3, 0.01, 100.0))  # 10 kbit/s
    assert slow_link.bottleneck in ("boundary 0 link", "DiLoCo sync") and slow_link.kind == "model"
    fast = predict_step(config, shape, Placement.uniform(2, 1e-6, 1e5, 0.0))  # slow hosts, fast links
    assert fast.bottleneck == "stage 1 compute"
    assert fast.step_s == pytest.approx(fast.pipeline_s + fast.dp_s)
    hidden = predict_step(
        config, TrainingShape(**{**shape.__dict__, "dp_sync_delay": 3}), Placement.uniform(2, 1e-6, 1e5, 0.0)
    )
    assert hidden.dp_s <= fast.dp_s  # an overlapped sync hides behind compute
    local = predict_step(config, shape, Placement((1e-3, 1e-3), (None,), (100.0, 1.0)))
    assert local.link_busy_s[0][0] < slow_link.link_busy_s[0][0]


def test_calibration_measures_a_positive_speed_and_leaves_the_config_alone():
    from transformers import LlamaConfig

    from hf_meshtune.plan.calibrate import measure_tflops

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=4, vocab_size=100)  # fmt: skip
    assert config.num_hidden_layers == 4  # measured on a one-layer copy: the caller's config is left alone
    speed = measure_tflops(config, 16, repeats=2)
    assert 0 < speed < 100 and config.num_hidden_layers == 4


def test_bad_plan_inputs_name_the_field_value_and_rule():
    from transformers import LlamaConfig

    from hf_meshtune.plan.calibrate import measure_tflops
    from hf_meshtune.plan.flops import stage_flops
    from hf_meshtune.plan.model import Placement, TrainingShape, predict_step

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                         num_hidden_layers=4, vocab_size=100)  # fmt: skip
    shape = TrainingShape(num_replicas=2, num_stages=2, microbatch_size=1, microbatches=2, seq_len=8)
    cases = [
        (Placement((1.0,), ((10.0, 1.0),), (10.0, 1.0)), r"stage_tflops=\(1\.0,\) is invalid: it must give one speed"),
        (Placement((1.0, 1.0), (), (10.0, 1.0)), r"links=\(\) is invalid: it must give one link per boundary \(1\)"),
        (Placement((1.0, 0.0), ((10.0, 1.0),), (10.0, 1.0)), r"tflops=0\.0 is invalid: it must be > 0"),
        (Placement((1.0, 1.0), ((0.0, 1.0),), (10.0, 1.0)), r"rate_mbit=0\.0 is invalid: it must be > 0 \(Mbit/s\)"),
        (Placement((1.0, 1.0), ((10.0, -1.0),), (10.0, 1.0)), r"rtt_ms=-1\.0 is invalid: it must be >= 0"),
    ]
    for placement, message in cases:
        with pytest.raises(ValueError, match=message):
            predict_step(config, shape, placement)
    with pytest.raises(ValueError, match=r"seq_len=0 is invalid: it must be an integer >= 1"):
        stage_flops(config, 2, 0)
    with pytest.raises(ValueError, match=r"repeats=0 is invalid: it must be >= 1"):
        measure_tflops(config, 8, repeats=0)
