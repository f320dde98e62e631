"""What speculative decoding adds to one rank's memory, as vLLM 0.32 loads the drafter.

``speculative_config`` (the engine argument servetune's ``speculative.*`` parameters become) names a
method; what it costs on top of the target model:

- ``ngram`` and ``suffix`` draft from the prompt and the output so far: no weights, no KV cache;
- ``draft_model``: a whole second checkpoint (``speculative.model``), with its own embeddings and lm_head
  (``v1/spec_decode/draft_model.py`` shares neither), sharded over ``draft_tensor_parallel_size``
  (vLLM requires it equal to the target's); its attention layers get KV layers of their own;
- ``eagle`` / ``eagle3``: a small head checkpoint (``num_hidden_layers`` decoder layers, usually one, and
  an ``fc`` that fuses the target's hidden states: 2 x hidden for EAGLE, 3 x hidden for EAGLE-3). Its
  embeddings are the target's (``llm_base_proposer.py`` shares them when the head has none or the same),
  and so is its lm_head, except EAGLE-3's own over ``draft_vocab_size``;
- ``mtp``: the target checkpoint's own multi-token-prediction layers (``num_nextn_predict_layers``), each
  a decoder layer of the target's kind plus ``eh_proj`` (2 x hidden -> hidden) and three norms;
  embeddings and lm_head are the target's (vLLM: "Detected MTP model. Sharing target model ...").

Every drafter's attention layer registers a KV-cache spec of its own in the same pool. With every layer
full attention, vLLM puts target and draft layers in one group (``UniformTypeKVCacheSpecs``): a block then
holds one page per layer of both, so the KV bytes per token are the target's plus the draft's.

A decode step verifies ``1 + num_speculative_tokens`` tokens per request (``uniform_decode_query_len``):
``max_num_seqs`` requests need that many batched tokens, and the step's logits are as many rows. The
drafter writes KV past the verified tokens (``num_lookahead_tokens``: k slots for EAGLE, MTP and draft
models, none for n-gram). Pure but for :func:`load_draft`, which reads the draft checkpoint's config.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from servetune.capacity.arch import ModelArch, WeightQuant, load_model_arch
from servetune.capacity.arith import cdiv
from servetune.capacity.params import (
    MoeShards,
    ParamSplit,
    count_parameters,
    formula_bytes,
    kv_bytes_per_layer_token,
    layer_params,
    mtp_params,
    weight_bytes_per_rank,
)
from servetune.capacity.schema import NotPlanned
from servetune.capacity.vocab import draft_vocab_problem
from servetune.errors import UserError

#: Methods that draft from the text itself: no weights, no KV.
TEXT_METHODS = ("ngram", "suffix", "ngram_gpu")
#: Methods that load a second checkpoint, named by ``model``.
CHECKPOINT_METHODS = ("draft_model", "eagle", "eagle3")
#: Methods whose drafter writes KV past the verified tokens (vLLM ``num_lookahead_tokens``).
LOOKAHEAD_METHODS = ("draft_model", "eagle", "eagle3", "mtp")


def speculative_config(engine_args: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``speculative_config`` of a flat engine-args dict (a mapping or its JSON text); None without one."""
    raw = engine_args.get("speculative_config")
    if raw is None or raw == "":
        return None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise UserError(f"speculative_config {raw!r}: not a JSON object ({exc.msg})") from None
    if not isinstance(raw, Mapping):
        raise UserError(f"speculative_config {raw!r}: expected a JSON object with a method")
    config = dict(raw)
    if not config.get("method"):
        raise NotPlanned("speculative_config without a method: vLLM infers it from the draft model's name")
    return config


def load_draft(engine_args: Mapping[str, Any]) -> ModelArch | None:
    """The draft checkpoint's architecture for a method that loads one (None otherwise), read as the target's is
    (a local directory, the local caches, the catalogue, the hub). One it cannot find raises :class:`UserError`."""
    config = speculative_config(engine_args)
    if config is None or config["method"] not in CHECKPOINT_METHODS or not config.get("model"):
        return None
    try:
        return load_model_arch(str(config["model"]))
    except UserError as exc:
        raise UserError(f"speculative draft model: {exc}") from None


def check_draft(target: ModelArch, draft: ModelArch | None, engine_args: Mapping[str, Any]) -> None:
    """Raise :class:`UserError` where ``draft`` cannot draft for ``target``: a draft model of another vocabulary
    or tokenizer (``capacity/vocab.py``; vLLM refuses the one, and the other accepts almost nothing)."""
    config = speculative_config(engine_args)
    if config is None or draft is None:
        return
    problem = draft_vocab_problem(target, draft, config)
    if problem:
        raise UserError(f"speculative_config model {config.get('model')}: {problem}")


@dataclass(frozen=True)
class DraftCost:
    """What the drafter adds on one rank: weight bytes, KV layers and bytes per token per layer, and the step."""

    method: str
    num_speculative_tokens: int
    weights: float  # bytes of the drafter's own weights on this rank
    kv_layers: int  # attention layers whose KV the drafter keeps
    kv_bytes_per_layer_token: float
    lookahead_tokens: int  # KV slots written past the verified tokens, per request
    parameters: int  # the drafter's own parameters (unsharded), shared ones excluded
    source: str

    @property
    def query_len(self) -> int:
        """Tokens one request's decode step verifies: the next token and every draft token."""
        return 1 + self.num_speculative_tokens

    @property
    def kv_bytes_per_token(self) -> float:
        return self.kv_layers * self.kv_bytes_per_layer_token


def _tokens(config: Mapping[str, Any]) -> int:
    value = config.get("num_speculative_tokens")
    if value is None:
        raise NotPlanned(
            f"speculative_config method {config['method']} without num_speculative_tokens: vLLM takes it from the "
            "draft's config"
        )
    return int(value)


def _eagle_params(draft: ModelArch, target: ModelArch, method: str, tp: int) -> ParamSplit:
    """An EAGLE head's own parameters on one rank: its decoder layers, the fc fusing the target's hidden states,
    and (EAGLE-3) its lm_head over its draft vocabulary; the embeddings are the target's."""
    layers = layer_params(draft, tp, moe=False).times(draft.num_layers)
    fused = 3 if method == "eagle3" else 2
    fc = fused * target.hidden_size * draft.hidden_size
    extra = ParamSplit(linear=0, other=fc + draft.hidden_size)
    if method == "eagle3":
        # EAGLE-3's first layer attends over [embeddings, hidden]: its q/k/v take 2 x hidden inputs.
        heads, kv = draft.num_attention_heads // tp, max(1, draft.num_kv_heads // tp)
        extra += ParamSplit(linear=draft.hidden_size * (heads + 2 * kv) * draft.head_dim, other=0)
        vocab = draft.draft_vocab_size or draft.vocab_size
        extra += ParamSplit(linear=0, other=cdiv(vocab, tp) * draft.hidden_size)
    return layers + extra


def _own_rope_cache(draft: ModelArch, target: ModelArch, dtype_bytes: int) -> int:
    """The drafter's own rotary cos/sin cache: none where it is the target's. vLLM's ``get_rope`` keeps one cache
    per head size, rotary dimension, positions, rope parameters and dtype in the worker (``_ROPE_DICT``), and the
    drafter is built in the target's dtype: with the same settings it gets the target's cache (measured with
    ``bench/draft_vllm.py``). Where either model's settings are unknown (a catalogue entry), it is counted."""
    cache = draft.max_position_embeddings * draft.rope_dim * dtype_bytes
    mine = (draft.rope_settings, draft.head_dim, draft.rope_dim, draft.max_position_embeddings)
    theirs = (target.rope_settings, target.head_dim, target.rope_dim, target.max_position_embeddings)
    return 0 if draft.rope_settings is not None and mine == theirs else cache


def draft_cost(
    target: ModelArch,
    config: Mapping[str, Any],
    draft: ModelArch | None,
    dtype_bytes: int,
    kv_element_bytes: Callable[[ModelArch], float],
    tp: int,
    draft_quant: WeightQuant | None = None,
    shards: MoeShards | None = None,
) -> DraftCost:
    """The drafter's cost on one rank for ``config``, the target served with ``dtype_bytes`` per weight on ``tp``
    ranks. ``kv_element_bytes(arch)`` gives an architecture's bytes per K/V element under the served KV dtype (the
    ledger's own function: the drafter shares the target's KV dtype and dtype); ``draft_quant`` is how the draft
    checkpoint is served (default: as stored); ``shards``: how the target's experts lie (MTP layers are MoE layers
    of the target, sharded as its own)."""
    method = str(config["method"])
    k = _tokens(config)
    if method in TEXT_METHODS:
        return DraftCost(method, k, 0.0, 0, 0.0, 0, 0, f"{method}: drafts from the text, no weights, no KV")
    lookahead = k if method in LOOKAHEAD_METHODS else 0
    if method == "mtp":
        if not target.mtp_layers:
            raise UserError(f"speculative_config method mtp: {target.name} declares no MTP layers")
        weights = formula_bytes(target, mtp_params(target, tp, shards), target.quant, dtype_bytes)
        per_layer = kv_bytes_per_layer_token(target, kv_element_bytes(target), tp)
        source = f"{target.mtp_layers} MTP layer(s) of the target; embeddings and lm_head shared"
        return DraftCost(
            method, k, weights, target.mtp_layers, per_layer, lookahead, mtp_params(target, 1).total, source
        )
    if method not in CHECKPOINT_METHODS:
        raise NotPlanned(f"speculative_config method {method}: the planner sizes ngram, suffix, draft_model, eagle, "
                         "eagle3 and mtp")  # fmt: skip
    if draft is None:
        raise NotPlanned(f"speculative_config method {method}: the draft checkpoint {config.get('model')} is not known")
    draft_tp = int(config.get("draft_tensor_parallel_size") or tp)
    quant = draft_quant or draft.quant
    per_layer = kv_bytes_per_layer_token(draft, kv_element_bytes(draft), draft_tp)
    rope_cache = _own_rope_cache(draft, target, dtype_bytes)
    if method == "draft_model":
        whole = weight_bytes_per_rank(draft, quant, dtype_bytes, draft_tp, 1)
        weights = float(whole - draft.max_position_embeddings * draft.rope_dim * dtype_bytes + rope_cache)
        source = f"draft model {draft.name}: own embeddings and lm_head, TP {draft_tp}"
        return DraftCost(method, k, weights, draft.num_layers, per_layer, lookahead, count_parameters(draft), source)
    weights = formula_bytes(draft, _eagle_params(draft, target, method, draft_tp), quant, dtype_bytes) + rope_cache
    shared = "embeddings shared" if method == "eagle3" else "embeddings and lm_head shared"
    source = f"{method.upper()} head {draft.name}: {draft.num_layers} layer(s), {shared}"
    whole = _eagle_params(draft, target, method, 1).total
    return DraftCost(method, k, weights, draft.num_layers, per_layer, lookahead, whole, source)
