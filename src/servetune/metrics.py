"""Metric names and definitions, in one place.

Names follow ``vllm bench serve``: ``ttft_ms_p99``, ``tpot_ms_mean``, ``output_throughput``...
Every module that writes or reads a metric uses the constants and types here.

Definitions (per request):

- TTFT: request sent -> first content chunk.
- TPOT: (E2EL - TTFT) / (output tokens - 1); undefined for a single output token.
- ITL: the gaps between consecutive content chunks (all gaps of all requests are pooled).
- E2EL: request sent -> last chunk.
- Output tokens come from the server's ``usage`` (``stream_options.include_usage``), not
  from counting chunks.

What a level's requests add up to (its latency statistics, throughputs, goodput, what the ladder judges
saturation on) is computed in :mod:`servetune.summary` from the :class:`RequestRecord` defined here.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

#: Latency metrics measured per request, in milliseconds.
LATENCY_METRICS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
#: Statistics reported for each latency metric.
STATS = ("mean", "p50", "p90", "p95", "p99")
PERCENTILES = {"p50": 50.0, "p90": 90.0, "p95": 95.0, "p99": 99.0}
#: Latency metrics that a single request can be held to (goodput). ITL is a level-wide pool.
PER_REQUEST_METRICS = ("ttft_ms", "tpot_ms", "e2el_ms")
#: The names code refers to by name (a flat name is ``<latency metric>_<stat>``).
GOODPUT = "goodput"
REQUEST_THROUGHPUT = "request_throughput"
OUTPUT_THROUGHPUT = "output_throughput"
ERROR_RATE = "error_rate"
TTFT_P99 = "ttft_ms_p99"
TPOT_P99 = "tpot_ms_p99"
E2EL_P99 = "e2el_ms_p99"
#: Level-wide metrics that are not latencies.
RATE_METRICS = (
    REQUEST_THROUGHPUT,
    OUTPUT_THROUGHPUT,
    "input_throughput",
    "total_token_throughput",
    GOODPUT,
    ERROR_RATE,
)
COST_METRIC = "cost_per_mtok_usd"
#: The share of a level's completed structured-output requests whose answers parsed as asked (0..1).
STRUCTURED_VALID = "structured_valid"
#: Vision-language workloads: the images a level's measured requests carried, and their pixels in all (absent where
#: none carried one; ``LevelSummary.images_sent`` / ``image_pixels``).
IMAGES_SENT = "images_sent"
IMAGE_PIXELS = "image_pixels"
IMAGE_METRICS = (IMAGES_SENT, IMAGE_PIXELS)
#: Joules the trial's devices drew over a level's measured window (warm-up left out), per output token and per
#: completed request: its GPUs' energy (NVML) on GPUs, the host's CPU packages' (RAPL) on the CPU stand-in.
#: Absent where the energy could not be measured (``LevelResult.energy_note`` says why).
ENERGY_PER_TOKEN = "energy_per_token"
ENERGY_PER_REQUEST = "energy_per_request"
ENERGY_METRICS = (ENERGY_PER_TOKEN, ENERGY_PER_REQUEST)
#: The telemetry keys of the measured window's energy (telemetry.py), by the device a trial reserves.
MEASURED_ENERGY = {"gpu": "gpu_energy_measured_j", "cpu": "cpu_energy_measured_j"}

#: Speculative decoding over a level, from vLLM's counters (engine/metrics.py): verification steps that
#: carried a draft, tokens drafted, drafted tokens the target model accepted.
SPEC_DRAFTS = "spec_decode_drafts"
SPEC_DRAFT_TOKENS = "spec_decode_draft_tokens"
SPEC_ACCEPTED_TOKENS = "spec_decode_accepted_tokens"
#: Accepted / drafted tokens (0..1).
SPEC_ACCEPTANCE_RATE = "spec_decode_acceptance_rate"
#: Tokens a verification step yields, 1 + accepted tokens / drafts (vLLM's "mean acceptance length",
#: the bonus token included): 1 is no gain, 1 + num_speculative_tokens every draft accepted.
SPEC_MEAN_ACCEPTED_LENGTH = "spec_decode_mean_accepted_length"


def spec_accepted_at(position: int) -> str:
    """Accepted tokens at a draft position (0: the first drafted token) over a level."""
    return f"{SPEC_ACCEPTED_TOKENS}_pos{position}"


def spec_acceptance_at(position: int) -> str:
    """The share of drafts whose token at ``position`` was accepted (vLLM's per-position acceptance rate)."""
    return f"{SPEC_ACCEPTANCE_RATE}_pos{position}"


#: Multi-turn levels (workloads with sessions), per conversation (summary.ConversationStats): its TTFT as the mean
#: of its turns' and as its worst turn's, and its E2E from its first turn sent to its last turn's end, the think
#: times between turns included. Flat names are ``<name>_<stat>`` (``conversation_e2el_ms_p99``).
CONVERSATION_TTFT = "conversation_ttft_ms"
CONVERSATION_TTFT_WORST = "conversation_ttft_worst_ms"
CONVERSATION_E2EL = "conversation_e2el_ms"
CONVERSATION_METRICS = (CONVERSATION_TTFT, CONVERSATION_TTFT_WORST, CONVERSATION_E2EL)


def turn_prompt_tokens(turn: int) -> str:
    """The mean prompt tokens of a multi-turn level's turns at position ``turn`` (1: the first turn)."""
    return f"conversation_turn{turn}_prompt_tokens"


def turn_cache_hit_rate(turn: int) -> str:
    """The prefix-cache hit rate of the turns at position ``turn`` (1: the first): cached over prompt tokens."""
    return f"conversation_turn{turn}_cache_hit_rate"


#: The engine signals a Serve replica records for the predictive autoscaling policy (``record_autoscaling_stats``):
#: its engines' requests waiting and its fullest engine's KV-cache usage (0..1). serve/replica.py records them,
#: report/autoscale_policy.py reads them; here, so that a replica need not import report/.
WAITING_METRIC = "num_requests_waiting"
KV_METRIC = "kv_cache_usage"

#: Derived rates for reports: output tok/s per reserved device, and one user's streaming speed
#: (1000 / mean TPOT, in output tok/s).
OUTPUT_THROUGHPUT_PER_DEVICE = "output_throughput_per_device"
OUTPUT_THROUGHPUT_PER_USER = "output_throughput_per_user"


def not_honoured_metric(ask: str) -> str:
    """The answers of a level that lacked ``ask`` (``n``, ``logprobs``: ``LevelSummary.not_honoured``), a count."""
    return f"not_honoured_{ask}"


def metric_names() -> list[str]:
    """Every flat metric name a level summary has (the keys of :meth:`servetune.summary.LevelSummary.flat`)."""
    names = [f"{m}_{s}" for m in LATENCY_METRICS for s in STATS]
    return names + list(RATE_METRICS)


def energy_per(energy_j: float | None, count: float) -> float | None:
    """Joules per token (or request): None without an energy or a count to divide it by."""
    if energy_j is None or count <= 0:
        return None
    return energy_j / count


def cost_per_mtok_usd(price_per_gpu_hour: float, gpus: int, output_throughput: float) -> float:
    """USD per million output tokens: price per GPU-hour x GPUs / (output tok/s x 3600) x 1e6."""
    if output_throughput <= 0:
        return float("inf")
    return price_per_gpu_hour * gpus / (output_throughput * 3600.0) * 1e6


@dataclass(slots=True)
class RequestRecord:
    """What the client saw of one request. Times are seconds on the level's clock."""

    index: int
    sent: float
    input_tokens: int  # what the workload asked for
    max_tokens: int
    warmup: bool = False
    request_class: str = ""
    scheduled: float | None = None  # an open loop's: when it was due to be sent (load/pace.py, its send lag)
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    end: float | None = None
    prompt_tokens: int | None = None  # from the server's usage
    output_tokens: int | None = None  # from the server's usage
    ok: bool = False
    error_kind: str | None = None  # http_4xx, http_5xx, timeout, connection, ...
    error: str | None = None
    structured_valid: bool | None = None  # it asked for structured output: whether the answer parsed as asked
    not_honoured: list[str] | None = (
        None  # what it asked that its answer lacked: n (choices), logprobs (load/client.py)
    )
    session: int | None = None  # the conversation it is a turn of (workloads with sessions), and which turn
    turn: int = 0
    cached_tokens: int | None = None  # of its prompt, the tokens the server's prefix cache held (where it says)
    adapter: str | None = None  # the LoRA adapter it named as its model (workloads with adapters)
    images: int = 0  # the images it carried (vision-language workloads), and their pixels in all
    image_pixels: int = 0

    @property
    def ttft_s(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def e2el_s(self) -> float | None:
        return self.end - self.sent if self.end is not None else None

    @property
    def tpot_s(self) -> float | None:
        ttft, e2el, n = self.ttft_s, self.e2el_s, self.output_tokens
        if ttft is None or e2el is None or not n or n < 2:
            return None
        return (e2el - ttft) / (n - 1)

    def itls_s(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in itertools.pairwise(t)]

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(ttft_ms=_ms(self.ttft_s), tpot_ms=_ms(self.tpot_s), e2el_ms=_ms(self.e2el_s))
        return d


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


#: The percentiles a level keeps of its TTFTs, to draw their distribution (0, 5, ..., 100).
DISTRIBUTION_PERCENTILES = tuple(range(0, 101, 5))
