"""Workloads: what requests look like and how they arrive (``trials/workloads/*.yaml``).

Token lengths come from distributions (fixed, uniform, normal, lognormal, each bounded, or
empirical from a JSONL file). A workload is either one request class (``input_tokens`` and
``output_tokens``) or a weighted ``mix`` of classes (long/short mixes). ``shared_prefix``
makes a fraction of requests start with the same N tokens (prefix-cache scenarios); the input
length is the whole prompt, prefix included.

``sessions`` makes multi-turn conversations: each turn's prompt is the conversation so far (the
earlier prompts and answers) followed by a new message of ``input_tokens``, sent ``think_time_s``
after the previous answer ended. ``arrival: {process: trace, file: LOG.jsonl}`` replays a request
log's send times (``servetune workload from-log`` writes workloads from such logs).

``text`` says what prompts are made of: ``random`` words of the served model's vocabulary (the
default), ``corpus`` (passages of the public-domain English text servetune ships,
``trials/corpus/``), or a UTF-8 text file of the user's (relative to the workload file) that
prompts are cut from. Lengths stay the workload's either way.

``structured`` (a workload's, or a request class's own; config/asks.py) asks for structured output: a JSON schema, one of a
list of choices, a regular expression, or a grammar. It goes into the body as vLLM's OpenAI server reads it
(``response_format`` with the schema, else ``structured_outputs``); such a request ends where its structure
ends (``ignore_eos`` off), and the client counts the answers that parsed as asked (``structured_valid``).

``adapters`` (config/adapters.py) lists LoRA adapters, ``{name, path, weight}``: each request (each conversation,
with sessions) draws one by weight and sends its name as the request's ``model``; the engine gets
``enable_lora`` and ``lora_modules`` unless the space sets them.

``images`` (config/images.py; a workload's, or a request class's own) makes each request carry images for a
vision-language model: a count and sizes, sent as chat ``image_url`` content parts (``api: chat`` only).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationInfo, field_validator, model_validator

from servetune.config.adapters import Adapter, adapter_modules, check_adapters, lora_engine_args
from servetune.config.asks import Sampling, Structured
from servetune.config.dists import Dist, Empirical, Fixed, LogNormal, Normal, Uniform, _Dist
from servetune.config.images import Images
from servetune.config.loading import load_yaml_model
from servetune.errors import UserError
from servetune.shipped import trials_dir
from servetune.traffic.log import read_log

if TYPE_CHECKING:
    from servetune.capacity.model import VisionEncoder

__all__ = ["Dist", "Empirical", "Fixed", "LogNormal", "Normal", "Uniform"]  # their home is config/dists.py


class RequestClass(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "default"
    weight: float = Field(default=1.0, gt=0)
    input_tokens: Dist
    output_tokens: Dist
    sampling: Sampling | None = None  # over the workload's ``sampling``
    structured: Structured | None = None  # over the workload's ``structured``
    images: Images | None = None  # over the workload's ``images`` (vision-language models, chat API)


class SharedPrefix(BaseModel):
    """``fraction`` of the requests start with a shared prefix of ``tokens`` tokens. With
    ``groups`` > 1 there are that many distinct prefixes (system prompts of several tenants or
    apps, documents), the k-th drawn with a weight of k^-``popularity`` (Zipf; 0: all alike)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tokens: int = Field(ge=1)
    fraction: float = Field(default=1.0, gt=0, le=1)
    groups: int = Field(default=1, ge=1, le=10_000)
    popularity: float = Field(default=1.0, ge=0)

    def group_weights(self) -> np.ndarray:
        weights = np.arange(1, self.groups + 1, dtype=float) ** -self.popularity
        return weights / weights.sum()


class Arrival(BaseModel):
    """How requests (or, with ``sessions``, conversations) arrive at a level.

    ``concurrency``: a closed loop of N clients, each sending its next request when the last
    one ends. ``poisson``: open loop at a rate (exponential gaps). ``gamma``: open loop whose
    gaps are gamma-distributed; ``burstiness`` < 1 is burstier than Poisson, 1 is Poisson.
    ``trace``: open loop that sends at the times recorded in ``file`` (a request log, relative to
    the workload file), ``speedup`` times faster; its levels are speed-ups (see
    ``load.runner.workload_levels``). With sessions, the trace times each conversation's start.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    process: Literal["concurrency", "poisson", "gamma", "trace"] = "concurrency"
    burstiness: float = Field(default=1.0, gt=0)
    levels: tuple[float, ...] | None = None  # default levels (concurrencies, rates, or a trace's speed-ups)
    file: Path | None = None  # trace: the request log to replay
    speedup: float = Field(default=1.0, gt=0)  # trace: the level when no levels are given
    _times: tuple[float, ...] = PrivateAttr(default=())  # trace: every request's send time, from 0
    _starts: tuple[float, ...] = PrivateAttr(default=())  # trace: every conversation's first send

    @field_validator("levels")
    @classmethod
    def _positive(cls, levels: tuple[float, ...] | None) -> tuple[float, ...] | None:
        if levels is not None and (not levels or min(levels) <= 0):
            raise ValueError("levels must be a non-empty list of positive numbers")
        return levels

    @model_validator(mode="after")
    def _read_trace(self, info: ValidationInfo) -> Arrival:
        if self.process != "trace":
            if self.file is not None:
                raise ValueError("file is for process: trace")
            return self
        if self.file is None:
            raise ValueError("process: trace needs file: the request log to replay")
        base = Path((info.context or {}).get("base_dir", "."))
        path = self.file if self.file.is_absolute() else base / self.file
        try:
            requests = read_log(path)
        except UserError as exc:
            raise ValueError(str(exc)) from None
        first = requests[0].time_s
        seen: set[str] = set()
        starts = []
        for r in requests:
            if r.session is None or r.session not in seen:
                starts.append(r.time_s - first)
            if r.session is not None:
                seen.add(r.session)
        self._times = tuple(r.time_s - first for r in requests)
        self._starts = tuple(starts)
        if self._times[-1] <= 0:
            raise ValueError(f"{path}: every request has the same time: nothing to replay")
        return self

    def trace_times(self, sessions: bool = False) -> tuple[float, ...]:
        """A trace's send times in seconds from its first (conversations' first turns with ``sessions``)."""
        return self._starts if sessions else self._times


class ThinkFixed(_Dist):
    dist: Literal["fixed"]
    value: float = Field(ge=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.full(n, self.value, dtype=float)


class ThinkUniform(_Dist):
    dist: Literal["uniform"]
    min: float = Field(default=0.0, ge=0)
    max: float = Field(ge=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.uniform(self.min, self.max, size=n)


class ThinkExponential(_Dist):
    dist: Literal["exponential"]
    mean: float = Field(gt=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return rng.exponential(self.mean, size=n)


class ThinkLogNormal(_Dist):
    dist: Literal["lognormal"]
    median: float = Field(gt=0)
    sigma: float = Field(gt=0)
    max: float | None = Field(default=None, gt=0)

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        values = rng.lognormal(np.log(self.median), self.sigma, size=n)
        return values if self.max is None else np.minimum(values, self.max)


#: Seconds (think times): fixed, uniform, exponential or lognormal.
Seconds = Annotated[ThinkFixed | ThinkUniform | ThinkExponential | ThinkLogNormal, Field(discriminator="dist")]


class Sessions(BaseModel):
    """Multi-turn conversations.

    A conversation has ``turns`` turns. Its first prompt is drawn as any request's; every later
    prompt is the conversation so far (earlier prompts, then each answer as text of its output
    length) followed by a new message of ``input_tokens`` (the sessions' own, when given, else
    the request class's), and is sent ``think_time_s`` seconds
    after the previous answer ended. So a later turn's prompt starts with the previous one: what a
    prefix cache reuses in real chat. A conversation whose next prompt and answer would pass
    ``max_context_tokens`` ends there. The answers in later prompts are servetune's text, not what
    the model said: the cache can reuse the earlier prompts, not the generated tokens.
    Concurrency levels count conversations in flight; rates count conversations started a second.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    turns: Dist
    think_time_s: Seconds = ThinkFixed(dist="fixed", value=0.0)
    max_context_tokens: int | None = Field(default=None, ge=2)
    input_tokens: Dist | None = None  # later turns' new messages (default: the request class's input_tokens)
    output_tokens: Dist | None = None  # later turns' answers (default: the request class's output_tokens)


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    seed: int = 0
    api: Literal["completions", "chat"] = "completions"
    input_tokens: Dist | None = None
    output_tokens: Dist | None = None
    mix: tuple[RequestClass, ...] | None = None
    shared_prefix: SharedPrefix | None = None
    arrival: Arrival = Arrival()
    sessions: Sessions | None = None
    ignore_eos: bool = True  # hold output lengths to what the workload asked for
    temperature: float = Field(default=0.0, ge=0)
    # What prompts are made of: "random" vocabulary words (the default, which the recorded studies measured),
    # "corpus" (the shipped public-domain English text: what n-gram speculation needs to find repeats), or a
    # UTF-8 text file (relative to the workload file) to cut prompts from.
    text: str = Field(default="random", min_length=1)
    # How requests sample (each class's own ``sampling`` over this): top_p, top_k, n, logprobs, stop...
    sampling: Sampling = Sampling()
    # Structured output every request asks for (a class's own ``structured`` over this); None: free text.
    structured: Structured | None = None
    # LoRA adapters requests name as their model, each drawn by weight (config/adapters.py); empty: the base model.
    adapters: tuple[Adapter, ...] = ()
    # Images every request carries (a class's own ``images`` over this; config/images.py); None: text only.
    images: Images | None = None
    _source_text: str | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _adapters_differ(self) -> Workload:
        check_adapters(self.adapters)
        return self

    def adapter_engine_args(self, engine_args: dict[str, Any], build_dir: Path) -> dict[str, Any]:
        """``engine_args`` with what serving this workload's adapters needs (``enable_lora``, ``lora_modules``,
        a ``max_lora_rank`` that holds them) where they are unset; the tiny adapter is built into ``build_dir``."""
        if not self.adapters:
            return dict(engine_args)
        modules = adapter_modules(self.adapters, build_dir)
        return lora_engine_args(engine_args, modules, max(a.rank for a in self.adapters))

    def measured_engine_args(self, engine_args: dict[str, Any]) -> dict[str, Any]:
        """``engine_args`` as a bare ``vllm serve`` measuring this workload starts with: with ``sessions``, vLLM
        reports each answer's cached prompt tokens (``enable_prompt_tokens_details``, off by default), so a level's
        prefix-cache hit rate per turn is measured rather than "not reported"; a value the space set stands. Not a
        configuration choice: the trial's id and its exported command keep the space's own arguments."""
        if self.sessions is None or "enable_prompt_tokens_details" in engine_args:
            return dict(engine_args)
        return {**engine_args, "enable_prompt_tokens_details": True}

    @model_validator(mode="after")
    def _sampling_once(self) -> Workload:
        for name in ("temperature", "ignore_eos"):
            if name in self.model_fields_set and getattr(self.sampling, name) is not None:
                raise ValueError(f"sampling.{name}: {name} is given twice (here and at the top of the workload)")
        return self

    @model_validator(mode="after")
    def _structured_ends(self) -> Workload:
        for index, request_class in enumerate(self.mix or ()):
            sampling = request_class.sampling.over(self.sampling) if request_class.sampling else self.sampling
            if self.structured_of(request_class) is not None and sampling.ignore_eos:
                where = (
                    f"mix.{index}.sampling"
                    if request_class.sampling and request_class.sampling.ignore_eos
                    else "sampling"
                )
                raise ValueError(
                    f"{where}.ignore_eos: a request with structured output ends where its structure ends: leave ignore_eos off"
                )
        if self.structured is not None and self.sampling.ignore_eos:
            raise ValueError(
                "sampling.ignore_eos: a request with structured output ends where its structure ends: leave ignore_eos off"
            )
        if self.structured is not None and "ignore_eos" in self.model_fields_set and self.ignore_eos:
            raise ValueError(
                "ignore_eos: a request with structured output ends where its structure ends: leave ignore_eos off"
            )
        return self

    @model_validator(mode="after")
    def _images_chat(self) -> Workload:
        if self.api == "chat":
            return self
        where = ["images"] if self.images is not None else []
        where += [f"mix.{i}.images" for i, c in enumerate(self.mix or ()) if c.images is not None]
        if where:
            raise ValueError(f"{where[0]}: images are sent as chat content parts: give api: chat")
        return self

    def images_of(self, request_class: RequestClass) -> Images | None:
        """The images a request of ``request_class`` carries (the class's, else the workload's)."""
        return request_class.images or self.images

    @property
    def sends_images(self) -> bool:
        return self.images is not None or any(c.images is not None for c in self.mix or ())

    @property
    def max_images(self) -> int:
        """The most images one request carries (0: none do)."""
        return max((spec.max_count for c in self.classes if (spec := self.images_of(c)) is not None), default=0)

    def structured_of(self, request_class: RequestClass) -> Structured | None:
        """The structured output a request of ``request_class`` asks for (the class's, else the workload's)."""
        return request_class.structured or self.structured

    @property
    def asks_structured(self) -> bool:
        """Whether any request asks for structured output (so a level can measure ``structured_valid``)."""
        return self.structured is not None or any(c.structured is not None for c in self.mix or ())

    def sampling_of(self, request_class: RequestClass) -> dict[str, object]:
        """The body fields a request of ``request_class`` sends: its sampling (the class's over the workload's),
        and its structured output with ``ignore_eos`` off."""
        sampling = request_class.sampling.over(self.sampling) if request_class.sampling else self.sampling
        body = sampling.body(self.api)
        structured = self.structured_of(request_class)
        if structured is not None:
            body.update(structured.body(request_class.name))
            body["ignore_eos"] = False
        return body

    @model_validator(mode="after")
    def _read_text(self, info: ValidationInfo) -> Workload:
        if self.text == "random":
            return self
        if self.text == "corpus":
            path = corpus_path()
        else:
            given = Path(self.text).expanduser()
            path = given if given.is_absolute() else Path((info.context or {}).get("base_dir", ".")) / given
        try:
            content = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            raise ValueError(f"text: cannot read {path} as UTF-8 text (give random, corpus or a text file)") from None
        if not content.strip():
            raise ValueError(f"text: {path} has no text")
        self._source_text = content
        return self

    @property
    def source_text(self) -> str | None:
        """The text prompts are cut from; None for random vocabulary words."""
        return self._source_text

    @model_validator(mode="after")
    def _one_shape(self) -> Workload:
        single = self.input_tokens is not None or self.output_tokens is not None
        if single and self.mix:
            raise ValueError("give either input_tokens/output_tokens or mix, not both")
        if not single and not self.mix:
            raise ValueError("give input_tokens and output_tokens, or a mix of request classes")
        if single and (self.input_tokens is None or self.output_tokens is None):
            raise ValueError("input_tokens and output_tokens go together")
        if isinstance(self.output_tokens, Empirical) and self.output_tokens.prompts is not None:
            raise ValueError("output_tokens: an empirical output distribution needs lengths, not prompts")
        if self.sessions is not None:
            for field_name in ("turns", "output_tokens"):
                dist = getattr(self.sessions, field_name)
                if isinstance(dist, Empirical) and dist.prompts is not None:
                    raise ValueError(
                        f"sessions.{field_name}: an empirical distribution here needs numbers, not prompts"
                    )
        return self

    @property
    def classes(self) -> tuple[RequestClass, ...]:
        if self.mix:
            return self.mix
        assert self.input_tokens is not None and self.output_tokens is not None
        return (
            RequestClass.model_construct(
                name="default", weight=1.0, input_tokens=self.input_tokens, output_tokens=self.output_tokens
            ),
        )


#: The public-domain text ``text: corpus`` cuts prompts from (its source and licence: trials/corpus/README.md).
CORPUS_FILE = "newton-opticks.txt"


def corpus_path() -> Path:
    return trials_dir() / "corpus" / CORPUS_FILE


#: Where the shipped workloads live (``trials/workloads``: see servetune.shipped).
WORKLOADS_DIR = trials_dir() / "workloads"


def resolve_workload_path(name_or_path: str | Path) -> Path:
    """A path as given, or the name of a shipped workload (``chat`` -> trials/workloads/chat.yaml)."""
    path = Path(name_or_path)
    if path.exists() or path.suffix in (".yaml", ".yml") or len(path.parts) > 1:
        return path
    shipped = WORKLOADS_DIR / f"{path}.yaml"
    if shipped.exists():
        return shipped
    known = sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))
    raise UserError(f"workload '{name_or_path}' is neither a file nor a shipped workload ({', '.join(known)})")


def load_workload(name_or_path: str | Path) -> Workload:
    return load_yaml_model(resolve_workload_path(name_or_path), Workload)


#: Requests drawn from a workload's length distributions for their means (:func:`mean_lengths`).
SAMPLES = 4000


def mean_image_tokens(
    workload: Workload, vision: VisionEncoder | None, mm_kwargs: dict[str, Any] | str | None = None
) -> int:
    """The image tokens a request of the workload adds to its prompt on average (its mix weighted), for a model
    whose images become ``vision``'s tokens (``mm_kwargs``: the engine's ``mm_processor_kwargs``, or its JSON);
    0 for a workload without images or a model whose processor servetune does not model."""
    if vision is None or not workload.sends_images:
        return 0
    kwargs = processor_kwargs(mm_kwargs)
    return round(mean_over_images(workload, lambda spec: spec.mean_tokens(vision, kwargs, workload.seed)))


def processor_kwargs(mm_kwargs: dict[str, Any] | str | None) -> dict[str, Any] | None:
    """The engine's ``mm_processor_kwargs`` as a mapping (a space may give it as JSON text)."""
    return json.loads(mm_kwargs) if isinstance(mm_kwargs, str) else mm_kwargs


def mean_over_images(workload: Workload, per_request: Callable[[Images], float]) -> float:
    """The mean over the workload's requests (its mix weighted) of ``per_request``, a number of a request class's
    images (``Images.mean_tokens``, ``Images.mean_per_request``); a class without images adds 0."""
    classes = workload.classes
    total = 0.0
    for request_class in classes:
        spec = workload.images_of(request_class)
        if spec is not None:
            total += request_class.weight * per_request(spec)
    return total / sum(c.weight for c in classes)


def mean_lengths(workload: Workload) -> tuple[int, int]:
    """The workload's mean input and output tokens per request (its mix weighted), drawn with its seed."""
    classes = workload.mix or (RequestClass(input_tokens=workload.input_tokens, output_tokens=workload.output_tokens),)
    rng = np.random.default_rng(workload.seed)
    total = sum(c.weight for c in classes)
    mean_in = sum(c.weight * float(np.mean(c.input_tokens.sample(rng, SAMPLES))) for c in classes) / total
    mean_out = sum(c.weight * float(np.mean(c.output_tokens.sample(rng, SAMPLES))) for c in classes) / total
    return max(1, round(mean_in)), max(2, round(mean_out))
