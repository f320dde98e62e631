"""Typed results that measurement writes and tracking/reports read (no imports of trial/)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from servetune.metrics import LevelSummary

_SECRET = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|API_KEY|ACCESS_KEY|CREDENTIAL|AUTH", re.IGNORECASE)


def redact_env(env: Mapping[str, str]) -> dict[str, str]:
    """Environment safe to write to disk, MLflow or a report: secrets become ``***``."""
    return {k: ("***" if _SECRET.search(k) else v) for k, v in env.items()}


class LevelResult(BaseModel):
    """One load level: the client's summary, the server's own counters, and the SLO verdict."""

    model_config = ConfigDict(extra="forbid")

    summary: LevelSummary
    server_metrics: dict[str, float] = {}
    slo_violations: list[str] = []

    @property
    def meets_slo(self) -> bool:
        return not self.slo_violations


class KvCapacityReport(BaseModel):
    model_config = ConfigDict(extra="forbid")

    tokens: int
    max_concurrency: float | None = None
    at_tokens_per_request: int | None = None
    engines: int = 1


class BenchResult(BaseModel):
    """The JSON document ``servetune bench --json`` writes."""

    model_config = ConfigDict(extra="forbid")

    servetune_version: str
    created: str
    url: str
    model: str
    served_model_name: str
    engine_args: dict[str, Any]
    env: dict[str, str]
    command: list[str] | None
    vllm_version: str | None
    workload_file: str | None
    workload: dict[str, Any]
    slo: list[str]
    num_requests: int | None
    duration_s: float | None
    kv_capacity: KvCapacityReport | None
    startup_s: float | None
    levels: list[LevelResult]
    requests_file: str | None = None
