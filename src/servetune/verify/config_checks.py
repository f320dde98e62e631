"""Checks of the configuration and the study behind it (section 15: items 1-5, 7-10, 12, 13).

Each check takes the :class:`~servetune.verify.context.Context` and returns (status, evidence);
:mod:`servetune.verify.checklist` lists them in the seed's order.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from servetune.capacity import VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
from servetune.models.names import is_hub_id
from servetune.report.points import level_label
from servetune.results import REQUESTS_FILE, LevelResult, TrialResult
from servetune.tracking.fields import engine_setting
from servetune.tracking.inputs import read_request_stats
from servetune.verify import fingerprint
from servetune.verify.context import (
    FAIL,
    NOT_CHECKED,
    PASS,
    Context,
    Status,
    amount,
    flag,
    number,
    pct,
    to_float,
    value_order,
    verdict,
)

#: Section 4: an exclusive GPU runs at 0.90 to 0.95, never 1.
MAX_GPU_MEMORY_UTILIZATION = 0.95
#: Section 1's SLO example: peak memory below 95 %.
MEMORY_PEAK_LIMIT = 0.95
#: The issue: the recommended level run at least 5 times.
MIN_REPEATS = 5
CPU_KV_SPACE = "VLLM_CPU_KVCACHE_SPACE"


def weights_and_tokenizer_pinned(ctx: Context) -> tuple[Status, str]:
    model = ctx.result.model
    revision = ctx.result.engine_args.get("revision")
    found = fingerprint.locate(model, ctx.study_dir, revision)
    if found is None:
        pinned = (f" (revision {revision})" if revision else " (no revision pinned)") if is_hub_id(model) else ""
        return NOT_CHECKED, f"{model} is not on this disk{pinned}: hash its files where they are served"
    weights = fingerprint.weight_files(found.path)
    if not weights:
        return FAIL, f"no weight files (*.safetensors, *.bin, *.gguf) in {found.path} ({found.source})"
    tokenizer_arg = ctx.result.engine_args.get("tokenizer")
    tok_dir = found
    if isinstance(tokenizer_arg, str) and tokenizer_arg != model:
        located = fingerprint.locate(tokenizer_arg, ctx.study_dir, ctx.result.engine_args.get("tokenizer_revision"))
        if located is None:
            return NOT_CHECKED, f"the tokenizer {tokenizer_arg} is not on this disk"
        tok_dir = located
    tokenizer = fingerprint.tokenizer_files(tok_dir.path)
    if not tokenizer:
        return FAIL, f"no tokenizer files ({', '.join(fingerprint.TOKENIZER_FILES[:3])}...) in {tok_dir.path}"
    try:
        text = (f"weights {fingerprint.describe(fingerprint.hash_files(weights))}; tokenizer "
                f"{fingerprint.describe(fingerprint.hash_files(tokenizer))} ({found.source})")  # fmt: skip
    except OSError as exc:
        return NOT_CHECKED, f"cannot read the model's files in {found.path}: {exc.strerror or exc}"
    if found.source == "Hugging Face cache" and not revision:
        return FAIL, text + f"; but the launch names the hub id {model} without a revision: pin revision=<commit>"
    return PASS, text + (f"; revision {revision}" if revision else "")


#: Versions that pin the stack, by device (the CPU build has no driver, CUDA or NCCL).
STACK_KEYS = {"gpu": ("driver", "cuda", "nccl", "vllm"), "cpu": ("vllm", "torch")}
_UNKNOWN_VERSIONS = ("", "unknown", "not installed", "no NVIDIA GPU visible")


def stack_versions_pinned(ctx: Context) -> tuple[Status, str]:
    env = ctx.result.environment
    if not env:
        return NOT_CHECKED, "result.json has no environment record (a study from an older servetune)"
    keys = STACK_KEYS["gpu" if ctx.gpu else "cpu"]
    versions = ", ".join(f"{k} {env.get(k) or 'unknown'}" for k in keys)
    unknown = [k for k in keys if env.get(k, "") in _UNKNOWN_VERSIONS]
    if unknown:
        return FAIL, f"{', '.join(unknown)} not recorded: {versions}"
    for other in ctx.trials:
        if other.outcome == "COMPLETE" and other.environment and other.trial_id != ctx.result.trial_id:
            differs = [k for k in keys if other.environment.get(k) != env.get(k)]
            if differs:
                k = differs[0]
                return (
                    FAIL,
                    f"trials ran on different stacks: {k} {env.get(k)} here, {other.environment.get(k)} in trial {other.trial_id}",
                )
    verify_env = ctx.verify.get("environment") if ctx.verify is not None else None
    if isinstance(verify_env, Mapping):
        differs = [k for k in keys if k in verify_env and verify_env[k] != env.get(k)]
        if differs:
            k = differs[0]
            return FAIL, f"verify ran on {k} {verify_env[k]}, the study on {env.get(k)}"
    same = f"the same on the study's {sum(t.outcome == 'COMPLETE' for t in ctx.trials)} complete trials"
    same += " and verify" if isinstance(verify_env, Mapping) else ""
    cpu = "" if ctx.gpu else " (CPU build: no driver, CUDA or NCCL)"
    return PASS, f"{versions}{cpu}; {same}"


def quality_regression(ctx: Context) -> tuple[Status, str]:
    """The trial's quality probe against the study's reference (config/quality.py), else verify's, else not checked."""
    precision = (f"dtype {engine_setting(ctx.result, 'dtype') or 'default'}, quantization "
                 f"{engine_setting(ctx.result, 'quantization') or 'none'}, KV cache "
                 f"{engine_setting(ctx.result, 'kv_cache_dtype') or 'auto'}")  # fmt: skip
    probe = ctx.result.quality
    if probe is not None:
        scores = ", ".join(f"{name} {score:.0%}" for name, score in probe.suites.items())
        agreement = f"agreement {probe.agreement:.0%}" if probe.agreement is not None else ""
        measured = "; ".join(part for part in (agreement, scores) if part)
        if probe.reference_trial == ctx.result.trial_id:
            return PASS, f"{precision}: the study's quality reference ({measured})"
        if probe.passed:
            return PASS, f"{precision}: within every bound against reference trial {probe.reference_trial} ({measured})"
        return FAIL, f"{precision}: against reference trial {probe.reference_trial}: {'; '.join(probe.failures)}"
    quality = ctx.verify.get("quality") if ctx.verify is not None else None
    if isinstance(quality, Mapping) and flag(quality, "passed") is not None:
        return (PASS if quality["passed"] else FAIL), f"{precision}: quality probes {verdict(quality)}"
    return NOT_CHECKED, (f"{precision}: the study ran no quality probe (add a quality: section to the search space; "
                         "the business's own regression set can be a JSONL suite there)")  # fmt: skip


def input_length_from_distribution(ctx: Context) -> tuple[Status, str]:
    max_len = engine_setting(ctx.result, "max_model_len")
    if not isinstance(max_len, int):
        return NOT_CHECKED, "max_model_len was neither set nor read back from vLLM"
    stats = read_request_stats(ctx.study_dir / "trials" / ctx.result.trial_id / REQUESTS_FILE)
    if stats is None or stats.input_tokens is None:
        return NOT_CHECKED, f"max_model_len {max_len}; no {REQUESTS_FILE} in the trial directory to compare with"
    p99_in = stats.input_tokens.p99
    p99_out = stats.output_tokens.p99 if stats.output_tokens else 0.0
    measured = (
        f"the workload's P99 input {p99_in:,.0f} + P99 output {p99_out:,.0f} tokens ({stats.requests} requests sent)"
    )
    if "max_model_len" not in ctx.result.engine_args:
        return FAIL, f"max_model_len left to the model ({max_len}), not set from the distribution: {measured}"
    if p99_in + p99_out > max_len:
        return FAIL, f"max_model_len {max_len} is shorter than {measured}: P99 requests are refused"
    return PASS, (f"vLLM bounds input by max_model_len {max_len} (it has no separate max_input_tokens); "
                  f"{measured} = {p99_in + p99_out:,.0f}, {max_len / (p99_in + p99_out):.1f}x room")  # fmt: skip


def output_limited_by_server(ctx: Context) -> tuple[Status, str]:
    max_len = engine_setting(ctx.result, "max_model_len")
    if not isinstance(max_len, int):
        return NOT_CHECKED, "max_model_len was neither set nor read back from vLLM"
    if "max_model_len" not in ctx.result.engine_args:
        return FAIL, f"max_model_len left to the model ({max_len}): only the model's whole context bounds an answer"
    bound = (f"the server refuses any request whose prompt + max_tokens exceeds max_model_len {max_len}; "
             "a per-route max_new_tokens (section 3: chat <= 2048) belongs to the gateway")  # fmt: skip
    long_output, why = ctx.scenario("long_output")
    if long_output is None:
        return PASS, f"{bound}; very long outputs not tried ({why})"
    longest, limit = number(long_output, "max_output_tokens"), number(long_output, "limit_tokens")
    seen = f"very-long-output scenario: longest answer {amount(longest)} tokens, limit {amount(limit)}, {verdict(long_output)}"
    if flag(long_output, "passed") is False or (longest is not None and limit is not None and longest > limit):
        return FAIL, f"{seen}; {bound}"
    return PASS, f"{bound}; {seen}"


def memory_peak_margin(ctx: Context) -> tuple[Status, str]:
    level = ctx.level
    telemetry = level.telemetry if level is not None else {}
    env = ctx.result.environment
    headroom, _ = ctx.scenario("headroom")
    peak = number(headroom, "memory_peak_fraction")
    where = "under peak load"
    problems: list[str] = []
    if ctx.gpu:
        util = engine_setting(ctx.result, "gpu_memory_utilization")
        util_text = (
            f"gpu_memory_utilization {util:g}"
            if isinstance(util, (int, float))
            else (f"gpu_memory_utilization left to vLLM ({VLLM_DEFAULT_GPU_MEMORY_UTILIZATION:g})")
        )
        util = util if isinstance(util, (int, float)) else VLLM_DEFAULT_GPU_MEMORY_UTILIZATION
        if util > MAX_GPU_MEMORY_UTILIZATION:
            problems.append(f"{util_text} is above {MAX_GPU_MEMORY_UTILIZATION:g} (section 4)")
        total = to_float(env.get("gpu_memory_gib"))
        if level is not None and peak is None and total and "gpu_memory_used_gib_max" in telemetry:
            peak, where = telemetry["gpu_memory_used_gib_max"] / total, f"at {level_label(level.summary.level)}"
        setting = util_text
    else:
        total = to_float(env.get("host_memory_gib"))
        if level is not None and peak is None and total and "host_memory_used_gib_max" in telemetry:
            peak, where = telemetry["host_memory_used_gib_max"] / total, f"at {level_label(level.summary.level)}"
        space = ctx.result.env.get(CPU_KV_SPACE)
        setting = f"{CPU_KV_SPACE} {space} GiB" if space else f"{CPU_KV_SPACE} left to vLLM"
        setting += f" of {amount(total)} GiB host memory" if total else ""
    growth = number(ctx.scenario("soak")[0], "memory_growth_gib")
    soak = f"; memory grew {growth:+.2f} GiB over the soak" if growth is not None else ""
    if peak is None:
        if problems:
            return FAIL, "; ".join(problems)
        return NOT_CHECKED, f"{setting}; peak memory not sampled (no telemetry, no headroom scenario)"
    kind = "GPU" if ctx.gpu else "host"
    text = f"{setting}; {kind} memory peaked at {peak:.1%} {where}{soak}"
    if peak >= MEMORY_PEAK_LIMIT:
        problems.append(f"{kind} memory peaked at {peak:.1%} (limit {MEMORY_PEAK_LIMIT:.0%}, section 1)")
    return (FAIL, "; ".join(problems) + f" ({text})") if problems else (PASS, text)


def kv_covers_concurrency(ctx: Context) -> tuple[Status, str]:
    level = ctx.level
    if level is None or level.summary.completed <= 0:
        return NOT_CHECKED, "no measured level to take the target concurrency from"
    s = level.summary
    concurrency = s.level.get("concurrency")
    how = f"concurrency {concurrency:g}" if concurrency is not None else ""
    if concurrency is None and "rate" in s.level and s.e2el_ms.mean is not None:
        concurrency = s.level["rate"] * s.e2el_ms.mean / 1000.0  # Little's law
        how = f"rate {s.level['rate']:g} req/s x mean E2E {s.e2el_ms.mean / 1000:.2f} s = {concurrency:.1f} in flight"
    if concurrency is None:
        return NOT_CHECKED, f"the level {level_label(s.level)} names no concurrency or rate"
    sequence = (s.total_input_tokens + s.total_output_tokens) / s.completed
    needed = concurrency * sequence
    if needed <= 0:
        return NOT_CHECKED, f"{how} x mean sequence {sequence:,.0f} tokens needs no KV cache: nothing to compare"
    planned = ctx.result.capacity.kv_cache_tokens if ctx.result.capacity is not None else None
    if ctx.result.kv_capacity is not None:
        have = ctx.result.kv_capacity.tokens * max(ctx.result.kv_capacity.engines, 1)
        source = f"vLLM reported {have:,} KV tokens" + (f" (planner: {planned:,})" if planned else "")
    elif planned:
        have, source = planned, f"the planner predicted {planned:,} KV tokens (vLLM's log did not say)"
    else:
        return NOT_CHECKED, "neither vLLM's log nor the planner gave the KV capacity"
    preemptions = level.server_metrics.get("preemptions")
    kv_peak = level.server_metrics.get("kv_cache_usage_max")
    text = (f"{source}; {how} x mean sequence {sequence:,.0f} tokens = {needed:,.0f} needed "
            f"({have / needed:.1f}x covered)")  # fmt: skip
    text += f"; KV usage peaked at {kv_peak:.1%}" if kv_peak is not None else ""
    text += f"; {preemptions:g} preemptions" if preemptions is not None else ""
    if have < needed or (preemptions or 0) > 0:
        return FAIL, text
    return PASS, text


def _load_tested_values(ctx: Context, knob: str) -> dict[str, list[tuple[TrialResult, LevelResult]]]:
    """Per value of ``knob`` (as set or resolved), the complete trials' levels at the verified load."""
    target = ctx.level.summary.level if ctx.level is not None else None
    found: dict[str, list[tuple[TrialResult, LevelResult]]] = {}
    for trial in ctx.trials:
        if trial.outcome != "COMPLETE":
            continue
        value = engine_setting(trial, knob)
        for level in trial.levels:
            if level.summary.level == target and level.summary.completed > 0:
                found.setdefault("vLLM default" if value is None else f"{value}", []).append((trial, level))
    return found


def max_num_seqs_load_tested(ctx: Context) -> tuple[Status, str]:
    level = ctx.level
    if level is None:
        return NOT_CHECKED, "no measured level"
    seqs = engine_setting(ctx.result, "max_num_seqs")
    values = _load_tested_values(ctx, "max_num_seqs")
    running = level.server_metrics.get("requests_running_max")
    compared = f"the study measured max_num_seqs {', '.join(sorted(values, key=value_order))} at {level_label(level.summary.level)}"
    filled = isinstance(seqs, int) and running is not None and running >= seqs
    setting = f"max_num_seqs {seqs}" if seqs is not None else "max_num_seqs left to vLLM"
    batch = f"requests running peaked at {running:g} ({setting})" if running is not None else setting
    slo = "met the SLO" if level.meets_slo else "broke the SLO: " + "; ".join(level.slo_violations)
    repeats, why = ctx.scenario("repeats")
    runs = number(repeats, "runs")
    repeated = (
        f"repeats {verdict(repeats)} over {amount(runs)} runs" if repeats is not None else f"not repeated ({why})"
    )
    text = f"{batch}; {compared}; the level {slo}; {repeated}"
    if not level.meets_slo or (repeats is not None and flag(repeats, "passed") is False):
        return FAIL, text
    if repeats is not None and runs is not None and runs < MIN_REPEATS:
        return FAIL, text + f" (fewer than {MIN_REPEATS})"
    if len(values) < 2 and not filled:
        return FAIL, text + "; no other value was compared and the load never filled the batch"
    return PASS, text


def batched_tokens_trade_off(ctx: Context) -> tuple[Status, str]:
    if ctx.level is None:
        return NOT_CHECKED, "no measured level"
    if ctx.study is None:
        return NOT_CHECKED, f"the study's other trials could not be read: {ctx.study_problem}"
    values = _load_tested_values(ctx, "max_num_batched_tokens")
    mine = engine_setting(ctx.result, "max_num_batched_tokens")
    rows = []
    for value in sorted(values, key=value_order):
        best = min(values[value], key=lambda tl: tl[1].summary.ttft_ms.p99 or math.inf)[1].summary
        rows.append(f"{value}: TTFT P99 {amount(best.ttft_ms.p99, ' ms')} / TPOT P99 {amount(best.tpot_ms.p99, ' ms')}")
    where = level_label(ctx.level.summary.level)
    if len(values) < 2:
        only = ", ".join(values) or "none"
        return FAIL, f"only max_num_batched_tokens {only} measured at {where}: the TTFT/TPOT trade-off was not explored"
    return PASS, f"chosen {mine if mine is not None else 'vLLM default'}; best of each at {where}: " + "; ".join(rows)


def prefix_cache_monitored(ctx: Context) -> tuple[Status, str]:
    enabled = engine_setting(ctx.result, "enable_prefix_caching")
    if enabled is False:
        return PASS, "prefix caching is off in this configuration: there is no hit rate to watch"
    if ctx.level is None:
        return NOT_CHECKED, "no measured level"
    server = ctx.level.server_metrics
    if not server:
        return NOT_CHECKED, f"no /metrics counters recorded at {level_label(ctx.level.summary.level)}"
    if "prefix_cache_queries" not in server:
        return FAIL, "prefix caching is on but vLLM's /metrics had no vllm:prefix_cache_queries counter"
    rate = server.get("prefix_cache_hit_rate")
    return PASS, (f"vLLM exports vllm:prefix_cache_queries and _hits on /metrics; hit rate "
                  f"{pct(rate) if rate is not None else 'n/a'} of {server['prefix_cache_queries']:,.0f} tokens queried "
                  f"at {level_label(ctx.level.summary.level)}")  # fmt: skip


#: CUDA graph capture sizes, as vLLM's arguments name them.
_CAPTURE_KEYS = ("cuda_graph_sizes", "cudagraph_capture_sizes")


def cuda_graphs_frequent_shapes(ctx: Context) -> tuple[Status, str]:
    if not ctx.gpu:
        return NOT_CHECKED, "the CPU build has no CUDA graphs"
    if engine_setting(ctx.result, "enforce_eager") is True:
        return FAIL, "enforce_eager is true: no CUDA graphs at all (section 7: not a permanent fix)"
    sizes = _capture_sizes(ctx.result.engine_args)
    seqs = engine_setting(ctx.result, "max_num_seqs")
    running = ctx.level.server_metrics.get("requests_running_max") if ctx.level is not None else None
    seen = f"; requests running peaked at {running:g}" if running is not None else ""
    if not sizes:
        return NOT_CHECKED, (f"capture sizes left to vLLM (up to min(2 x max_num_seqs, 512)); pin "
                             f"compilation_config.cudagraph_capture_sizes to the batch sizes the load reaches{seen}")  # fmt: skip
    span = f"up to {sizes[0]}" if len(sizes) == 1 else f"{min(sizes)} to {max(sizes)} ({len(sizes)} shapes)"
    text = f"captures batch sizes {span}, max_num_seqs {seqs}{seen}"
    if isinstance(seqs, int) and max(sizes) > seqs:
        return FAIL, text + ": shapes above max_num_seqs are never run and cost memory"
    return PASS, text


def _capture_sizes(engine_args: Mapping[str, Any]) -> list[int]:
    sources = [engine_args]
    config = engine_args.get("compilation_config")
    if isinstance(config, str):
        try:
            config = json.loads(config)
        except ValueError:
            config = None
    if isinstance(config, Mapping):
        sources.append(config)
    for source in sources:
        for key in _CAPTURE_KEYS:
            value = source.get(key)
            if isinstance(value, int) and not isinstance(value, bool):
                return [value]
            if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
                return sorted(value)
    return []
