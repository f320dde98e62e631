"""Speculative decoding in the memory ledger (capacity/draft.py): the drafter's weights, KV layers and the
tokens a decode step verifies, against hand calculations on tiny configurations, and the refusal of a space
whose draft does not fit."""

from __future__ import annotations

import json
import re

import pytest

from servetune import cli
from servetune.capacity import Hardware, NotPlanned, arch_from_hf_config, plan_capacity, resolve_hardware
from servetune.capacity.draft import draft_cost
from servetune.config.space import SearchSpace
from servetune.errors import UserError
from servetune.models.tiny import TINY_CONFIG
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import capacity_check

GIB = 1 << 30
CPU = Hardware(device="cpu", name="cpu", fp8=False)
ONE_GIB = {"VLLM_CPU_KVCACHE_SPACE": "1"}
# The tiny target: hidden 256, MLP 512, 4 layers, 4 heads, 2 KV heads of 64, vocabulary 258, untied, bfloat16.
H, MLP, D = 256, 512, 64
V_PADDED = 320  # vLLM pads the vocabulary to a multiple of 64
ROPE = 4096 * D * 2  # the rotary cos/sin cache: max_position_embeddings x head_dim x 2 B
TARGET_KV = 2 * 4 * 2 * D * 2  # 2 (K, V) x 4 layers x 2 KV heads x 64 x 2 B = 2048 B per token


def layer(kv_heads: int, hidden: int = H, heads: int = 4, inter: int = MLP) -> int:
    """q, k, v, o projections, the gated MLP and two norms of one Llama decoder layer."""
    return hidden * heads * D + 2 * hidden * kv_heads * D + heads * D * hidden + 3 * hidden * inter + 2 * hidden


@pytest.fixture
def tiny():
    return arch_from_hf_config(TINY_CONFIG, "tiny")


@pytest.fixture
def small_draft():
    """A smaller Llama on the same vocabulary: 2 layers, one KV head."""
    config = {**TINY_CONFIG, "num_hidden_layers": 2, "num_key_value_heads": 1}
    return arch_from_hf_config(config, "tiny-draft")


def cost(target, spec, draft=None, tp=1):
    return draft_cost(target, spec, draft, 2, lambda arch: 2.0, tp)


def test_ngram_adds_no_weights_and_no_kv_only_the_verified_tokens(tiny) -> None:
    base = plan_capacity(tiny, {"enforce_eager": True}, CPU, env=ONE_GIB)
    spec = {"enforce_eager": True, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    plan = plan_capacity(tiny, spec, CPU, env=ONE_GIB)
    assert plan.kv_cache_tokens == base.kv_cache_tokens and plan.kv_bytes_per_token == TARGET_KV
    assert plan.draft is not None and plan.draft.weights_gib == 0 and plan.draft.kv_layers == 0
    assert plan.draft.lookahead_tokens == 0  # n-gram writes no KV past the verified tokens
    assert plan.draft.verify_tokens == 128 * 4  # the CPU build's 128 seqs x (1 + 3)


def test_a_draft_model_adds_its_whole_checkpoint_and_its_own_kv_layers(tiny, small_draft) -> None:
    spec = {"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 4}
    drafter = cost(tiny, spec, small_draft)
    # its own embeddings and lm_head (vLLM's draft models share neither), final norm; the rotary cache is the
    # target's (same head size, positions and rope settings: vLLM's get_rope hands both the one cache)
    params = 2 * layer(kv_heads=1) + 2 * V_PADDED * H + H
    assert drafter.weights == params * 2
    catalogued = type(small_draft)(**small_draft.model_dump())  # as a catalogue entry: rotary settings unknown
    assert cost(tiny, spec, catalogued).weights == params * 2 + ROPE
    other_rope = arch_from_hf_config({**TINY_CONFIG, "num_hidden_layers": 2, "rope_theta": 500000.0}, "d")
    assert cost(tiny, spec, other_rope).weights == (2 * layer(kv_heads=2) + 2 * V_PADDED * H + H) * 2 + ROPE
    assert drafter.kv_layers == 2 and drafter.kv_bytes_per_token == 2 * 1 * D * 2 * 2  # 2 layers x K,V x 1 head
    assert drafter.lookahead_tokens == 4

    plan = plan_capacity(tiny, {"enforce_eager": True, "speculative_config": spec}, CPU, env=ONE_GIB, draft=small_draft)
    per_token = TARGET_KV + 512  # target and draft layers in one KV-cache group: a page each per block
    blocks = GIB // (128 * per_token)
    assert plan.kv_bytes_per_token == per_token and plan.kv_cache_blocks == blocks
    assert plan.kv_cache_tokens == int(blocks / (4096 // 128) * 4096)


def test_an_eagle_head_counts_its_layers_and_fc_and_shares_the_targets_embeddings(tiny) -> None:
    head = arch_from_hf_config(
        {**TINY_CONFIG, "num_hidden_layers": 1, "architectures": ["LlamaForCausalLMEagle"]}, "eagle"
    )
    eagle = cost(tiny, {"method": "eagle", "model": "eagle", "num_speculative_tokens": 2}, head)
    fc = 2 * H * H  # the target's embedding and hidden state fused into the head's width
    assert eagle.weights == (layer(kv_heads=2) + fc + H) * 2  # the rotary cache is the target's
    assert eagle.kv_layers == 1 and eagle.kv_bytes_per_token == 2 * 2 * D * 2

    head3 = arch_from_hf_config({**TINY_CONFIG, "num_hidden_layers": 1, "draft_vocab_size": 128}, "eagle3")
    eagle3 = cost(tiny, {"method": "eagle3", "model": "eagle3", "num_speculative_tokens": 2}, head3)
    wider_qkv = H * (4 + 2 * 2) * D  # its layer attends over [embedding, hidden]: q, k, v take 2 x hidden
    own_head = 128 * H  # its lm_head over the draft vocabulary
    assert eagle3.weights == (layer(kv_heads=2) + 3 * H * H + H + wider_qkv + own_head) * 2


def test_mtp_counts_the_targets_own_mtp_layers(tiny) -> None:
    with_mtp = arch_from_hf_config({**TINY_CONFIG, "num_nextn_predict_layers": 1}, "tiny-mtp")
    assert with_mtp.mtp_layers == 1
    mtp = cost(with_mtp, {"method": "mtp", "num_speculative_tokens": 1})
    # one decoder layer, eh_proj (2 x hidden -> hidden) and three norms; embeddings and lm_head shared
    assert mtp.weights == (layer(kv_heads=2) + 2 * H * H + 3 * H) * 2
    assert mtp.kv_layers == 1 and mtp.kv_bytes_per_token == TARGET_KV / 4
    with pytest.raises(UserError, match="declares no MTP layers"):
        cost(tiny, {"method": "mtp", "num_speculative_tokens": 1})


def test_a_draft_method_without_its_checkpoint_is_not_planned(tiny) -> None:
    spec = {"speculative_config": {"method": "eagle", "model": "org/head", "num_speculative_tokens": 2}}
    with pytest.raises(NotPlanned, match="draft checkpoint org/head"):
        plan_capacity(tiny, spec, CPU, env=ONE_GIB)


def test_the_verified_tokens_enter_the_sampler_peak_and_the_batch(tiny) -> None:
    gpu = resolve_hardware("gpu", "L4", None)
    args = {"max_num_seqs": 256, "max_num_batched_tokens": 512, "enforce_eager": True}
    base = plan_capacity(tiny, args, gpu)
    spec = {**args, "speculative_config": {"method": "ngram", "num_speculative_tokens": 3}}
    plan = plan_capacity(tiny, spec, gpu)
    # logits for min(256 seqs x 4, 512 tokens) rows instead of 256: the step's peak grows with the drafts
    assert plan.activation_gib >= base.activation_gib and plan.kv_cache_gib <= base.kv_cache_gib
    assert plan.draft.verify_tokens == 1024 and plan.draft.decode_seqs_per_step == 128
    assert any("verifies 128 of them a step" in note for note in plan.notes)


def spec_on_l4(tmp_path, speculative: dict):
    space = SearchSpace.model_validate({
        "name": "s", "model": "meta-llama/Llama-3.1-8B-Instruct", "device": "gpu", "workload": "chat",
        "hardware": {"devices_per_node": 8, "gpu": "L4"}, "engine_args": {"max_model_len": 8192, **speculative},
    })  # fmt: skip
    workload = space.resolved_workload(tmp_path)
    return StudyContext(space, workload, tmp_path, space.model, resolve_levels(space, workload)).spec_for({})


def test_a_draft_that_does_not_fit_is_refused_before_the_trial_with_the_reason(tmp_path) -> None:
    alone = capacity_check(spec_on_l4(tmp_path, {}))
    assert alone is not None and alone.fits  # 15 GiB of weights on a 24 GB L4
    drafted = {"speculative.method": "draft_model", "speculative.model": "meta-llama/Llama-3.1-8B",
               "speculative.num_speculative_tokens": 3}  # fmt: skip
    refused = capacity_check(spec_on_l4(tmp_path, drafted))
    assert refused is not None and not refused.fits
    # the same checkpoint as draft: its weights are the target's again, and they push past the budget
    assert re.search(r"\(target (\S+) \+ draft_model draft \1\) but vLLM may use only", refused.reason), refused.reason
    ngram = capacity_check(
        spec_on_l4(tmp_path, {"speculative.method": "ngram", "speculative.num_speculative_tokens": 3})
    )
    assert ngram is not None and ngram.fits


def test_plan_shows_the_draft_lines(capsys, tmp_path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    spec = json.dumps({"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 3})
    argv = ["plan", "--model", str(tmp_path), "--device", "cpu", "--cpu-kvcache-space-gib", "1"]
    assert cli.main([*argv, "--speculative-config", spec]) == 0
    out = capsys.readouterr().out
    assert "draft weights" in out and "draft_model, k=3" in out and "4 draft KV layer(s)" in out
    assert cli.main([*argv, "--speculative-config", spec, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["kv_bytes_per_token"] == 2 * TARGET_KV and doc["draft"]["lookahead_tokens"] == 3
    assert cli.main([*argv, "--speculative-config", "{method"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "speculative_config" in err[0]


def test_the_cpu_builds_own_count_with_the_tiny_model_drafting_for_itself() -> None:
    """vLLM 0.32's CPU build, the tiny model in float32 as its own draft_model (k=2), VLLM_CPU_KVCACHE_SPACE=1,
    logged "CPU KV cache size: 131,072 tokens" (measured by hand, 2026-12-05), half its 262,144 without a draft:
    the draft's four layers keep KV in the same pool, a page each per block."""
    arch = arch_from_hf_config({**TINY_CONFIG, "torch_dtype": "float32"}, "tiny")
    args = {"enforce_eager": True, "dtype": "float32", "max_num_seqs": 16}
    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}
    alone = plan_capacity(arch, args, CPU, env=ONE_GIB)
    drafted = plan_capacity(arch, {**args, "speculative_config": spec}, CPU, env=ONE_GIB, draft=arch)
    assert (alone.kv_cache_tokens, drafted.kv_cache_tokens) == (262_144, 131_072)


def test_the_drafters_weights_are_what_vllm_loaded_with_the_tiny_model_drafting_for_itself() -> None:
    """``flock /tmp/servetune-heavy.lock .venv/bin/python bench/draft_vllm.py`` (vLLM 0.32's CPU build, 2026-12-07):
    the tiny model in float32 as its own draft_model (k=2). In the worker's ``model_runner.drafter.model``: 664,576
    B of parameters held as tensors (embeddings, lm_head, norms) and 9,437,184 B of linear weights the CPU build
    handed to its oneDNN kernels (counted by the layers' partition sizes), 10,101,760 B in all; its rotary cache
    (1 MiB) is the target's own tensor (vLLM's get_rope keeps one per settings), so it adds nothing."""
    arch = arch_from_hf_config(TINY_CONFIG, "tiny")
    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 2}
    assert draft_cost(arch, spec, arch, 4, lambda _: 4.0, 1).weights == 664_576 + 9_437_184
    args = {"enforce_eager": True, "dtype": "float32", "max_num_seqs": 16, "speculative_config": spec}
    plan = plan_capacity(arch, args, CPU, env=ONE_GIB, draft=arch)
    assert plan.draft is not None and plan.draft.weights_gib == round(10_101_760 / GIB, 4)


def test_mtp_layers_join_a_hybrid_targets_kv_groups_as_vllm_grouped_them() -> None:
    """``PYTHONPATH=src flock /tmp/servetune-heavy.lock .venv/bin/python bench/mtp_vllm.py [--prefix-caching]``
    (vLLM 0.32's CPU build on a CPU with AVX-512 BF16, 2026-12-07): the tiny Qwen3-Next with one MTP layer
    (``servetune models tiny-arch qwen3-next-mtp``) in bfloat16, ``method: mtp`` with k=1, 1 GiB of KV space.
    vLLM: 1,638 blocks of 640 tokens; "CPU KV cache size: 609,931 tokens" (516,096 with prefix caching). Each block
    holds 2 pages: the MTP layer is grouped with the target's gated-attention layer, the 3 DeltaNet layers make two
    groups of 2 (one padded). A request holds 7 attention blocks and, per DeltaNet group, its state block (2 in
    prefix caching's align mode) plus one per draft token (MambaSpec.num_speculative_blocks), whose convolution
    state keeps one more column: 1638 / (7 + 2 x 2) x 4096 and 1638 / (7 + 2 x 3) x 4096. The planner counted the
    MTP layer as one more page beside a group of 1 and no draft-token blocks: 670,924 tokens without prefix
    caching."""
    pytest.importorskip("transformers")  # the tiny config is completed by transformers' own config class
    from servetune.models.tinyarch import TINY_ARCHS

    arch = arch_from_hf_config(TINY_ARCHS["qwen3-next-mtp"], "tiny-qwen3-next-mtp")
    hardware = resolve_hardware(device="cpu", cpu_flags=("avx512f", "avx512_bf16"))
    args = {"enforce_eager": True, "dtype": "bfloat16", "max_model_len": 4096, "max_num_seqs": 16,
            "speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}  # fmt: skip
    for prefix, tokens in ((False, 609_931), (True, 516_096)):
        plan = plan_capacity(arch, {**args, "enable_prefix_caching": prefix}, hardware, env=ONE_GIB)
        assert (plan.kv_cache_blocks, plan.settings.block_size, plan.kv_cache_tokens) == (1638, 640, tokens)
        assert plan.mamba_state_blocks_per_sequence == 2 * (3 if prefix else 2)


def test_the_mtp_layers_weights_are_what_vllm_loaded_on_the_tiny_qwen3_next() -> None:
    """``bench/mtp_vllm.py`` (vLLM 0.32's CPU build, 2026-12-07): the tiny Qwen3-Next's MTP layer in bfloat16, read
    in the worker's ``model_runner.drafter.model`` (``Qwen3NextMTP``) without the embeddings and lm_head it shares
    with the target (327,680 B, vLLM's "Sharing target model ..."): 789,248 B of parameters held as tensors (the
    experts, norms, router and shared-expert gate) and 985,600 B of linear weights the CPU build moved into its
    kernels (q with its gate, k, v, o, the shared expert, fc), 1,774,848 B in all; its rotary cache is the
    target's tensor. The planner had 504 B less: Qwen3-Next's router has no correction bias (4 experts) and its
    shared expert has a gate of its own (hidden -> 1, 256)."""
    pytest.importorskip("transformers")  # the tiny config is completed by transformers' own config class
    from servetune.models.tinyarch import TINY_ARCHS

    arch = arch_from_hf_config(TINY_ARCHS["qwen3-next-mtp"], "tiny-qwen3-next-mtp")
    mtp = draft_cost(arch, {"method": "mtp", "num_speculative_tokens": 1}, None, 2, lambda _: 2.0, 1)
    assert mtp.weights == 789_248 + 985_600
    assert mtp.kv_layers == 1 and mtp.parameters == 1_774_848 // 2
