"""The tuning checklist's acceptance list (section 15), evaluated item by item with its evidence.

:func:`evaluate` gives each of the 23 items a status, PASS, FAIL or NOT CHECKED, and the
evidence: a measured value, a configuration field, a log line, or why it cannot be checked here
(it needs production data, the deployment around vLLM, or a person). Items keep the list's order
and are numbered ``15.1`` to ``15.23`` as in the seed (``ITEMS`` holds the original wording).

What it reads:

- the verified trial's ``TrialResult`` (levels, server counters, telemetry, capacity, vLLM's
  reported KV tokens, the environment record) and its directory (``requests.jsonl``);
- the study directory: ``study.json`` and the other trials (what the search compared, the
  out-of-memory neighbours of ``report/recommend.py``), the model's files (hashed);
- ``verify`` (verify.json's content, or None when verify did not run): ``level`` (the verified
  level: its index in ``result.levels``, or its load as ``{"concurrency": 8}``; default the
  trial's best level), ``environment`` (optional: the stack verify ran on, same keys as
  ``result.environment``), ``quality`` (optional: ``{passed, reason}``), ``stability`` and
  ``scenarios``. Every scenario may carry ``passed`` (bool) and ``reason`` (text); the numbers read:

  ==============  ==========================================================================
  soak            ``p99_ttft_ms_windows`` (P99 TTFT of each window in order, the first window
                  starting with the first request after /health answered, no warm-up left
                  out), ``window_s``, ``memory_growth_gib`` (engine memory, end minus start)
  peak            ``requests_waiting_max`` (vLLM's waiting requests at 1.25x the level)
  burst           ``passed`` and ``reason`` only
  mix             ``long_input_tokens`` (the long requests' prompt length), ``long_share``,
                  ``short_ttft_p99_ms`` (short requests among long ones),
                  ``baseline_ttft_p99_ms`` (the same requests without long ones: the soak's)
  long_output     ``max_output_tokens`` (longest output the server produced),
                  ``limit_tokens`` (the server's output limit the scenario asked up to)
  disconnects     ``dropped`` (streams dropped), ``running_fell_back`` (bool: vLLM's running
                  and waiting requests fell back to the surviving load), ``fallback_s``,
                  ``cancellation_success_rate`` (0..1)
  headroom        ``kv_usage_peak`` (0..1 at peak), ``preemptions`` (count at peak),
                  ``memory_peak_fraction`` (device memory, or host memory on CPU, 0..1)
  repeats         ``runs``, ``lead_is_real`` (bool; absent without a runner-up)
  replica_lost    (opt-in, through Serve) ``replaced`` (bool), ``replaced_s``, ``recovered`` (bool),
                  ``recovery_s``, ``failed``, ``error_burst_s``, ``survivor_ttft_ms_p99``,
                  ``ttft_bound_ms``, ``window_s``: item 15.20's second half (the replacement)
  rolling_update  (opt-in, through Serve) ``rolled_out`` (bool), ``update_s``, ``change``, ``failed``,
                  ``requests_during``, ``ttft_ms_max_during``, ``ttft_ms_p99_during``, ``ttft_bound_ms``,
                  ``ttft_ms_p99_after``, ``passed``: item 15.23's rollback half (a change rolled out under load)
  canary          (opt-in, through Serve) ``judged`` (bool), ``regressed`` (metric names), ``passed`` and
                  ``reason`` (each share's P99s and the differences with their intervals): item 15.23
  stability       ``cancellation_success_rate``, ``p99_jitter``, ``oom`` (bool), ``error_rate_5xx``
  ==============  ==========================================================================

A scenario that is missing, or a number it lacks, makes the items that need it NOT CHECKED with
that reason, never an error. For a study plus verify on the CPU stand-in, 17 items are
evaluated (PASS or FAIL); the six NOT CHECKED ones need a person or the deployment around
vLLM: quality regression (15.3), CUDA graphs and GPU telemetry (15.13, 15.18, GPU only),
per-user limits (15.16), autoscaling (15.19), canary and rollback (15.23; evaluated where verify ran
``--scenario canary`` or ``--scenario rolling_update``, its rollback half). Item 15.15 (a hard
queue limit) FAILs for plain vLLM, which has none: the fix is named in its evidence, so a
verdict that gates on the configuration leaves that item to the deployment.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from servetune.errors import UserError
from servetune.report.study import load_study
from servetune.results import TrialResult, chosen_level
from servetune.verify.config_checks import (
    batched_tokens_trade_off,
    cuda_graphs_frequent_shapes,
    input_length_from_distribution,
    kv_covers_concurrency,
    max_num_seqs_load_tested,
    memory_peak_margin,
    output_limited_by_server,
    prefix_cache_monitored,
    quality_regression,
    stack_versions_pinned,
    weights_and_tokenizer_pinned,
)
from servetune.verify.context import FAIL, NOT_CHECKED, PASS, Check, Context, Status
from servetune.verify.load_checks import (
    autoscaling_signals,
    cancellation_frees_work,
    changes_canary_rollback,
    chunked_prefill_long_prompts,
    device_monitored,
    hard_queue_limit,
    latency_monitored,
    long_short_pools_decided,
    oom_notch_back,
    per_user_limits,
    stress_scenarios_passed,
    warm_before_traffic,
)

__all__ = ["FAIL", "ITEMS", "NOT_CHECKED", "PASS", "ChecklistItem", "Status", "evaluate", "verified_level"]


class ChecklistItem(BaseModel):
    id: str  # "15.1" .. "15.23": section 15's items in order
    text: str  # the item in English
    status: Status
    evidence: str


#: Section 15 in order: (id, the item in English, the seed's wording, its check).
ITEMS: tuple[tuple[str, str, str, Check], ...] = (
    (
        "15.1",
        "Model version, weight hashes and tokenizer version are pinned.",
        "模型版本、权重哈希和Tokenizer版本固定。",
        weights_and_tokenizer_pinned,
    ),
    (
        "15.2",
        "Driver, CUDA, NCCL and inference engine versions are pinned.",
        "驱动、CUDA、NCCL和推理引擎版本固定。",
        stack_versions_pinned,
    ),
    (
        "15.3",
        "The BF16, FP16 or quantized model passes the business quality regression.",
        "BF16、FP16或量化模型通过业务质量回归。",
        quality_regression,
    ),
    (
        "15.4",
        "max_input_tokens is set from the real distribution.",
        "max_input_tokens按真实分布设置。",
        input_length_from_distribution,
    ),
    ("15.5", "max_new_tokens is limited by the server.", "max_new_tokens由服务端限制。", output_limited_by_server),
    (
        "15.6",
        "Whether long- and short-context requests get separate pools is decided.",
        "长短上下文请求已决定是否分池。",
        long_short_pools_decided,
    ),
    (
        "15.7",
        "GPU memory utilization keeps a safety margin for the peak.",
        "显存利用率保留峰值安全余量。",
        memory_peak_margin,
    ),
    ("15.8", "KV cache capacity covers the target concurrency.", "KV Cache容量覆盖目标并发。", kv_covers_concurrency),
    ("15.9", "max_num_seqs has been through a real load test.", "max_num_seqs经过真实压测。", max_num_seqs_load_tested),
    (
        "15.10",
        "max_num_batched_tokens is chosen by weighing TTFT against TPOT.",
        "max_num_batched_tokens经过TTFT和TPOT权衡。",
        batched_tokens_trade_off,
    ),
    (
        "15.11",
        "Chunked prefill is tested with real long prompts.",
        "Chunked Prefill经过真实长Prompt测试。",
        chunked_prefill_long_prompts,
    ),
    ("15.12", "The prefix cache hit rate is monitored.", "Prefix Cache命中率有监控。", prefix_cache_monitored),
    (
        "15.13",
        "CUDA graphs cover only the frequent shapes.",
        "CUDA Graph只覆盖高频shape。",
        cuda_graphs_frequent_shapes,
    ),
    ("15.14", "A client's cancellation frees its generation.", "客户端取消能释放生成任务。", cancellation_frees_work),
    ("15.15", "The request queue has a hard limit.", "请求队列有硬上限。", hard_queue_limit),
    ("15.16", "RPS, concurrency and tokens are limited per user.", "按用户限制RPS、并发和token。", per_user_limits),
    ("15.17", "TTFT, TPOT, queue time and P99 are monitored.", "监控TTFT、TPOT、排队时间和P99。", latency_monitored),
    (
        "15.18",
        "GPU memory, utilization, temperature, power and hardware errors are monitored.",
        "监控显存、利用率、温度、功耗和硬件错误。",
        device_monitored,
    ),
    (
        "15.19",
        "Autoscaling does not rely on GPU utilization alone.",
        "自动扩容不只依赖GPU利用率。",
        autoscaling_signals,
    ),
    (
        "15.20",
        "A new instance takes traffic only after it has warmed up.",
        "新实例完成预热后再接流量。",
        warm_before_traffic,
    ),
    (
        "15.21",
        "Peak, burst, long/short mix and disconnect load tests pass.",
        "通过峰值、突发、长短混合和断连压测。",
        stress_scenarios_passed,
    ),
    (
        "15.22",
        "The shipped configuration is at least one safety notch back from the OOM boundary.",
        "上线配置比OOM边界至少回退一个安全档位。",
        oom_notch_back,
    ),
    (
        "15.23",
        "Configuration changes support canary release and rollback, linked to performance data.",
        "配置变更支持灰度、回滚并关联性能数据。",
        changes_canary_rollback,
    ),
)


def verified_level(result: TrialResult, verify: Mapping[str, Any] | None) -> int | None:
    """The level verify ran at: ``verify["level"]`` as an index or a load, else the trial's best level."""
    wanted = verify.get("level") if verify is not None else None
    if isinstance(wanted, int) and not isinstance(wanted, bool) and 0 <= wanted < len(result.levels):
        return wanted
    if isinstance(wanted, Mapping):
        for index, level in enumerate(result.levels):
            if level.summary.level == {k: float(v) for k, v in wanted.items() if isinstance(v, (int, float))}:
                return index
    chosen = chosen_level(result)
    return chosen.index if chosen is not None else None


def evaluate(study_dir: Path, result: TrialResult, verify: dict | None) -> list[ChecklistItem]:
    """Every item of section 15, in order, with its status and evidence (see the module docstring)."""
    study_dir = Path(study_dir)
    try:
        study, problem = load_study(study_dir, skip_unreadable=True), ""
    except UserError as exc:
        study, problem = None, str(exc)
    ctx = Context(study_dir, result, verify if isinstance(verify, Mapping) else None, study, problem,
                  verified_level(result, verify if isinstance(verify, Mapping) else None))  # fmt: skip
    items = []
    for item_id, text, _, check in ITEMS:
        status, evidence = check(ctx)
        items.append(ChecklistItem(id=item_id, text=text, status=status, evidence=evidence))
    return items
