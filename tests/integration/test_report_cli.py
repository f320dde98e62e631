"""``servetune report`` and ``servetune export`` as a user runs them, on a made-up study directory."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import yaml

from servetune.cli import main
from tests.builders import demo_study, demo_trials, level, study_info, trial, write_study


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_report_writes_html_png_markdown_and_prints_the_recommendation(tmp_path, capsys):
    root = demo_study(tmp_path / "demo")
    code, out, err = run_cli(capsys, "report", root)
    assert code == 0, err
    report_dir = root / "report"
    names = sorted(p.name for p in report_dir.iterdir())
    assert names == [
        "pareto-cost-vs-e2el.png", "pareto-cost-vs-tpot.png", "pareto-cost-vs-ttft.png",
        "pareto-throughput-vs-interactivity.png", "report.html", "summary.md",
    ]  # fmt: skip
    assert f"wrote {report_dir / 'report.html'}" in out and f"wrote {report_dir / 'summary.md'}" in out
    assert "study demo: 2 COMPLETE, 1 INFEASIBLE, 1 FAILED, 1 not read; 5 operating points" in out
    assert "recommendation: trial t16 (max_num_seqs=16, gpu_memory_utilization=0.9) at concurrency 16" in out
    assert "why: stepped one notch back from the out-of-memory boundary" in out


def test_report_out_dir_and_another_price(tmp_path, capsys):
    root = demo_study(tmp_path / "demo")
    code, _, err = run_cli(capsys, "report", root, "--out", tmp_path / "elsewhere", "--price-per-gpu-hour", "4")
    assert code == 0, err
    md = (tmp_path / "elsewhere" / "summary.md").read_text()
    assert "$4 per device-hour (from --price-per-gpu-hour)" in md
    assert "| 0 | t32 | max_num_seqs=32, gpu_memory_utilization=0.9 | concurrency 32 | 0.9259 |" in md  # twice $2's
    assert not (root / "report").exists()


def test_export_vllm_command_masks_secrets(tmp_path, capsys):
    trials = demo_trials()
    trials[0] = trial("t16", trials[0].params, trials[0].levels,
                      env={"VLLM_CPU_KVCACHE_SPACE": "1", "HF_TOKEN": "hf_real_secret"})  # fmt: skip
    root = write_study(tmp_path / "demo", study_info(), trials)
    code, out, err = run_cli(capsys, "export", root, "--format", "vllm")
    assert code == 0, err
    assert "hf_real_secret" not in out
    lines = out.splitlines()
    assert lines[0] == "# servetune: trial t16, measured at concurrency 16"
    assert lines[1] == "# Admission bounds (503 past them), derived from the trial's measurements:"
    assert lines[4] == "# *** marks a secret servetune does not print: put the real value there"
    assert lines[5] == "VLLM_CPU_KVCACHE_SPACE=1 HF_TOKEN='***' vllm serve org/tiny-chat \\"
    assert lines[6:] == ["  --enforce-eager \\", "  --max-model-len 2048 \\", "  --max-num-seqs 16 \\",
                         "  --gpu-memory-utilization 0.9 \\", "  --max-num-queued-reqs 33 \\",
                         "  --max-num-queued-tokens 2940"]  # fmt: skip
    # 16 in flight + the queue that drains, at the level's 11.67 req/s, within what the 2 s TTFT bound leaves after
    # the 0.6 s TTFT P99 measured there: ceil(11.67 x 1.4) = 17
    assert lines[2].startswith("#   max_num_queued_reqs: 33: 16 in flight (its 16 clients) + a queue of 17")


def test_export_pins_what_vllm_resolved_and_a_trial_id_picks_its_chosen_level(tmp_path, capsys):
    trials = demo_trials()
    resolved = {"max_num_seqs": 256, "max_num_batched_tokens": 8192, "block_size": 16, "dtype": "bfloat16"}
    trials[1] = trials[1].model_copy(update={"resolved_engine_args": resolved})  # t32, which set max_num_seqs 32
    root = write_study(tmp_path / "demo", study_info(), trials)
    code, out, err = run_cli(capsys, "export", root, "--pick", "t32", "--format", "vllm")
    assert code == 0, err
    assert out.splitlines()[0] == "# servetune: trial t32, measured at concurrency 32"  # best meeting the SLO, not 64
    flags = [line.strip().rstrip(" \\") for line in out.splitlines()[2:]]
    assert "--max-num-seqs 32" in flags and "--max-num-seqs 256" not in flags  # what the trial set wins
    assert {"--max-num-batched-tokens 8192", "--block-size 16", "--dtype bfloat16"} <= set(flags)


def test_export_pick_n_indexes_the_cost_vs_ttft_table(tmp_path, capsys):
    root = demo_study(tmp_path / "demo")
    for pick, expected in (("0", ("t32", 1)), ("2", ("t16", 0)), ("best", ("t16", 1))):
        code, out, err = run_cli(capsys, "export", root, "--pick", pick, "--format", "json")
        assert code == 0, err
        doc = json.loads(out)
        assert (doc["trial_id"], doc["level_index"]) == expected
        assert doc["recommended"] is (pick == "best")
    assert doc["params"] == {"max_num_seqs": 16, "gpu_memory_utilization": 0.9}
    assert doc["metrics"]["cost_per_mtok_usd"] == pytest.approx(2 / (700 * 3600) * 1e6)
    assert doc["recommendation_reason"].startswith("stepped one notch back")


def test_export_ray_serve_config(tmp_path, capsys):
    dp = trial("dp", {"max_num_seqs": 32, "data_parallel_size": 2, "tensor_parallel_size": 2},
               [level(64, 4000, 800)], devices=4, env={"HF_TOKEN": "x"})  # fmt: skip
    root = write_study(tmp_path / "s", study_info(), [dp])
    code, out, err = run_cli(capsys, "export", root, "--format", "ray-serve", "--accelerator-type", "H100")
    assert code == 0, err
    assert out.startswith("# Ray Serve LLM application (servetune trial dp, measured at concurrency 64).")
    (app,) = yaml.safe_load(out)["applications"]
    assert app["import_path"] == "ray.serve.llm:build_openai_app" and app["route_prefix"] == "/"
    (config,) = app["args"]["llm_configs"]
    assert config["model_loading_config"] == {"model_id": "org/tiny-chat", "model_source": "org/tiny-chat"}
    assert config["accelerator_type"] == "H100"
    assert config["engine_kwargs"] == {"enforce_eager": True, "max_model_len": 2048, "max_num_seqs": 32,
                                       "tensor_parallel_size": 2}  # fmt: skip
    # Autoscaling at the default headroom, 0.8 of the highest load meeting the SLO (64 in flight, no knee found
    # below it): 51.2 in flight over 2 data-parallel replicas is 25 a replica; the ladder's top (64) needs 3; the
    # queue holds what the TTFT P99 bound (2 s) leaves after the 800 ms measured there, 1.2 s, of 3 x 26.67 req/s
    # (33.3 a replica at 64, scaled to 51.2).
    deployment = config["deployment_config"]
    scaling = deployment["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 3, 25)
    assert (scaling["upscale_delay_s"], scaling["downscale_delay_s"]) == (120.0, 600.0)  # section 11
    assert deployment["max_ongoing_requests"] == 32  # 1.25 x target
    assert deployment["max_queued_requests"] == math.ceil(3 * 0.8 * (4000 / 60) / 2 * 1.2 - 1e-9) == 96
    assert "#   max_queued_requests: 96: 3 replicas x 26.67 req/s x 1.2 s of queue wait" in out
    assert config["runtime_env"] == {"env_vars": {"HF_TOKEN": "***"}}
    # --headroom 1: at the measured load itself, 32 a replica, 2 replicas, the queue of 2 x 33.3 req/s x 1.2 s.
    code, out, err = run_cli(capsys, "export", root, "--format", "ray-serve", "--headroom", "1")
    assert code == 0, err
    deployment = yaml.safe_load(out)["applications"][0]["args"]["llm_configs"][0]["deployment_config"]
    scaling = deployment["autoscaling_config"]
    assert (scaling["min_replicas"], scaling["max_replicas"], scaling["target_ongoing_requests"]) == (1, 2, 32)
    assert deployment["max_queued_requests"] == math.ceil(2 * (4000 / 60) / 2 * 1.2 - 1e-9)


def test_exported_ray_serve_configs_validate_with_ray_serve_llm(tmp_path, capsys):
    pytest.importorskip("ray.serve.llm")
    cpu = trial("cpu", {"max_num_seqs": 8}, [level(8, 300, 400)], device="cpu", env={"VLLM_CPU_KVCACHE_SPACE": "1"})
    gpu = trial("gpu", {"max_num_seqs": 8}, [level(8, 300, 400)])
    docs = []
    for t, extra in ((cpu, []), (gpu, ["--accelerator-type", "H100"])):
        root = write_study(tmp_path / t.trial_id, study_info(device=t.device), [t])
        code, out, err = run_cli(capsys, "export", root, "--format", "ray-serve", *extra)
        assert code == 0, err
        docs.append(yaml.safe_load(out)["applications"][0]["args"])
    check = textwrap.dedent("""
        import json, sys
        from ray.serve.llm import LLMServingArgs
        for doc in json.load(sys.stdin):
            LLMServingArgs.model_validate(doc)
        print("valid")
    """)
    done = subprocess.run(
        [sys.executable, "-c", check], input=json.dumps(docs), capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and done.stdout.strip().endswith("valid"), done.stderr[-2000:]


def test_nothing_meets_the_slo(tmp_path, capsys):
    slow = trial("slow", {"max_num_seqs": 8}, [level(8, 300, 9000, violations=("ttft_ms_p99 = 9000 > 2000",))])
    root = write_study(tmp_path / "s", study_info(), [slow])
    code, out, err = run_cli(capsys, "report", root)
    assert code == 0, err
    assert "recommendation: none: no configuration met every SLO (1 operating point from 1 trial)" in out
    code, out, err = run_cli(capsys, "export", root, "--format", "vllm")
    assert code == 2 and err.strip() == (
        "servetune export: error: --pick best: nothing to export, no configuration met every SLO "
        "(1 operating point from 1 trial)"
    )


def _break_json(root):
    (root / "trials" / "t32" / "result.json").write_text('{"trial_id": "t32", ')
    return "t32/result.json: not valid JSON"


def _break_field(root):
    path = root / "trials" / "t16" / "result.json"
    doc = json.loads(path.read_text())
    doc["levels"][0]["summary"]["output_throughput"] = "fast"
    path.write_text(json.dumps(doc))
    return "t16/result.json: levels.0.summary.output_throughput: Input should be a valid number"


@pytest.mark.parametrize(
    "command, damage",
    [
        (["report", "{missing}"], lambda root: f"{root.parent / 'missing'}: no such study directory"),
        (["report", "{root}"], _break_json),
        (["export", "{root}", "--format", "json"], _break_field),
        (["report", "{root}/study.json"], lambda root: "study.json: not a directory"),
        (["export", "{root}", "--pick", "7", "--format", "vllm"], lambda root: "--pick 7: the cost vs P99 TTFT Pareto table has rows 0-2"),
        (["export", "{root}", "--pick", "cheap", "--format", "vllm"], lambda root: "--pick 'cheap': give 'best', a row number"),
        (["export", "{root}", "--pick", "t64", "--format", "vllm"], lambda root: "--pick t64: the trial measured no load level (FAILED: "),
        (["report", "{root}", "--price-per-gpu-hour", "-1"], lambda root: "--price-per-gpu-hour -1: a price cannot be negative"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys, command, damage):
    root = demo_study(tmp_path / "demo")
    needle = damage(root)
    argv = [a.replace("{root}", str(root)).replace("{missing}", str(tmp_path / "missing")) for a in command]
    code, out, err = run_cli(capsys, *argv)
    assert code == 2, (out, err)
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_skip_unreadable_counts_the_broken_trial(tmp_path, capsys):
    root = demo_study(tmp_path / "demo")
    _break_json(root)
    code, out, err = run_cli(capsys, "report", root, "--skip-unreadable")
    assert code == 0, err
    assert "1 COMPLETE, 1 INFEASIBLE, 1 FAILED, 2 not read" in out
    md = (root / "report" / "summary.md").read_text()
    assert "trials/t32`: not valid JSON" in md
