"""Application builders Ray Serve imports by path from the config ``export --format ray-serve --keep-ingress`` writes:
the OpenAI ingress and the LLM engines as two applications, so that ``serve deploy`` of another point's config keeps
the ingress replica and replaces only the engines'.

Why two: a config deploy (``serve deploy``, the REST API, ``serve.run`` of a config) gives every deployment of an
application one version, the application's code version: a hash of its ``import_path``, ``runtime_env`` and ``args``
(and its routers' and autoscaling policies' names), Ray 2.60's ``get_app_code_version``. The build task sets it on
each deployment over any version the builder pinned (``get_deploy_args``), and a new code version replaces every
replica. One application with the engines' ``LLMConfig`` in its ``args`` replaces its ingress at any change of the
engines. Split, the ingress application's ``args`` hold only what the ingress is built from (the model id and source,
the context length, LoRA paths, scale-to-zero: report/export.py ``ingress_args``), the same for any two points of one model with the
same context length: its code version is unchanged, and Serve keeps its replica, as servetune's own rolling update
keeps it (serve/versions.py ``pin_ingress``). The ingress reaches the engines by a handle to the deployment
:data:`ENGINES_PREFIX` + model id of the engines application, whose name is in its ``args``.
"""

from __future__ import annotations

from typing import Any

#: The LLM deployment's name prefix in the engines application (Ray Serve LLM's default, with its own ``LLMServer``).
ENGINES_PREFIX = "LLMServer:"


def engines_deployment(model_id: str) -> str:
    """The LLM deployment's name in the engines application (Ray Serve LLM's ``_get_deployment_name``, prefixed)."""
    return ENGINES_PREFIX + model_id.replace("/", "--").replace(".", "_")


def build_engines(args: dict) -> Any:
    """The engines application: Ray Serve LLM's LLM deployment of ``args["llm_config"]`` (an ``LLMConfig``), named
    :func:`engines_deployment` whatever its ``server_cls``."""
    from ray.serve.llm import LLMConfig, build_llm_deployment

    return build_llm_deployment(LLMConfig.model_validate(args["llm_config"]), name_prefix=ENGINES_PREFIX)


def build_ingress(args: dict) -> Any:
    """The ingress application: Ray Serve LLM's OpenAI ingress (``build_openai_app``'s) of ``args["llm_configs"]``
    (report/export.py ``ingress_args``), its LLM deployments' handles those of the application ``args["engines_app"]``."""
    from ray.serve.handle import DeploymentHandle
    from ray.serve.llm import build_openai_app

    app = build_openai_app({"llm_configs": args["llm_configs"]})
    ingress: Any = app._bound_deployment  # Ray types its init_kwargs as a tuple
    models = ingress.init_kwargs["llm_deployments"]
    handles: dict[str, Any] = {
        model: DeploymentHandle(engines_deployment(model), args["engines_app"]) for model in models
    }
    return ingress.bind(*ingress.init_args, **{**ingress.init_kwargs, "llm_deployments": handles})
