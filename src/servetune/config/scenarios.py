"""``servetune init``: a search space from intent (a model, GPUs, a scenario), pruned by the planner.

The starting points are the tuning checklist's: section 12 (a row per scenario: context, memory
fraction, sequences, batched tokens, what to turn on) and section 5 (the scan ranges of
``max_num_seqs`` and ``max_num_batched_tokens``); section 6 for tensor parallelism (the smallest TP
that holds the model, then the next one, to see whether it improves the SLO); section 1 for the
SLO examples. The memory ledger (``servetune.capacity``) prunes what cannot run before anything
starts: TP sizes that cannot hold the model or would leave GPUs idle, context lengths whose KV
cache cannot hold one request, memory fractions that leave no KV pool. Every choice is written
with a comment saying why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import yaml

from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.prices import load_price_table
from servetune.capacity.settings import resolve_quant, structural_problem
from servetune.config.slo import Slo
from servetune.config.speculative import METHOD, PREFIX
from servetune.errors import UserError
from servetune.metrics import LATENCY_METRICS

NUM_TOKENS = PREFIX + "num_speculative_tokens"


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    workload: str
    row: str  # section 12's row, in English
    contexts: tuple[int, ...]
    memory: tuple[float, ...]  # gpu_memory_utilization values
    seqs: tuple[int, int]  # max_num_seqs range (section 5 / 12)
    batched: tuple[int, int]  # max_num_batched_tokens range
    slo: str  # section 1's examples, as --slo text
    objective: tuple[str, str]
    fp8_kv: bool = False  # section 12: test the FP8 KV cache (then a quality probe guards it)
    # Structured-outputs backends to compare (``structured_outputs_config.backend``) where the workload asks for
    # structured output: each constrains decoding at its own cost per token.
    structured_backends: tuple[str, ...] = ()
    # ``speculative.num_speculative_tokens`` values for n-gram speculation against none, where the deployment guide
    # says speculation pays: decode-heavy traffic at low to mid concurrency (empty: not searched).
    speculative_tokens: tuple[int, ...] = ()


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("chat", "online chat, latency first", "chat",
                 "online chat, latency first: BF16; the smallest TP that holds the model; context 8K-16K; memory "
                 "0.88-0.92; max_num_seqs 16-64; batched tokens 2048-8192; chunked prefill, prefix cache, CUDA graphs on",
                 (8192, 16384), (0.88, 0.90, 0.92), (16, 64), (2048, 8192),
                 "ttft_ms.p95=800,ttft_ms.p99=2000,tpot_ms.p95=40,error_rate=0.001", ("goodput", "max"),
                 speculative_tokens=(3, 5)),
        Scenario("rag", "retrieval-augmented QA: long prompts behind a shared template", "rag",
                 "RAG: context 16K-32K; input limited by the assembled prompt's P99; output 512-2048; prefix cache and "
                 "chunked prefill on; batched tokens 4096-16384",
                 (16384, 32768), (0.88, 0.90, 0.92), (16, 64), (4096, 16384),
                 "ttft_ms.p95=1500,ttft_ms.p99=3000,tpot_ms.p95=50,error_rate=0.001", ("goodput", "max")),
        Scenario("batch", "offline batch generation, throughput and cost first", "batch",
                 "offline batch: max_num_seqs 128-1024; batched tokens 16384-65536 and more; memory 0.92-0.97; "
                 "maximize tokens per second",
                 (8192,), (0.92, 0.95, 0.97), (128, 1024), (16384, 65536),
                 "error_rate=0.001", ("cost_per_mtok_usd", "min")),
        Scenario("summary", "long-document summaries, prefill-heavy", "summary",
                 "long-document summaries (section 5): batched tokens 8192-32768; max_num_seqs 4-32; watch prefill "
                 "throughput and the interference with short requests",
                 (32768,), (0.88, 0.90, 0.92), (4, 32), (8192, 32768),
                 "ttft_ms.p99=10000,tpot_ms.p95=60,error_rate=0.001", ("goodput", "max")),
        Scenario("long-context", "long-context serving", "summary",
                 "long context: context 32K up to the model's validated limit; max_num_seqs 4-32; batched tokens "
                 "4096-32768; chunked prefill and prefix cache on; test the FP8 KV cache",
                 (32768, 65536, 131072), (0.88, 0.90, 0.92), (4, 32), (4096, 32768),
                 "ttft_ms.p99=15000,tpot_ms.p95=80,error_rate=0.001", ("goodput", "max"), fp8_kv=True),
        Scenario("agent", "tool-calling agent: multi-turn, growing context, long outputs", "agent",
                 "agent (chat's row with RAG's context): context 16K-32K for the growing conversation; max_num_seqs "
                 "16-64; batched tokens 4096-16384; prefix cache (the conversation so far) and chunked prefill on",
                 (16384, 32768), (0.88, 0.90, 0.92), (16, 64), (4096, 16384),
                 "ttft_ms.p95=1500,ttft_ms.p99=3000,tpot_ms.p95=50,error_rate=0.001", ("goodput", "max"),
                 structured_backends=("xgrammar", "guidance"), speculative_tokens=(3, 5)),
    )
}  # fmt: skip


@dataclass
class Choice:
    values: list[Any]
    why: str


def _plan(arch, hardware, tp: int, context: int, memory: float, seqs: int):
    args = {
        "tensor_parallel_size": tp,
        "max_model_len": context,
        "gpu_memory_utilization": memory,
        "max_num_seqs": seqs,
    }
    return plan_capacity(arch, args, hardware)


def _powers(low: int, high: int) -> list[int]:
    out, v = [], low
    while v <= high:
        out.append(v)
        v *= 2
    return out


def choose(arch, hardware, scenario: Scenario, gpus: int) -> dict[str, Choice]:
    """The pruned values of the parallel size, context length and memory fraction, each with why."""
    quant = resolve_quant(arch, None)
    limit = arch.max_position_embeddings or max(scenario.contexts)
    contexts = [c for c in scenario.contexts if c <= limit] or [min(limit, min(scenario.contexts))]
    dropped_ctx = [c for c in scenario.contexts if c > limit]
    seqs_low = scenario.seqs[0]
    top_memory = max(scenario.memory)

    tp_notes, fitting = [], []
    for tp in _powers(1, gpus):
        problem = structural_problem(arch, tp, 1, quant)
        if problem:
            tp_notes.append(f"TP {tp}: {problem}")
            continue
        plan = _plan(arch, hardware, tp, min(contexts), top_memory, seqs_low)
        if plan.fits:
            fitting.append(tp)
        else:
            tp_notes.append(f"TP {tp}: does not fit ({plan.reason})")
    if not fitting:
        raise UserError(f"--model {arch.name}: no tensor-parallel size up to {gpus} GPUs holds it with a {min(contexts)}-token "
                        f"context ({'; '.join(tp_notes)[:300]}); give more --gpus, a larger --gpu, or a quantized checkpoint")  # fmt: skip
    smallest = fitting[0]
    tps = [smallest] + ([smallest * 2] if smallest * 2 in fitting else [])
    tp_why = (f"section 6: the smallest TP that holds the model ({smallest}), then the next, to see whether it "
              f"improves the SLO; powers of two that divide {gpus} GPUs (others leave GPUs idle)")  # fmt: skip
    if tp_notes:
        tp_why += "; dropped: " + "; ".join(tp_notes)

    ctx_kept, ctx_notes = [], [f"{c}: above the model's {limit}-token limit" for c in dropped_ctx]
    for c in contexts:
        if any(_plan(arch, hardware, tp, c, top_memory, seqs_low).fits for tp in tps):
            ctx_kept.append(c)
        else:
            ctx_notes.append(f"{c}: the KV cache cannot hold one request at TP {tps[-1]}")
    if not ctx_kept:
        raise UserError(
            f"--model {arch.name}: no context length of the {scenario.name} scenario fits ({'; '.join(ctx_notes)})"
        )
    ctx_why = f"section 12: {scenario.row.split(':')[0]}" + ("; dropped: " + "; ".join(ctx_notes) if ctx_notes else "")

    mem_kept, mem_notes = [], []
    for m in scenario.memory:
        if _plan(arch, hardware, tps[-1], min(ctx_kept), m, seqs_low).fits:
            mem_kept.append(m)
        else:
            mem_notes.append(f"{m}: leaves no KV pool")
    if not mem_kept:
        raise UserError(
            f"--model {arch.name}: no memory fraction of the {scenario.name} scenario leaves a KV pool ({'; '.join(mem_notes)})"
        )
    mem_why = ("section 12: offline batch may go to 0.97 (no latency to protect)" if max(scenario.memory) > 0.95
               else "section 12's range; above 0.95 only offline (section 4: keep a margin for peaks)")  # fmt: skip
    mem_why += "; dropped: " + "; ".join(mem_notes) if mem_notes else ""
    pairs = [(tp, c) for tp in tps for c in ctx_kept if not _plan(arch, hardware, tp, c, max(mem_kept), seqs_low).fits]
    return {
        "tensor_parallel_size": Choice(tps, tp_why),
        "max_model_len": Choice(ctx_kept, ctx_why),
        "gpu_memory_utilization": Choice(mem_kept, mem_why),
        "excluded": Choice(
            pairs, "TP and context pairs whose KV cache cannot hold one request at the highest memory fraction"
        ),
    }


def _price_line(gpu: str, price: float | None) -> str:
    """The space's price: ``--price`` as its ``price_per_device_hour`` (which overrides the price list for every
    GPU type), else none, so the shipped list prices the trials, and a comment citing what it lists for ``gpu``."""
    if price is not None:
        return f"price_per_device_hour: {price:g}   # USD per GPU-hour (--price): overrides the price list"
    listed = load_price_table().get(gpu)
    if listed is None:
        return (f"# price: the shipped price list has no {gpu}: set price_per_device_hour (USD per GPU-hour, or "
                "--price), else trials are costed at 1 USD")  # fmt: skip
    return (f"# price: from the shipped list, {listed.describe(gpu)}; "
            "price_per_device_hour (or --price) overrides it")  # fmt: skip


def render_space(model: str, scenario_name: str, gpu: str | None, gpus: int, slo: str | None = None,
                 price: float | None = None, name: str | None = None) -> str:  # fmt: skip
    """The search space's YAML text, every choice commented."""
    scenario = SCENARIOS.get(scenario_name)
    if scenario is None:
        raise UserError(f"--scenario {scenario_name}: known scenarios are {', '.join(SCENARIOS)}")
    if gpus < 1:
        raise UserError("--gpus must be at least 1")
    arch = load_model_arch(model)
    hardware = resolve_hardware("gpu", gpu)
    slo_text = slo if slo is not None else scenario.slo
    bounds = Slo.parse(slo_text, source="--slo")
    picks = choose(arch, hardware, scenario, gpus)
    seqs = _powers(*scenario.seqs)
    batched = _powers(*scenario.batched)
    space_name = name or f"{scenario.name}-{model.rstrip('/').split('/')[-1]}".lower().replace(".", "-").replace(
        "_", "-"
    )

    def dump(value: Any) -> str:
        if isinstance(value, str):
            return json.dumps(value)  # a YAML scalar, quoted
        return yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()

    slo_yaml: dict[str, Any] = {}
    for b in bounds.bounds:
        bound = int(b.limit) if float(b.limit).is_integer() and b.metric in LATENCY_METRICS else b.limit
        if b.lower:
            slo_yaml[b.metric] = {"min": bound}
        elif b.metric == "error_rate":
            slo_yaml["error_rate"] = bound
        else:
            slo_yaml.setdefault(b.metric, {})[b.stat] = bound
    lines = [
        f"# Made by `servetune init --model {model} --gpu {hardware.name} --gpus {gpus} --scenario {scenario.name}`.",
        f"# Starting point (checklist section 12): {scenario.row}.",
        "# Pruned by the memory ledger before anything runs; `servetune run THIS_FILE --dry-run` lists the trials.",
        f"name: {space_name}",
        f"description: {dump(f'{arch.name}, {scenario.description}, on {gpus}x {hardware.name}')}",
        f"model: {dump(model)}",
        "device: gpu",
        f"workload: {scenario.workload}                   # trials/workloads/{scenario.workload}.yaml",
        "load:",
        "  requests_per_level: auto      # 8 per client in flight, or 30 s of a rate",
        "  startup_timeout_s: auto       # sized from the checkpoint's bytes (load.weights_load_gbps) and compile time",
        f"slo: {dump(slo_yaml)}" + ("   # section 1's examples for this scenario; --slo replaces them" if slo is None else "   # --slo"),
        _price_line(hardware.name, price),
        "hardware:",
        f"  devices_per_node: {gpus}",
        f"  gpu: {hardware.name}",
        "  cpus_per_trial: 8             # the API server, the tokenizer and one core per GPU worker",
        "engine_args:",
        "  enable_chunked_prefill: true  # section 12: on for every scenario",
        "  enable_prefix_caching: true   # shared system prompts and templates, growing conversations",
        "params:",
        f"  tensor_parallel_size: {dump(picks['tensor_parallel_size'].values)}   # {picks['tensor_parallel_size'].why}",
        f"  max_model_len: {dump(picks['max_model_len'].values)}   # {picks['max_model_len'].why}",
        f"  gpu_memory_utilization: {dump(picks['gpu_memory_utilization'].values)}   # {picks['gpu_memory_utilization'].why}",
        f"  max_num_seqs: {{low: {scenario.seqs[0]}, high: {scenario.seqs[1]}, log: true}}   # {', '.join(map(str, seqs))} (sections 5 and 12)",
        f"  max_num_batched_tokens: {{low: {scenario.batched[0]}, high: {scenario.batched[1]}, log: true}}   # {', '.join(map(str, batched))} (sections 5 and 12)",
    ]  # fmt: skip
    if scenario.fp8_kv:
        lines.append(
            "  kv_cache_dtype: [auto, fp8]   # section 12: test the FP8 KV cache; the quality probe below guards it"
        )
    if scenario.structured_backends:
        lines.append(
            f"  structured_outputs_config.backend: {dump(list(scenario.structured_backends))}   # section 12: the "
            "workload's tool calls are JSON under a schema; each backend constrains decoding at its own cost"
        )
    if scenario.speculative_tokens:
        lines += [
            f"  {METHOD}: [none, ngram]   # the deployment guide: speculative decoding pays for decode-heavy traffic at "
            "low to mid concurrency; n-gram drafts from the prompt and the answer so far (no draft weights, no KV)",
            f"  {NUM_TOKENS}: {dump(list(scenario.speculative_tokens))}   # the guide's example drafts 3; "
            "too many lower the real speed, so one count above it",
        ]
    lines += [
        "constraints:",
        "  - tensor_parallel_size * data_parallel_size <= devices_per_node",
        "  - enable_chunked_prefill or max_num_batched_tokens >= max_model_len",
        "  - max_num_batched_tokens >= max_num_seqs",
        *(
            f"  - not (tensor_parallel_size == {tp} and max_model_len == {c})   # the ledger: TP {tp} cannot hold one {c}-token request"
            for tp, c in picks["excluded"].values
        ),
        "search:",
        "  algorithm: tpe                # Optuna's TPE with the SLO as constraints",
        "  num_trials: 24                # the baseline (vLLM's defaults) and 23 proposals",
        "  max_concurrent: auto          # fill the node's GPUs",
        f"  objectives: [{{metric: {scenario.objective[0]}, mode: {scenario.objective[1]}}}]",
        "  seed: 0",
    ]
    if picks["tensor_parallel_size"].values[0] > 1:
        lines.append("  baseline: false               # vLLM's default TP 1 cannot hold the model")
    if scenario.fp8_kv or scenario.speculative_tokens:
        reference = {"tensor_parallel_size": picks["tensor_parallel_size"].values[0],
                     "max_model_len": picks["max_model_len"].values[0],
                     "gpu_memory_utilization": picks["gpu_memory_utilization"].values[0],
                     "max_num_seqs": scenario.seqs[0], "max_num_batched_tokens": scenario.batched[0]}  # fmt: skip
        if scenario.fp8_kv:
            reference["kv_cache_dtype"] = "auto"
        if scenario.structured_backends:
            reference["structured_outputs_config.backend"] = scenario.structured_backends[0]
        if scenario.speculative_tokens:
            reference.update({METHOD: "none", NUM_TOKENS: scenario.speculative_tokens[0]})
    if scenario.fp8_kv:
        lines += [
            "# Section 4: an FP8 KV cache must be checked for long-context recall and structured output.",
            "quality:",
            "  suites: [agreement, recall, json, arithmetic]",
            f"  reference: {dump(reference)}   # BF16 KV, the smallest configuration",
            "  max_drop: {agreement: null, nll_delta: 0.1, recall: 0.02, json: 0.02, arithmetic: 0.02}",
        ]
    elif scenario.speculative_tokens:
        lines += [
            "# Speculative decoding is lossless: each speculative trial's greedy answers are compared with the reference's.",
            "quality:",
            "  suites: [agreement]",
            f"  reference: {dump(reference)}   # no speculation, the smallest configuration",
        ]
    return "\n".join(lines) + "\n"
