"""``export --format ray-serve --keep-ingress``: the OpenAI ingress and the engines as two applications, so that a
config deploy of another point keeps the ingress replica. Serve versions a config-deployed application as a whole
(its code version: Ray's own ``get_app_code_version`` of the application's config, read here), so what decides it is
which application's config changes between two points."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from servetune.cli import main
from servetune.errors import UserError
from servetune.report import ReportPoint
from servetune.report.export import ENGINES_BUILDER, INGRESS_BUILDER, ray_serve_app, ray_serve_yaml

pytest.importorskip("ray.serve")


def point(engine_args: dict, env: dict | None = None, concurrency: float = 8.0) -> ReportPoint:
    return ReportPoint(trial_id="t1", level={"concurrency": concurrency}, engine_args=engine_args, env=env or {},
                       model="/models/tiny", device="cpu", metrics={})  # fmt: skip


def exported(p: ReportPoint, keep_ingress: bool = True) -> dict:
    return yaml.safe_load(ray_serve_yaml(p, autoscaling="fixed here", keep_ingress=keep_ingress))


def code_versions(config: dict) -> dict[str, str]:
    """Each application's code version as Serve's controller computes it from the config (``serve deploy``)."""
    from ray.serve._private.deploy_utils import get_app_code_version
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    return {app.name: get_app_code_version(app) for app in schema.applications}


PICK = point({"max_model_len": 1024, "max_num_seqs": 4}, {"SERVETUNE_FAKE_TTFT_MS": "20"})
RUNNER_UP = point({"max_model_len": 1024, "max_num_seqs": 8, "enable_chunked_prefill": True},
                  {"SERVETUNE_FAKE_TTFT_MS": "60"}, concurrency=16.0)  # fmt: skip


def test_the_ingress_application_holds_only_what_the_ingress_is_built_from_and_the_engines_the_whole_llm_config():
    config = exported(PICK)
    ingress, engines = config["applications"]
    assert (ingress["name"], ingress["route_prefix"], ingress["import_path"]) == ("llm", "/", INGRESS_BUILDER)
    assert (engines["name"], engines["route_prefix"], engines["import_path"]) == ("llm-engines", None, ENGINES_BUILDER)
    assert ingress["args"] == {
        "engines_app": "llm-engines",
        "llm_configs": [{"model_loading_config": {"model_id": "/models/tiny", "model_source": "/models/tiny"},
                         "engine_kwargs": {"max_model_len": 1024}}],
    }  # fmt: skip
    unsplit = ray_serve_app(PICK, autoscaling=None)["applications"][0]["args"]["llm_configs"][0]
    assert engines["args"] == {"llm_config": yaml.safe_load(yaml.safe_dump(unsplit))}
    text = ray_serve_yaml(PICK, autoscaling="fixed here", keep_ingress=True)
    assert "# Deploy: serve deploy this.yaml" in text and "servetune must be importable on the cluster" in text
    assert "# Deploy: serve run this.yaml\n" in ray_serve_yaml(PICK, autoscaling="fixed here")


def test_another_points_export_keeps_the_ingress_code_version_and_moves_the_engines():
    pick, runner_up = code_versions(exported(PICK)), code_versions(exported(RUNNER_UP))
    assert pick["llm"] == runner_up["llm"]  # Serve keeps the ingress replica
    assert pick["llm-engines"] != runner_up["llm-engines"]  # and replaces the engines'
    # As one application (without the flag) the ingress shares the engines' version: replaced at any change.
    assert code_versions(exported(PICK, False))["llm"] != code_versions(exported(RUNNER_UP, False))["llm"]


def test_what_the_ingress_serves_changing_moves_its_version_too():
    longer = point({"max_model_len": 2048, "max_num_seqs": 4})  # the model card's context length
    renamed = point({"max_model_len": 1024, "max_num_seqs": 4, "served_model_name": "chat"})  # its model id
    base = code_versions(exported(PICK))["llm"]
    assert code_versions(exported(longer))["llm"] != base
    assert code_versions(exported(renamed))["llm"] != base
    assert exported(renamed)["applications"][0]["args"]["llm_configs"][0]["model_loading_config"]["model_id"] == "chat"


def test_the_dp_builder_has_no_separate_ingress_to_keep():
    with pytest.raises(
        UserError, match=re.escape("--keep-ingress: the point deploys with ray.serve.llm:build_dp_openai_app")
    ):
        ray_serve_yaml(point({"data_parallel_size": 2, "enable_expert_parallel": True}), keep_ingress=True)


STUDY = Path(__file__).parents[1] / "data" / "cpu-tiny-study"


def test_the_cli_exports_two_trials_of_the_recorded_study_with_one_ingress_version(capsys):
    """Every two trials of the recorded study (other engine arguments, the same model and context length), exported
    with the predictive policy as well: one ingress code version, one engines' version per trial."""
    trials = sorted(p.name for p in (STUDY / "trials").iterdir())
    versions = []
    for trial in trials[:3]:
        assert main(["export", str(STUDY), "--pick", trial, "--format", "ray-serve", "--keep-ingress",
                     "--autoscaling-policy", "predictive"]) == 0  # fmt: skip
        versions.append(code_versions(yaml.safe_load(capsys.readouterr().out)))
    assert len({v["llm"] for v in versions}) == 1
    assert len({v["llm-engines"] for v in versions}) == len(versions)
