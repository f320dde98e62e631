"""Versions pinned on the Ray Serve LLM application ``build_openai_app`` makes, so Serve keeps replicas a deploy
does not need to replace (Serve compares a pinned version, not the code)."""

from __future__ import annotations

import hashlib
import json
from typing import Any


def pin_llm_servers(app: Any, version: str) -> None:
    """Give the LLM deployments ``build_openai_app`` bound into its ingress a fixed version. Ray 2.60 has no
    public way: ``Deployment.options(version=...)`` is refused unless ``_internal``, and ``serve deploy``'s
    config puts the request router into the code version (a router change restarts every replica)."""
    servers = app._bound_deployment.init_kwargs.get("llm_deployments") or {}
    for server in servers.values():
        server._bound_deployment = server._bound_deployment.options(version=version, _internal=True)


def pin_ingress(app: Any, routed_by: Any = None) -> None:
    """Give the OpenAI ingress ``build_openai_app`` made the version of what it is built from: its constructor's
    arguments but the LLM deployments' handles (which name the deployments, not their versions): the model cards (the
    model ids and their context lengths), LoRA paths, extra arguments; and ``routed_by``, the LLM deployment's
    ``request_router_config`` (None: Serve's default router). Deployed again with the same, Serve keeps the ingress
    replica (a version pinned is compared, not the code: ``pin_llm_servers``); with other model cards, or another
    router, it replaces it: the ingress's handle builds its request router once, so only a new ingress routes with a
    new one. Unpinned, Serve gives it a new version at every deploy."""
    bound = app._bound_deployment
    app._bound_deployment = bound.options(version=ingress_version(bound.name, bound.init_kwargs, routed_by),
                                          _internal=True)  # fmt: skip


def ingress_version(name: str, init_kwargs: dict[str, Any], routed_by: Any = None) -> str:
    """The version :func:`pin_ingress` gives an ingress deployment ``name`` built with ``init_kwargs`` that routes
    with ``routed_by``: equal exactly when Serve may keep the running ingress replica."""
    built_from = {key: value for key, value in init_kwargs.items() if key != "llm_deployments"}
    cards = built_from.get("model_cards") or {}
    built_from["model_cards"] = {model: card.model_dump() if hasattr(card, "model_dump") else card
                                 for model, card in cards.items()}  # fmt: skip
    if routed_by:  # unrouted, the version is the one a deploy without a router config always had
        built_from["request_router_config"] = routed_by
    text = json.dumps([name, built_from], sort_keys=True, default=str)
    return f"ingress-{hashlib.sha256(text.encode()).hexdigest()[:16]}"
