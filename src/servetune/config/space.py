"""Search spaces: what a study varies, under which load, SLOs, prices and constraints.

One YAML file per scenario (``search_spaces/*.yaml``). Unknown keys are rejected; every error
names the file and the field. Parameters are vLLM engine arguments (snake_case) or, with an
``env.`` prefix, environment variables of the engine (``env.VLLM_CPU_KVCACHE_SPACE``); ``model``
as a parameter lists checkpoints to compare (a BF16 id and its FP8 and AWQ variants), each
checked for capacity with its own weights; ``gpu`` as a parameter lists GPU types to compare
(``gpu: [H100-SXM, H200, L40S]``, catalogue names as ``hardware.gpu``): each trial is placed on a node of its
type, checked for capacity with that GPU's memory and priced at that type's price. ``serve.num_replicas`` as a parameter runs each trial
through Ray Serve LLM with that many replicas of the engine (many small or one big, beside
``tensor_parallel_size``): a trial's devices are then all its replicas', the budget a constraint
such as ``serve.num_replicas * tensor_parallel_size <= 8``. ``speculative.method`` and the other
``speculative.<field>`` names (parameters, or fixed in ``engine_args``) vary speculative decoding; a
choice's fields become one ``speculative_config`` engine argument (config/speculative.py).
A list is a categorical (grid) dimension; ``{low, high, log, step}`` is a numeric range.
Constraints are small boolean expressions over parameters, fixed engine arguments,
``devices_per_node`` and vLLM's defaults for the parallel sizes, e.g.
``tensor_parallel_size * data_parallel_size <= devices_per_node`` (config/constraints.py).

These are the typed models; a space file is read and checked against vLLM's parser and the quality
suites by :func:`servetune.space_file.load_space`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeGuard

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from servetune.capacity.prices import Price, PriceList, Pricing, price_table
from servetune.config import speculative
from servetune.config.constraints import evaluate_constraint, parse_constraint
from servetune.config.graphs import GRAPH_ARGS, graph_key
from servetune.config.quality import QualitySpec
from servetune.config.settings import Hardware, LoadProtocol, Search, SloSpec
from servetune.config.slo import Slo
from servetune.config.workload import Workload, load_workload

#: vLLM's defaults for the arguments constraints and placement read: their product is an engine's devices
#: (vLLM 0.32's world size is pipeline x tensor x prefill-context parallel, one per data-parallel rank).
ENGINE_DEFAULTS = {
    "tensor_parallel_size": 1, "pipeline_parallel_size": 1, "data_parallel_size": 1, "prefill_context_parallel_size": 1,
}  # fmt: skip
#: The sizes whose product is vLLM's world size: the ranks of one data-parallel engine.
RANK_SIZES = ("tensor_parallel_size", "pipeline_parallel_size", "prefill_context_parallel_size")
#: Executor backends that make a bare engine a Ray driver of its own (refused by space_file.py when a space loads).
RAY_BACKENDS = {"distributed_executor_backend": "ray", "data_parallel_backend": "ray"}
ENV_PREFIX = "env."
MODEL_PARAM = "model"  # a parameter naming checkpoints, not an engine argument
#: A parameter naming GPU types to compare (catalogue names, as ``hardware.gpu``): each trial runs on its own type.
GPU_PARAM = "gpu"
SERVE_PREFIX = "serve."
#: Tags of the space's ``workload`` (a name or path, or the workload itself): an invalid inline workload's error
#: names its own field, not that the workload is not a string (config/loading.py leaves the tags out).
WORKLOAD_NAMED, WORKLOAD_INLINE = "workload-named", "workload-inline"
#: Replicas of the engine behind one Ray Serve LLM application: the trial runs through Serve.
SERVE_REPLICAS = SERVE_PREFIX + "num_replicas"
#: Ray Serve LLM's stream batching (``experimental_configs.stream_batching_interval_ms``): a replica
#: sends its tokens every this many ms (Ray's default 50; 0 sends each as it comes). The first token
#: waits for the next send, so it trades TTFT and ITL against the CPU each streamed chunk costs.
SERVE_STREAM_BATCHING = SERVE_PREFIX + "stream_batching_interval_ms"
SERVE_PARAMS = (SERVE_REPLICAS, SERVE_STREAM_BATCHING)


def engine_ranks(engine_args: Mapping[str, Any]) -> int:
    """The ranks of one data-parallel engine, vLLM's world size: tensor x pipeline x prefill-context parallel size
    (a Ray Serve LLM replica's devices; data parallelism there is replicas), vLLM's 1 for a size not given (or given
    as null, which passes no flag)."""
    return math.prod(int(engine_args.get(k) or 1) for k in RANK_SIZES)


def engine_devices(engine_args: Mapping[str, Any]) -> int:
    """The devices (cores on the CPU build) one engine of these arguments takes: its ranks (:func:`engine_ranks`)
    in each of its data-parallel engines."""
    return engine_ranks(engine_args) * int(engine_args.get("data_parallel_size") or 1)


def stream_batching_ok(value: object) -> TypeGuard[float]:
    """Whether ``value`` is a stream batching interval: a finite number of milliseconds, 0 or more."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < math.inf


class Range(BaseModel):
    """A numeric range: integers when ``low`` and ``high`` are integers, else floats."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    low: float
    high: float
    log: bool = False
    step: float | None = None

    @model_validator(mode="after")
    def _valid(self) -> Range:
        if self.low > self.high:
            raise ValueError(f"empty range: low ({self.low:g}) is above high ({self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError("a log range needs low > 0")
        if self.step is not None and self.step <= 0:
            raise ValueError("step must be positive")
        return self

    @property
    def is_int(self) -> bool:
        return (
            float(self.low).is_integer()
            and float(self.high).is_integer()
            and (self.step is None or float(self.step).is_integer())
        )

    def grid_values(self) -> list[float | int]:
        """The values a grid visits: every step, or powers of two for an integer log range."""
        if self.step is not None:
            n = math.floor((self.high - self.low) / self.step + 1e-9)
            values = [self.low + i * self.step for i in range(n + 1)]
        elif self.is_int and self.log:
            values, v = [], self.low
            while v <= self.high:
                values.append(v)
                v *= 2
        elif self.is_int and self.high - self.low <= 16:
            values = list(range(int(self.low), int(self.high) + 1))
        else:
            raise ValueError("a grid over a continuous range needs a step")
        return [int(v) if self.is_int else round(v, 10) for v in values]


def _whole_steps(name: str, spec: Range) -> list[float | int]:
    """A graph argument's range as ``search.graph_steps`` draws it: its grid's whole-number values."""
    if spec.is_int:
        with contextlib.suppress(ValueError):  # a wide range with neither a step nor log: said below
            return spec.grid_values()
    raise ValueError(
        f"params.{name}: search.graph_steps draws it at whole-number steps: give its range log: true "
        "(powers of two) or a whole-number step"
    )


ParamValues = Annotated[
    Annotated[list[Any], Tag("values")] | Annotated[Range, Tag("range")],
    Discriminator(lambda v: "values" if isinstance(v, list) else "range"),
]


class SearchSpace(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    description: str = ""
    model: str  # a directory, a hub id, or "tiny" (servetune builds its CPU test model)
    device: Literal["gpu", "cpu"] = "gpu"
    workload: Annotated[  # a shipped workload's name or a file's path, or the workload itself
        Annotated[str, Tag(WORKLOAD_NAMED)] | Annotated[Workload, Tag(WORKLOAD_INLINE)],
        Discriminator(lambda value: WORKLOAD_NAMED if isinstance(value, str) else WORKLOAD_INLINE),
    ]
    load: LoadProtocol = LoadProtocol()
    slo: SloSpec = SloSpec()
    # USD per GPU-hour (CPU core-hour on CPU); set, it overrides the price list for every GPU type
    price_per_device_hour: float = Field(default=1.0, ge=0)
    # which shipped price list prices the GPU types: default (GPU clouds' list prices), or one hyperscaler's
    # on-demand instances (aws: us-east-1, gcp: us-central1, azure: East US), each price per GPU (capacity/prices.py)
    price_list: PriceList = "default"
    # GPU type -> its price per device-hour, with source and date: over the shipped list (capacity/prices.py)
    prices: dict[str, Price] = {}
    hardware: Hardware = Hardware()
    engine_args: dict[str, Any] = {}
    env: dict[str, str | int | float] = {}
    params: dict[str, ParamValues] = {}
    constraints: tuple[str, ...] = ()
    search: Search = Search()
    quality: QualitySpec | None = None  # the quality probe each trial runs (config/quality.py)

    @model_validator(mode="before")
    @classmethod
    def _gpus_in_hardware(cls, data: Any) -> Any:
        """``hardware.gpu: [H100-SXM, H200]`` lists the GPU types to compare, as ``params: {gpu: [...]}`` does."""
        if not isinstance(data, Mapping) or not isinstance(data.get("hardware"), Mapping):
            return data
        hardware, params = dict(data["hardware"]), data.get("params")
        if not isinstance(hardware.get("gpu"), list):
            return data
        if isinstance(params, Mapping) and GPU_PARAM in params:
            raise ValueError(f"hardware.gpu: lists GPU types while params.{GPU_PARAM} does too: list them in one place")
        gpus = hardware.pop("gpu")
        return {
            **data,
            "hardware": hardware,
            "params": {GPU_PARAM: gpus, **(params if isinstance(params, Mapping) else {})},
        }

    @model_validator(mode="before")
    @classmethod
    def _graph_steps(cls, data: Any) -> Any:
        """With ``search.graph_steps``, each integer range of a graph argument becomes the list of its grid values
        (config/graphs.py), so every searcher draws those values only."""
        if not isinstance(data, Mapping):
            return data
        search, params = data.get("search"), data.get("params")
        try:
            steps = (search if isinstance(search, Search) else Search.model_validate(search or {})).graph_steps
        except ValueError:
            return data  # the search field's own validation says what is wrong
        if not steps or not isinstance(params, Mapping):
            return data
        stepped: dict[str, Any] = {}
        for name, values in params.items():
            if name in GRAPH_ARGS and isinstance(values, Mapping | Range):
                try:
                    spec = values if isinstance(values, Range) else Range.model_validate(values)
                except ValueError:
                    stepped[name] = values  # the params field's own validation says what is wrong
                    continue
                values = _whole_steps(name, spec)
            stepped[name] = values
        return {**data, "params": stepped}

    @field_validator("params")
    @classmethod
    def _non_empty(cls, params: dict[str, ParamValues]) -> dict[str, ParamValues]:
        for name, values in params.items():
            if isinstance(values, list) and not values:
                raise ValueError(f"{name}: empty list of values")
        for name in params:
            if name.startswith(SERVE_PREFIX) and name not in SERVE_PARAMS:
                raise ValueError(f"{name}: the Serve parameters are {' and '.join(SERVE_PARAMS)}")
        replicas = params.get(SERVE_REPLICAS)
        if replicas is not None and not (
            isinstance(replicas, list)
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in replicas)
        ):
            raise ValueError(f"{SERVE_REPLICAS}: list the replica counts to compare (whole numbers, 1 or more)")
        batching = params.get(SERVE_STREAM_BATCHING)
        if batching is not None:
            if not (isinstance(batching, list) and all(stream_batching_ok(v) for v in batching)):
                raise ValueError(f"{SERVE_STREAM_BATCHING}: list the intervals to compare (milliseconds, 0 or more)")
            if len({float(v) for v in batching}) < len(batching):
                raise ValueError(f"{SERVE_STREAM_BATCHING}: an interval is listed twice (50 and 50.0 are one)")
            if replicas is None:
                raise ValueError(
                    f"{SERVE_STREAM_BATCHING}: only trials through Serve batch their streams; list {SERVE_REPLICAS} too"
                )
        for name, values in params.items():
            if speculative.is_speculative(name):
                if isinstance(values, Range) and name == speculative.METHOD:
                    raise ValueError(f"{name}: list the methods to compare ({', '.join(speculative.METHODS)})")
                for value in [values.low, values.high] if isinstance(values, Range) else values:
                    speculative.check_value(name, value)
        gpus = params.get(GPU_PARAM)
        if gpus is not None and not (isinstance(gpus, list) and all(isinstance(v, str) and v for v in gpus)):
            raise ValueError(f"{GPU_PARAM}: list the GPU types to compare (catalogue names, e.g. H100-SXM, H200)")
        if isinstance(gpus, list) and len(set(gpus)) < len(gpus):
            raise ValueError(f"{GPU_PARAM}: a GPU type is listed twice")
        model = params.get(MODEL_PARAM)
        if model is not None and not (isinstance(model, list) and all(isinstance(v, str) and v for v in model)):
            raise ValueError(f"{MODEL_PARAM}: list the checkpoints to compare (directories or hub ids)")
        return params

    @model_validator(mode="after")
    def _gpus_on_gpu(self) -> SearchSpace:
        if GPU_PARAM in self.params and self.device != "gpu":
            raise ValueError(f"params.{GPU_PARAM}: GPU types are compared with device: gpu, not on the CPU build")
        if GPU_PARAM in self.params and self.hardware.gpu_memory_gib is not None:
            raise ValueError(
                f"hardware.gpu_memory_gib: sizes one GPU; with params.{GPU_PARAM} each type's memory is the catalogue's"
            )
        return self

    @field_validator("engine_args")
    @classmethod
    def _speculative_args(cls, engine_args: dict[str, Any]) -> dict[str, Any]:
        for name, value in engine_args.items():
            if speculative.is_speculative(name):
                speculative.check_value(name, value)
        return engine_args

    @model_validator(mode="after")
    def _one_speculative_config(self) -> SearchSpace:
        named = [n for n in (*self.engine_args, *self.params) if speculative.is_speculative(n)]
        if named and "speculative_config" in {*self.engine_args, *self.params}:
            raise ValueError(f"speculative_config and {named[0]}: give speculative decoding one way, not both")
        if named and speculative.METHOD not in named:
            raise ValueError(f"{named[0]}: give {speculative.METHOD} too (one of {', '.join(speculative.METHODS)})")
        return self

    @field_validator("constraints")
    @classmethod
    def _parse(cls, constraints: tuple[str, ...]) -> tuple[str, ...]:
        for text in constraints:
            parse_constraint(text)
        return constraints

    @property
    def pricing(self) -> Pricing:
        """How trials are priced: by the GPU type each ran on, from the price list (the shipped one ``price_list``
        names, under the space's ``prices:``), unless the space sets ``price_per_device_hour`` (or runs on the CPU
        stand-in)."""
        fixed = self.price_per_device_hour if "price_per_device_hour" in self.model_fields_set else None
        return Pricing(
            device=self.device,
            table=price_table(self.prices, self.price_list),
            price_list=self.price_list,
            fixed=fixed,
            default=self.price_per_device_hour,
        )

    @property
    def slo_bounds(self) -> Slo:
        return self.slo.to_slo()

    @property
    def stops_when_dominated(self) -> bool:
        """Whether trials stop at a level finished trials dominate (``load.stop_when_dominated``)."""
        if self.load.stop_when_dominated is not None:
            return self.load.stop_when_dominated
        return self.search.algorithm in ("tpe", "nsga2", "gp")

    def resolved_workload(self, base_dir: Path) -> Workload:
        if isinstance(self.workload, Workload):
            return self.workload
        path = Path(self.workload)
        if not path.is_absolute() and (base_dir / path).exists():
            path = base_dir / path
        return load_workload(path if path.exists() else self.workload)

    def engine_params(self, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
        """Split chosen values into engine arguments and environment, over the fixed ones."""
        engine = {k: v for k, v in self.engine_args.items() if not speculative.is_speculative(k)}
        env = {k: str(v) for k, v in self.env.items()}
        for name, value in params.items():
            if name.startswith(ENV_PREFIX):
                env[name[len(ENV_PREFIX) :]] = str(value)
            elif (
                name not in (MODEL_PARAM, GPU_PARAM)
                and not name.startswith(SERVE_PREFIX)
                and not speculative.is_speculative(name)
            ):
                engine[name] = value
        spec = speculative.config_of(self.speculative_values(params))
        if spec is not None:
            engine["speculative_config"] = spec
        return engine, env

    def graph_key(self, params: dict[str, Any]) -> tuple[tuple[str, str], ...]:
        """The compile-cache key of a point's engine (config/graphs.py): points with equal keys share a compiled graph."""
        return graph_key({**self.engine_params(params)[0], MODEL_PARAM: params.get(MODEL_PARAM, self.model)})

    def speculative_methods(self) -> list[str]:
        """The speculative decoding methods the space's trials may run (``none`` included where listed)."""
        listed = self.params.get(speculative.METHOD)
        if isinstance(listed, list):
            return [str(v) for v in listed]
        fixed = self.engine_args.get(speculative.METHOD)
        return [str(fixed)] if fixed is not None else []

    def speculative_values(self, params: dict[str, Any]) -> dict[str, Any]:
        """A choice's ``speculative.*`` values over the fixed ones in ``engine_args``."""
        fixed = {k: v for k, v in self.engine_args.items() if speculative.is_speculative(k)}
        return {**fixed, **{k: v for k, v in params.items() if speculative.is_speculative(k)}}

    def model_for(self, params: dict[str, Any]) -> str:
        """The checkpoint a choice serves: its ``model`` parameter, else the space's model."""
        return str(params.get(MODEL_PARAM, self.model))

    def gpu_for(self, params: dict[str, Any]) -> str | None:
        """The GPU type a choice runs on: its ``gpu`` parameter, else ``hardware.gpu`` (None: detected)."""
        value = params.get(GPU_PARAM, self.hardware.gpu)
        return None if value is None else str(value)

    def baselines(self) -> list[dict[str, Any]]:
        """The search's baseline points (vLLM's defaults, only the fixed engine arguments): one per GPU type
        compared (``{"gpu": "H200"}``), else the one that sets nothing."""
        listed = self.params.get(GPU_PARAM)
        return [{GPU_PARAM: g} for g in listed] if isinstance(listed, list) else [{}]

    def gpu_types(self) -> list[str]:
        """The GPU types the space's trials run on: the ``gpu`` parameter's, else ``hardware.gpu`` (or none)."""
        listed = self.params.get(GPU_PARAM)
        if isinstance(listed, list):
            return [str(v) for v in listed]
        return [self.hardware.gpu] if self.hardware.gpu else []

    @property
    def quality_bounds(self) -> dict[str, float]:
        """The quality scores a trial must not drop by more than their bound (empty without a quality section)."""
        return self.quality.bounds() if self.quality is not None else {}

    @property
    def quality_reference(self) -> dict[str, Any] | None:
        """The parameters of the quality reference: ``{}`` for the baseline; None without a quality section. Where
        the space compares GPU types, the reference runs on the first type listed unless it names one."""
        if self.quality is None:
            return None
        reference = {} if self.quality.reference == "baseline" else dict(self.quality.reference)
        return {**self.baselines()[0], **reference}

    def serve_replicas(self, params: dict[str, Any]) -> int | None:
        """The Serve replicas a choice runs behind (``serve.num_replicas``); None: the bare engine."""
        value = params.get(SERVE_REPLICAS)
        return int(value) if value is not None else None

    def stream_batching_ms(self, params: dict[str, Any]) -> float | None:
        """The Serve replicas' stream batching interval a choice sets (``serve.stream_batching_interval_ms``); None: Ray's default."""
        value = params.get(SERVE_STREAM_BATCHING)
        return float(value) if value is not None else None

    @property
    def through_serve(self) -> bool:
        """Whether the study's trials run through Ray Serve (``serve.num_replicas`` is a parameter)."""
        return SERVE_REPLICAS in self.params

    def replica_devices(self, params: dict[str, Any]) -> int:
        """The devices one engine takes: tensor x pipeline x data parallel size."""
        engine, _ = self.engine_params(params)
        return engine_devices(engine)

    def devices(self, params: dict[str, Any]) -> int:
        """The devices a trial takes (and is priced for): one engine's, times its Serve replicas."""
        return self.replica_devices(params) * (self.serve_replicas(params) or 1)

    def constraint_violations(self, params: dict[str, Any]) -> list[str]:
        """The constraints a choice breaks (with the implicit one: a trial fits on one node)."""
        engine, _ = self.engine_params(params)
        names = {**ENGINE_DEFAULTS, **engine, **{ENV_PREFIX + k: v for k, v in self.env.items()}}
        names.update((k, v) for k, v in params.items() if k.startswith((ENV_PREFIX, SERVE_PREFIX)))
        names.update(self.speculative_values(params))
        names[MODEL_PARAM] = self.model_for(params)
        names[GPU_PARAM] = self.gpu_for(params)
        names["devices_per_node"] = self.hardware.devices_per_node
        broken = [text for text in self.constraints if not evaluate_constraint(text, names)]
        broken += speculative.violations(self.speculative_values(params))
        # A Serve replica runs inside one node (its placement group); replicas spread over nodes.
        if self.replica_devices(params) > self.hardware.devices_per_node:
            broken.append(f"needs {self.replica_devices(params)} devices, a node has {self.hardware.devices_per_node}")
        return broken

    def grid(self) -> tuple[list[dict[str, Any]], list[tuple[dict[str, Any], list[str]]]]:
        """Every point of the grid: (kept, [(rejected, reasons)]). A point that would run the same engine as
        one kept before it, or as the baseline (``speculative.method: none`` with another
        ``speculative.num_speculative_tokens``, or with nothing else varied), is rejected as its repeat."""
        axes = []
        for name, values in self.params.items():
            axes.append([(name, v) for v in (values.grid_values() if isinstance(values, Range) else values)])
        kept: list[dict[str, Any]] = []
        rejected: list[tuple[dict[str, Any], list[str]]] = []
        # the baseline (run first when the search has one) passes no parameter
        seen = {self._run_key(b): b for b in self.baselines()} if self.search.baseline else {}
        for combo in itertools.product(*axes):
            params = dict(combo)
            broken = self.constraint_violations(params)
            same = seen.get(self._run_key(params))
            if same is not None and not broken:
                tuned = {k: v for k, v in same.items() if k != GPU_PARAM}
                earlier = ", ".join(f"{k}={v}" for k, v in tuned.items()) or "the baseline (vLLM defaults)"
                broken = [f"runs the same engine as {earlier} (a speculative.* field does nothing without speculation)"]
            if broken:
                rejected.append((params, broken))
            else:
                kept.append(params)
                seen[self._run_key(params)] = params
        return kept, rejected

    def _run_key(self, params: dict[str, Any]) -> str:
        """What a choice runs: its model, engine arguments, environment and Serve settings."""
        engine, env = self.engine_params(params)
        serve = {k: v for k, v in params.items() if k.startswith(SERVE_PREFIX)}
        run = [self.model_for(params), engine, env, serve]
        if GPU_PARAM in params:  # another GPU type runs the same engine elsewhere: a point of its own
            run.append(params[GPU_PARAM])
        return json.dumps(run, sort_keys=True, default=str)
