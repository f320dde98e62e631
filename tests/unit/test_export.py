"""Turning one operating point into a vllm serve command or a Ray Serve LLM config."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import subprocess
import sys

import pytest
import yaml

from servetune.errors import UserError
from servetune.report import ReportPoint
from servetune.report.export import health_check_config, ray_serve_app, ray_serve_yaml, vllm_command


def point(engine_args: dict, env: dict | None = None, device: str = "gpu", concurrency: float = 16.0) -> ReportPoint:
    return ReportPoint(
        trial_id="abc123", level={"concurrency": concurrency}, engine_args=engine_args, env=env or {},
        model="/models/my model", device=device, metrics={"cost_per_mtok_usd": 1.0},
    )  # fmt: skip


def test_vllm_command_flags_follow_engine_argv_and_quote_for_the_shell():
    args = {
        "enable_prefix_caching": False, "compilation_config": {"level": 3}, "model": "ignored", "port": 8000,
        "api_key": "sk-live", "max_num_seqs": 64, "served_model_name": "chat model", "quantization": None,
    }  # fmt: skip
    text = vllm_command(point(args, env={"VLLM_CPU_KVCACHE_SPACE": "4", "MY_SECRET": "s3"}))
    assert "sk-live" not in text and "s3" not in text and "ignored" not in text and "8000" not in text
    assert "# *** marks a secret servetune does not print" in text
    command = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    tokens = shlex.split(command.replace("\\\n", " "))
    assert tokens == [
        "VLLM_CPU_KVCACHE_SPACE=4", "MY_SECRET=***", "vllm", "serve", "/models/my model",
        "--no-enable-prefix-caching", "--compilation-config", '{"level": 3}', "--api-key", "***",
        "--max-num-seqs", "64", "--served-model-name", "chat model",
    ]  # fmt: skip


def test_cpu_command_says_how_to_run_without_the_vllm_script(tmp_path):
    """The hint is ``vllm serve`` as the trials launch it (the deprecated api_server module is gone from it), and the
    printed command runs: against a stand-in ``vllm`` package that shows what vLLM's CLI entry point was given."""
    text = vllm_command(point({"max_num_seqs": 8}, device="cpu"))
    assert "vllm.entrypoints.openai.api_server" not in text
    hint = next(line for line in text.splitlines() if line.startswith("# vllm-cpu:"))
    command = shlex.split(next(part for part in hint.split("`") if part.startswith("python -c ")))
    assert command[0] == "python" and command[-2:] == ["serve", "/models/my model"]
    cli = tmp_path / "vllm" / "entrypoints" / "cli"
    cli.mkdir(parents=True)
    for folder in (cli.parent.parent, cli.parent, cli):
        (folder / "__init__.py").write_text("")
    (cli / "main.py").write_text(
        "import importlib.metadata, json, sys\n"
        "def main():\n    print(json.dumps([sys.argv, importlib.metadata.version('vllm')]))\n"
    )
    ran = subprocess.run([sys.executable, *command[1:], "--max-num-seqs", "8"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tmp_path)}, check=True, timeout=60)  # fmt: skip
    argv, version = json.loads(ran.stdout)
    assert argv == ["vllm", "serve", "/models/my model", "--max-num-seqs", "8"]
    assert version == importlib.metadata.version("vllm-cpu") + "+cpu"


def test_served_model_name_becomes_the_model_id_and_tensor_parallel_cpu_ranks_get_bundles():
    app = ray_serve_app(point({"served_model_name": ["chat"], "tensor_parallel_size": 2}, device="cpu"))
    (config,) = app["applications"][0]["args"]["llm_configs"]
    assert config["model_loading_config"] == {"model_id": "chat", "model_source": "/models/my model"}
    assert config["engine_kwargs"] == {"tensor_parallel_size": 2}
    assert config["placement_group_config"] == {"bundles": [{"CPU": 1}, {"CPU": 1}]}
    assert "accelerator_type" not in config and "runtime_env" not in config


def test_expert_parallel_keeps_data_parallel_in_the_engine_with_the_dp_builder():
    app = ray_serve_app(point({"data_parallel_size": 4, "enable_expert_parallel": True}, concurrency=128))[
        "applications"
    ][0]
    assert app["import_path"] == "ray.serve.llm:build_dp_openai_app"
    config = app["args"]["llm_config"]
    assert config["engine_kwargs"]["data_parallel_size"] == 4
    assert config["deployment_config"]["autoscaling_config"] == {
        "min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 32,
    }  # fmt: skip


def test_rate_levels_set_no_target_and_gpu_without_accelerator_type_says_so():
    p = ReportPoint(trial_id="r", level={"rate": 4.0}, model="m", engine_args={})
    text = ray_serve_yaml(p)
    assert "# accelerator_type unknown" in text
    config = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"][0]
    assert config["deployment_config"] == {
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 1}, **health_check_config()
    }  # fmt: skip


def test_accelerator_type_on_a_cpu_study_is_a_user_error():
    with pytest.raises(UserError, match="--accelerator-type H100: the study ran on CPUs"):
        ray_serve_app(point({}, device="cpu"), accelerator_type="H100")


@pytest.mark.parametrize(
    "engine_args, bundles, strategy",
    [
        ({"tensor_parallel_size": 2}, [{"GPU": 1}, {"GPU": 1}], "STRICT_PACK"),  # a TP group never split across nodes
        ({}, [{"GPU": 1}], "STRICT_PACK"),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 2}, None, "PACK"),  # stages may span nodes
    ],
)  # fmt: skip
def test_a_gpu_replica_is_packed_on_one_node_of_its_type_as_ray_serve_llm_reads_it(engine_args, bundles, strategy):
    from ray.serve.llm import LLMConfig

    app = ray_serve_app(point(engine_args), accelerator_type="H100")
    (config,) = app["applications"][0]["args"]["llm_configs"]
    assert (config.get("placement_group_config") or {}).get("bundles") == bundles
    engine = LLMConfig(**config).get_engine_config()  # Ray Serve LLM's own reading: what it will ask Ray for
    assert engine.placement_strategy == strategy
    assert len(engine.placement_bundles) == engine.num_devices
    assert all(b["GPU"] == 1 and b["accelerator_type:H100"] > 0 for b in engine.placement_bundles)


def test_the_llm_deployment_is_health_checked_sooner_than_serves_defaults_and_the_yaml_says_why():
    """A dead engine is found within a few periods: vLLM's check fails at once on it, and Serve marks a replica dead
    after its threshold of failed checks in a row; with Serve's defaults that took 40 s in verify's replica_lost."""
    from ray.serve._private import constants
    from ray.serve._private.config import DeploymentConfig

    text = ray_serve_yaml(point({}, device="cpu"))
    (config,) = yaml.safe_load(text)["applications"][0]["args"]["llm_configs"]
    checked = DeploymentConfig(**config["deployment_config"])  # the installed Serve's own validation
    assert checked.health_check_period_s < constants.DEFAULT_HEALTH_CHECK_PERIOD_S
    assert checked.health_check_timeout_s < constants.DEFAULT_HEALTH_CHECK_TIMEOUT_S
    found_within_s = checked.health_check_period_s * (constants.REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD + 1)
    assert found_within_s <= 10  # "a few seconds", against the 40 s measured
    why = next(line for line in text.splitlines() if line.startswith("# Health check: "))
    assert "replica_lost" in why and "40 s" in why and f"{found_within_s:g} s" in why
