"""Generation through the pipeline (pipeline.generate) against transformers' own ``generate``: the same
tokens for greedy decoding and for seeded sampling, with left padding, early ends and every family the
stages support; and the rollout circuit's bytes, measured, equal to what the messages hold."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, GenerationConfig

from hf_meshtune.config import MeshConfig
from hf_meshtune.pipeline.generate import RolloutSettings, _positions, pipelined_generate
from hf_meshtune.pipeline.stage import build_stage, untie_embeddings
from tests.tiny import PIPELINE_FAMILIES, tiny_family, tiny_llama

PROMPT_LEN, BATCH = 7, 3


def _prompts(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """[3, 7] left-padded prompts: row 0 whole, rows 1 and 2 with 2 and 4 pads (pad id 0)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (BATCH, PROMPT_LEN), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    mask[2, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


def _stages(model, num_stages: int):
    cfg = MeshConfig(num_stages=num_stages)
    return [build_stage(model, s, num_stages, cfg, masked=False) for s in range(num_stages)]


@pytest.mark.parametrize("arch", list(PIPELINE_FAMILIES))
def test_stage_decoding_in_slices_generates_what_generate_does(arch):
    """Y stages' ``decode`` with one KV cache each, chained in one process, greedy: the tokens of
    ``model.generate`` for every family (sliding windows of 4 < 17 positions, soft-caps, GPT-NeoX's
    ``layer_past``), through left padding."""
    model = tiny_family(arch).eval()
    untie_embeddings(model)
    ids, mask = _prompts()
    new = 10
    reference = model.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None
    )[:, PROMPT_LEN:]
    for num_stages in (2, 4):
        stages = _stages(model, num_stages)
        caches = [DynamicCache(config=model.config) for _ in stages]
        positions, step_mask, tokens, out = _positions(mask), mask, ids, []
        with torch.no_grad():
            for step in range(new):
                length = PROMPT_LEN if step == 0 else 1
                x = tokens
                for stage, cache in zip(stages, caches):
                    x = stage.decode(x, cache, step_mask, positions[:, -length:])
                tokens = x[:, -1].float().argmax(-1, keepdim=True)
                out.append(tokens)
                step_mask = torch.cat([step_mask, torch.ones_like(step_mask[:, :1])], dim=1)
                positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
        assert torch.equal(torch.cat(out, dim=1), reference), (arch, num_stages)
        for stage, cache in zip(stages, caches):  # each stage's cache holds its own layers' keys, no others
            filled = [i for i in range(len(cache.layers)) if cache.get_seq_length(i) > 0]
            assert filled == list(stage.layer_range), (arch, num_stages, stage.stage)


def _generate_worker(rank: int, world: int, settings: RolloutSettings, seed: int) -> dict:
    """Stage ``rank`` of a ``world``-stage pipeline of tiny_llama generating from ``_prompts()``."""
    from hf_meshtune.comm.wire import Wire

    model = tiny_llama(seed=0).eval()
    untie_embeddings(model)
    module = _stages(model, world)[rank]
    ids, mask = _prompts()
    wire = Wire()
    generator = torch.Generator().manual_seed(seed) if rank == world - 1 else None
    out = pipelined_generate(
        module,
        wire,
        list(range(world)),
        settings,
        ids if rank == 0 else None,
        mask if rank == 0 else None,
        generator=generator,
    )
    return {"tokens": out, "wire": wire.to_dict()}


def _reference(settings: RolloutSettings, seed: int) -> torch.Tensor:
    model = tiny_llama(seed=0).eval()
    untie_embeddings(model)
    ids, mask = _prompts()
    torch.manual_seed(seed)
    kwargs = dict(do_sample=settings.do_sample, pad_token_id=settings.pad_token_id)
    if settings.do_sample:
        kwargs.update(temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p)
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=settings.max_new_tokens,
        eos_token_id=list(settings.eos_token_ids) or None,
        **kwargs,
    )
    return out[:, PROMPT_LEN:]


@pytest.mark.slow
def test_pipelined_generation_on_processes_is_generate(launcher):
    """Two and three processes, each a stage with its own KV cache, over gloo: greedy, greedy with an
    end-of-sequence token that ends rows early (the pipeline stops when every row has), and seeded
    sampling with temperature, top-k and top-p: the tokens of ``generate``, on every stage."""
    greedy = RolloutSettings(max_new_tokens=12, pad_token_id=0)
    free_run = _reference(greedy, 0)
    # end tokens that every row reaches, one from each row's free run at a different step (generate takes a list)
    ends = tuple(dict.fromkeys(int(free_run[row, step]) for row, step in ((0, 3), (1, 1), (2, 5))))
    ending = RolloutSettings(max_new_tokens=12, pad_token_id=0, eos_token_ids=ends)
    sampling = RolloutSettings(max_new_tokens=12, pad_token_id=0, do_sample=True, temperature=0.7, top_k=20, top_p=0.9)
    for settings, world in ((greedy, 2), (ending, 3), (sampling, 2), (sampling, 3)):
        reference = _reference(settings, seed=11)
        results = launcher(_generate_worker, world, settings, 11, timeout=120)
        for rank, result in enumerate(results):
            assert torch.equal(result["tokens"], reference), (settings, world, rank)
        n = reference.shape[1]
        if settings is ending:  # the run ended early, and a row that had ended before the last step was padded
            first_end = [int(torch.isin(row, torch.tensor(ends)).nonzero()[0]) for row in reference]
            assert n < 12 and min(first_end) < n - 1, (reference, ends)
            row = first_end.index(min(first_end))
            assert (reference[row, min(first_end) + 1 :] == 0).all()
        # measured payloads: stage s hands the shape, the mask and per step [B, T, H] fp32 to s + 1; the
        # last stage sends the new tokens and the end flag, [B + 1] int64, to each other stage per step
        hidden = 4 * BATCH * 64 * (PROMPT_LEN + n - 1)
        for rank, result in enumerate(results):
            sent = result["wire"]["sent"]["rollout"]
            expected = (world - 1) * 8 * (BATCH + 1) * n if rank == world - 1 else 16 + 8 * BATCH * PROMPT_LEN + hidden
            assert sent == expected, (rank, sent, expected)
            assert all(result["wire"]["sent"][c] == 0 for c in ("pp_fwd", "pp_bwd", "dp", "anchor"))
    assert not torch.equal(_reference(sampling, 11), _reference(sampling, 12))  # the draws depend on the seed


def test_rollout_settings_come_from_a_generation_config_and_refuse_what_the_pipeline_cannot_apply():
    config = GenerationConfig(
        max_new_tokens=16, do_sample=True, temperature=0.9, top_p=0.95, top_k=0, eos_token_id=[2, 5], pad_token_id=0
    )
    settings = RolloutSettings.from_generation_config(config)
    assert settings == RolloutSettings(
        max_new_tokens=16, pad_token_id=0, eos_token_ids=(2, 5), do_sample=True, temperature=0.9, top_k=0, top_p=0.95
    )
    # fields left unset take generate's defaults: greedy, and top_k 50 once sampling
    unset = RolloutSettings.from_generation_config(GenerationConfig(eos_token_id=2), max_new_tokens=4)
    assert unset == RolloutSettings(max_new_tokens=4, pad_token_id=2, eos_token_ids=(2,), do_sample=False, top_k=50)
    with pytest.raises(ValueError, match=r"generation_config.repetition_penalty=1.1 is invalid: it must be 1.0"):
        RolloutSettings.from_generation_config(GenerationConfig(max_new_tokens=4, repetition_penalty=1.1))
    with pytest.raises(ValueError, match=r"generation_config.num_beams=2 is invalid: it must be 1"):
        RolloutSettings.from_generation_config(GenerationConfig(max_new_tokens=4, num_beams=2, pad_token_id=0))
