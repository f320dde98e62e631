"""A chosen operating point as something to deploy: a ``vllm serve`` command, a Ray Serve LLM
application config for ``serve run``, or plain JSON.

Which point: ``best`` is the recommendation; a number N is row N (from 0) of the cost vs P99
TTFT Pareto table, cheapest first, as the Markdown and HTML reports number it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shlex
from collections.abc import Mapping
from typing import Any

import yaml

from servetune.config.space import SERVE_REPLICAS, SERVE_STREAM_BATCHING, engine_ranks
from servetune.engine.args import RESERVED, engine_argv, normalize_key
from servetune.engine.launch import VLLM_CPU_SERVE_LINE
from servetune.errors import UserError
from servetune.metrics import KV_METRIC, WAITING_METRIC
from servetune.report.admission import AdmissionBounds, comment_lines, derive_admission
from servetune.report.autoscale import Autoscaling, derive_autoscaling
from servetune.report.build import StudyReport
from servetune.report.points import ReportPoint, first_line, level_label
from servetune.report.serving import LayoutChoice, RouterChoice, StreamBatchingChoice
from servetune.secrets import MASK, redact_engine_args, redact_env


def pick_point(report: StudyReport, pick: str) -> ReportPoint:
    """``best`` -> the recommendation; ``N`` -> row N of the cost vs P99 TTFT Pareto table; a trial
    id -> that trial's chosen level (its best meeting the SLO, else the highest load it measured)."""
    if pick == "best":
        rec = report.recommendation
        if rec.point is None:
            raise UserError(f"--pick best: nothing to export, {rec.reason}")
        return rec.point
    try:
        index = int(pick)
    except ValueError:
        return trial_point(report, pick)
    rows = report.main_front.result.front
    if not 0 <= index < len(rows):
        span = f"rows 0-{len(rows) - 1}" if rows else "no rows"
        raise UserError(f"--pick {index}: the cost vs P99 TTFT Pareto table has {span}")
    return rows[index]


def trial_point(report: StudyReport, trial_id: str) -> ReportPoint:
    """The operating point a trial is judged by (results.py ``chosen_level``): its level at capacity, else its best
    level meeting the SLO, else the highest load it measured."""
    trial = next((t for t in report.trials if t.trial_id == trial_id), None)
    if trial is None:
        known = ", ".join(t.trial_id for t in report.trials) or "none"
        raise UserError(f"--pick '{trial_id}': give 'best', a row number of the cost vs P99 TTFT Pareto table, "
                        f"or a trial id of this study ({known})")  # fmt: skip
    points = [p for p in report.points if p.trial_id == trial_id]
    if not points:
        raise UserError(f"--pick {trial_id}: the trial measured no load level ({trial.outcome}: "
                        f"{first_line(trial.reason) or 'no reason given'})")  # fmt: skip
    return next(p for p in points if p.level_index == trial.chosen_level)  # outline() names a level it measured


def masked_engine_args(point: ReportPoint) -> dict[str, Any]:
    """Engine arguments to ship: the launch's, then every core one it left to vLLM pinned at the value
    vLLM resolved (so the configuration does not move with vLLM's defaults); servetune's own
    (model, host, port) left out, credentials masked."""
    args = {normalize_key(k): v for k, v in point.engine_args.items() if normalize_key(k) not in RESERVED}
    pinned = {k: v for k, v in point.resolved_engine_args.items() if args.get(k) is None}
    return redact_engine_args({**args, **pinned})


def masked_env(env: Mapping[str, str]) -> dict[str, str]:
    return redact_env(env)


def vllm_command(point: ReportPoint, admission: AdmissionBounds | str | None = None) -> str:
    """``ENV=... vllm serve MODEL --flag value ...``, one flag per line, quoted for a POSIX shell.

    Flags are made the way servetune launches the engine (:func:`engine_argv` without vLLM's
    parser at hand: booleans as ``--x`` / ``--no-x``). With ``admission`` (report/admission.py), its
    bounds are added with the reasons as comments; a text says why there are none.
    """
    env = [f"{k}={shlex.quote(v)}" for k, v in masked_env(point.env).items()]
    shipped = masked_engine_args(point)
    if isinstance(admission, AdmissionBounds):
        shipped.update(admission.engine_args())
    bounds = "".join(f"# {line}\n" for line in comment_lines(admission))
    argv = engine_argv(shipped)
    head = " ".join([*env, "vllm", "serve", shlex.quote(point.model)])
    chunks: list[str] = []
    for token in argv:
        if token.startswith("--") or not chunks:
            chunks.append(shlex.quote(token))
        else:
            chunks[-1] += " " + shlex.quote(token)
    lines = [head, *("  " + c for c in chunks)]
    command = " \\\n".join(lines)
    note = f"# servetune: trial {point.trial_id}, measured at {level_label(point.level)}\n"
    note += bounds
    if MASK in head or MASK in argv:
        note += f"# {MASK} marks a secret servetune does not print: put the real value there\n"
    if point.device == "cpu":
        note += (
            "# vllm-cpu: if the `vllm` script fails (it asks for package metadata named vllm), run the same "
            f"`vllm serve` as `python -c {shlex.quote(VLLM_CPU_SERVE_LINE)} serve {shlex.quote(point.model)}` with "
            "the same flags and environment\n"
        )
    return note + command + "\n"


#: The LLM deployment's health check. Serve's defaults check every 10 s, give a check 30 s, and mark a replica dead
#: after 3 failed checks in a row (``REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD``).
HEALTH_CHECK_PERIOD_S = 2.0
HEALTH_CHECK_TIMEOUT_S = 10.0
HEALTH_CHECK_WHY = (
    f"every {HEALTH_CHECK_PERIOD_S:g} s, {HEALTH_CHECK_TIMEOUT_S:g} s to answer (Serve's defaults: 10 s, 30 s). "
    "verify's replica_lost measured on vLLM 0.32 and Ray 2.60 with Serve's defaults: a replica whose engine was "
    "killed answered 5xx for 40 s, until Serve's health check marked it dead. vLLM's check_health fails at once "
    "on a dead engine and Serve marks a replica dead after 3 failed checks in a row, so it is found within about "
    f"4 periods: {4 * HEALTH_CHECK_PERIOD_S:g} s at {HEALTH_CHECK_PERIOD_S:g} s (by hand with these settings, one "
    "replica on a shared two-core host: it left RUNNING 16 s after its EngineCore was killed). The timeout is for a replica "
    f"that does not answer at all (3 x {HEALTH_CHECK_TIMEOUT_S:g} s, against 90 s); no shorter, so a replica busy "
    "under load is not taken for dead"
)


def health_check_config() -> dict[str, float]:
    """The health-check fields of the LLM deployment's ``deployment_config`` (:data:`HEALTH_CHECK_WHY`)."""
    return {"health_check_period_s": HEALTH_CHECK_PERIOD_S, "health_check_timeout_s": HEALTH_CHECK_TIMEOUT_S}


#: The predictive policy's replica class (serve/replica.py, named here as Serve imports it: report/ sits below serve/).
SIGNALS_SERVER_CLASS = "servetune.serve.replica:LLMServer"


def ray_serve_app(
    point: ReportPoint, accelerator_type: str | None = None, app_name: str = "llm", autoscaling: Autoscaling | None = None,
    router_class: str | None = None,
) -> dict[str, Any]:  # fmt: skip
    """A ``serve run`` config with one ``ray.serve.llm`` ``LLMConfig`` (as a plain dict).

    Data parallelism becomes Serve replicas and leaves ``engine_kwargs`` (so does
    ``distributed_executor_backend``, which Ray Serve LLM sets itself); with expert parallelism it
    stays in the engine and the DP builder is used. With ``autoscaling`` (derived from the trial's
    measured knee, :mod:`servetune.report.autoscale`) the deployment config is that; without, the
    replicas are fixed (``min_replicas = max_replicas = DP``) and the measured concurrency per
    replica becomes ``target_ongoing_requests``. ``router_class`` sets the deployment's
    ``request_router_config`` (None: Serve's default router). The deployment's health check is
    :func:`health_check_config`. Under the predictive policy the replicas are ``serve/replica.py``'s
    (``server_cls``), which record the engine signals the policy reads (not with the DP builder, which
    takes no ``server_cls``).
    """
    kwargs = masked_engine_args(point)
    # Ray Serve LLM chooses the executor itself (Ray on GPUs, mp on CPUs) and refuses another one.
    kwargs.pop("distributed_executor_backend", None)
    served = kwargs.pop("served_model_name", None)
    if isinstance(served, (list, tuple)):
        served = served[0] if served else None
    model_id = str(served or point.model)
    dp = int(kwargs.get("data_parallel_size") or 1)
    expert_parallel = bool(kwargs.get("enable_expert_parallel"))
    replicas = 1 if expert_parallel else dp
    if not expert_parallel:
        kwargs.pop("data_parallel_size", None)
    spread = max(dp, 1)  # the engines the measured load was spread over
    if point.params.get(SERVE_REPLICAS):  # measured through Serve at that many replicas
        replicas = spread = int(point.params[SERVE_REPLICAS])
    fixed: dict[str, Any] = {"min_replicas": replicas, "max_replicas": replicas}
    concurrency = point.level.get("concurrency")
    if concurrency:
        fixed["target_ongoing_requests"] = max(1, round(concurrency / spread))
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": model_id, "model_source": point.model},
        "engine_kwargs": kwargs,
        "deployment_config": {"autoscaling_config": fixed} if autoscaling is None else autoscaling.deployment_config(),
    }
    config["deployment_config"].update(health_check_config())
    if router_class:
        config["deployment_config"]["request_router_config"] = {"request_router_class": router_class}
    batching = point.params.get(SERVE_STREAM_BATCHING)
    if batching is not None:  # measured at that interval (else Ray Serve LLM's default, 50 ms)
        config["experimental_configs"] = {"stream_batching_interval_ms": _number(batching)}
    if accelerator_type:
        if point.device == "cpu":
            raise UserError(f"--accelerator-type {accelerator_type}: the study ran on CPUs (vLLM's CPU build)")
        config["accelerator_type"] = accelerator_type
    pp = int(kwargs.get("pipeline_parallel_size") or 1)
    ranks = engine_ranks(kwargs)  # with prefill-context parallelism: Ray Serve LLM's own bundles count TP x PP only
    if point.device == "cpu":
        config["placement_group_config"] = {"bundles": [{"CPU": 1} for _ in range(ranks)]}
    elif pp == 1:  # a replica's TP group on one node: Ray Serve LLM's default (PACK) may split it across nodes
        config["placement_group_config"] = {"bundles": [{"GPU": 1} for _ in range(ranks)], "strategy": "STRICT_PACK"}
    elif ranks > pp * int(kwargs.get("tensor_parallel_size") or 1):  # stages may span nodes, as Ray Serve LLM's PACK
        config["placement_group_config"] = {"bundles": [{"GPU": 1} for _ in range(ranks)], "strategy": "PACK"}
    env = masked_env(point.env)
    if env:
        config["runtime_env"] = {"env_vars": env}
    if expert_parallel and dp > 1:
        args: dict[str, Any] = {"llm_config": config}
        import_path = "ray.serve.llm:build_dp_openai_app"
    else:
        args = {"llm_configs": [config]}
        import_path = "ray.serve.llm:build_openai_app"
        if autoscaling is not None and autoscaling.policy == "predictive":
            config["server_cls"] = SIGNALS_SERVER_CLASS
    return {"applications": [{"name": app_name, "route_prefix": "/", "import_path": import_path, "args": args}]}


#: The builders of the two applications ``--keep-ingress`` writes (serve/apps.py, named as Serve imports them).
INGRESS_BUILDER = "servetune.serve.apps:build_ingress"
ENGINES_BUILDER = "servetune.serve.apps:build_engines"
KEEP_INGRESS_WHY = (
    "Serve gives every deployment of a config-deployed application one version, a hash of the application's "
    "import_path, runtime_env and args, so a change of the engines' LLMConfig would replace the ingress replica too; "
    "the ingress application's args hold only what the ingress is built from (model id and source, max_model_len, "
    "LoRA path, scale to zero), so `serve deploy` of another point of the same model and context length keeps the "
    "ingress replica and replaces only the engines'. servetune must be importable on the cluster"
)


def ingress_args(llm_config: Mapping[str, Any], engines_app: str) -> dict[str, Any]:
    """What the OpenAI ingress is built from, of one ``LLMConfig`` (a dict): its model card's model id, source and
    context length (``max_model_len``), its LoRA loading path, and whether it scales to zero (the ingress then does);
    with the engines application's name (serve/apps.py ``build_ingress``)."""
    config: dict[str, Any] = {"model_loading_config": dict(llm_config["model_loading_config"])}
    max_model_len = (llm_config.get("engine_kwargs") or {}).get("max_model_len")
    if max_model_len is not None:
        config["engine_kwargs"] = {"max_model_len": max_model_len}
    if llm_config.get("lora_config"):
        config["lora_config"] = llm_config["lora_config"]
    scaling = (llm_config.get("deployment_config") or {}).get("autoscaling_config") or {}
    if scaling.get("min_replicas") == 0:
        config["deployment_config"] = {"autoscaling_config": {"min_replicas": 0}}
    return {"engines_app": engines_app, "llm_configs": [config]}


def split_ingress(config: Mapping[str, Any]) -> dict[str, Any]:
    """A :func:`ray_serve_app` config as two applications (:data:`KEEP_INGRESS_WHY`): the ingress under the
    application's name and route, built from :func:`ingress_args` only, and the engines (``NAME-engines``, no route)
    from the ``LLMConfig``."""
    app = config["applications"][0]
    if app["import_path"] != "ray.serve.llm:build_openai_app":
        raise UserError(f"--keep-ingress: the point deploys with {app['import_path']} (expert parallelism over "
                        "data-parallel ranks), which builds no separate ingress")  # fmt: skip
    (llm_config,) = app["args"]["llm_configs"]
    engines = f"{app['name']}-engines"
    return {"applications": [
        {"name": app["name"], "route_prefix": app["route_prefix"], "import_path": INGRESS_BUILDER,
         "args": ingress_args(llm_config, engines)},
        {"name": engines, "route_prefix": None, "import_path": ENGINES_BUILDER, "args": {"llm_config": llm_config}},
    ]}  # fmt: skip


#: The environment variable that binds the CPU build's ranks to cores (ranks separated by ``|``).
CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"


def with_tp(point: ReportPoint, tp: int, cores: Any = ()) -> ReportPoint:
    """``point`` with tensor parallelism ``tp`` in place of its own (unchanged when it is its own). On
    the CPU build, more than one rank needs each bound to its own core (``VLLM_CPU_OMP_THREADS_BIND``:
    the first ranks of ``cores``, else cores 0, 1, ...)."""
    if tp == int(point.engine_args.get("tensor_parallel_size") or 1):
        return point
    engine_args = {k: v for k, v in point.engine_args.items() if k != "tensor_parallel_size"}
    engine_args["tensor_parallel_size"] = tp
    ranks = engine_ranks(engine_args)
    env = {k: v for k, v in point.env.items() if k != CPU_BIND}
    if point.device == "cpu" and ranks > 1:
        env[CPU_BIND] = "|".join(str(c) for c in (list(cores) or range(ranks))[:ranks])
    return dataclasses.replace(point, engine_args=engine_args, env=env)


def ray_serve_yaml(
    point: ReportPoint, accelerator_type: str | None = None, autoscaling: Autoscaling | str | None = None,
    router: RouterChoice | None = None, layout: LayoutChoice | None = None,
    stream_batching: StreamBatchingChoice | None = None, keep_ingress: bool = False,
) -> str:  # fmt: skip
    """The ``serve run`` YAML; ``autoscaling`` is the derived settings (their reasons become
    comments) or, as a string, why none could be derived (the replicas stay fixed); ``router``
    is what ``serve-check --routers`` measured for this point's trial (ignored for another);
    ``layout`` the replicas x TP ``serve-check --layouts`` named for it (ignored for another): shipped
    as fixed replicas of that TP, in place of the derived autoscaling (derived for the trial's own TP
    at its own load); ``stream_batching`` the replicas' stream batching interval serve-check deployed
    it at (ignored for another trial), in place of the trial's own. ``keep_ingress``: the ingress and the engines as two
    applications (:func:`split_ingress`), so that ``serve deploy`` of another point keeps the ingress replica."""
    header = (
        f"# Ray Serve LLM application (servetune trial {point.trial_id}, measured at {level_label(point.level)}).\n"
        "# Deploy: serve run this.yaml\n"
    )
    if layout is not None and layout.trial_id != point.trial_id:
        layout = None
    if layout is not None:
        point = with_tp(point, layout.tp)
        header += (f"# Layout: {layout.replicas} replica(s) of TP {layout.tp}, named by serve-check at "
                   f"{level_label(layout.level)}: {layout.reason}\n")  # fmt: skip
        if autoscaling is not None and not isinstance(autoscaling, str):
            header += "# Fixed replicas (the layout measured); the autoscaling derived for the trial is not applied.\n"
        autoscaling = None
    if isinstance(autoscaling, str):
        header += f"# Fixed replicas, no autoscaling derived: {autoscaling}\n"
        autoscaling = None
    elif autoscaling is not None:
        header += "# Autoscaling derived from the study's measurements (checklist sections 10 and 11):\n"
        header += "".join(f"#   {name}: {why}\n" for name, why in autoscaling.reasons.items())
    header += f"# Health check: {HEALTH_CHECK_WHY}.\n"
    if not accelerator_type and point.device == "gpu":
        header += "# accelerator_type unknown: add it (e.g. H100) or pass --accelerator-type.\n"
    router_class = None
    if router is not None and router.trial_id == point.trial_id:
        if router.name is None:
            header += f"# Router: Serve's default; serve-check named none: {router.reason}\n"
        else:
            router_class = router.router_class
            header += f"# Router: {router.name}, measured by serve-check: {router.reason}\n"
    if stream_batching is not None and stream_batching.trial_id == point.trial_id:
        own = point.params.get(SERVE_STREAM_BATCHING)
        was = (
            f" (the trial's own: {_number(own)} ms)"
            if own is not None and float(own) != stream_batching.interval_ms
            else ""
        )
        header += (f"# Stream batching: {_number(stream_batching.interval_ms)} ms, as serve-check deployed and "
                   f"measured the replicas{was}\n")  # fmt: skip
        point = dataclasses.replace(point, params={**point.params, SERVE_STREAM_BATCHING: stream_batching.interval_ms})
    app = ray_serve_app(point, accelerator_type, autoscaling=autoscaling, router_class=router_class)
    if any(c.get("server_cls") == SIGNALS_SERVER_CLASS for c in app["applications"][0]["args"].get("llm_configs", [])):
        header += (f"# Replicas: {SIGNALS_SERVER_CLASS}, Ray Serve LLM's LLMServer that also records its engine's "
                   f"{WAITING_METRIC} and {KV_METRIC} (read on Ray's metrics agent) for the predictive policy.\n")  # fmt: skip
    if layout is not None:
        args = app["applications"][0]["args"]
        for config in args.get("llm_configs") or [args.get("llm_config")]:
            fixed = {"min_replicas": layout.replicas, "max_replicas": layout.replicas}
            if layout.level.get("concurrency"):
                fixed["target_ongoing_requests"] = max(1, round(layout.level["concurrency"] / layout.replicas))
            config["deployment_config"]["autoscaling_config"] = fixed
    if keep_ingress:
        app = split_ingress(app)
        header = header.replace("# Deploy: serve run this.yaml\n", "# Deploy: serve deploy this.yaml (or serve run)\n")
        header += f"# Two applications, the ingress and the engines: {KEEP_INGRESS_WHY}.\n"
    body = yaml.safe_dump(app, sort_keys=False, default_flow_style=False)
    if f"'{MASK}'" in body:
        header += f"# {MASK} marks a secret servetune does not print: put the real value there.\n"
    return header + body


def autoscaling_for(
    report: StudyReport, point: ReportPoint, peak: float | None = None, headroom: float | None = None
) -> Autoscaling | str:
    """The autoscaling derived from the picked point's trial (all its levels, its capacity and its knee: with a
    ``headroom``, at headroom x min(capacity, knee)), or why there is none."""
    points = [p for p in report.points if p.trial_id == point.trial_id]
    row = next((r for r in report.trial_table if r.trial_id == point.trial_id), None)
    try:
        derived = derive_autoscaling(points, [str(line) for line in report.slo], peak, headroom=headroom,
                                     capacity=row.capacity if row else None, knee=row.knee if row else None)  # fmt: skip
        return dataclasses.replace(derived, study=report.info.name)
    except UserError as exc:
        if any(flag in str(exc) for flag in ("--peak", "--headroom")):
            raise
        return str(exc).removeprefix("autoscaling: ")


def point_document(report: StudyReport, point: ReportPoint) -> dict[str, Any]:
    """The configuration and its numbers, as JSON-ready data."""
    rec = report.recommendation
    return {
        "study": report.info.name,
        "trial_id": point.trial_id,
        "level_index": point.level_index,
        "level": dict(point.level),
        "model": point.model,
        "device": point.device,
        "devices": point.devices,
        "params": dict(point.params),
        "engine_args": masked_engine_args(point),
        "env": masked_env(point.env),
        "metrics": {k: v for k, v in point.metrics.items() if math.isfinite(v)},
        "meets_slo": point.meets_slo,
        "slo": [str(line) for line in report.slo],
        "recommended": point is rec.point,
        "recommendation_reason": rec.reason if point is rec.point else None,
    }


def point_json(report: StudyReport, point: ReportPoint) -> str:
    return json.dumps(point_document(report, point), indent=2, default=str) + "\n"


def _number(value: Any) -> int | float:
    """A whole number as an int (``50``, not ``50.0``, in the printed config)."""
    number = float(value)
    return int(number) if number.is_integer() else number


def admission_for(report: StudyReport, point: ReportPoint) -> AdmissionBounds | str:
    """vLLM's admission bounds derived from the picked point's trial (report/admission.py), or why there are none."""
    try:
        return derive_admission(
            [p for p in report.points if p.trial_id == point.trial_id], [str(s) for s in report.slo]
        )
    except UserError as exc:
        return str(exc).removeprefix("admission bounds: ")
