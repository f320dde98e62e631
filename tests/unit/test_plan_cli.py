"""``servetune plan``, called in-process: JSON keys, the table, and bad input as one line and exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import servetune.cli as cli
from servetune.models.tiny import TINY_CONFIG

REQUIRED_KEYS = {
    "weights_gib",
    "activation_gib",
    "non_torch_gib",
    "kv_cache_gib",
    "kv_cache_tokens",
    "max_concurrency",
    "fits",
    "reason",
}


@pytest.fixture
def tiny_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY_CONFIG))
    return tmp_path


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert "Traceback" not in captured.err
    assert lines[0].startswith("servetune plan: error: ")
    return lines[0]


def test_json_output_has_the_ledger_keys(capsys) -> None:
    rc = cli.main(
        ["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--max-model-len", "8192", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    assert out.keys() >= REQUIRED_KEYS
    assert out["fits"] is True and out["kv_cache_tokens"] > 400_000
    assert out["settings"]["max_model_len"] == 8192 and out["settings"]["gpu"] == "H100-SXM"


def test_cpu_mode_reports_the_cpu_builds_token_count(capsys, tiny_dir) -> None:
    rc = cli.main(
        [
            "plan",
            "--model",
            str(tiny_dir),
            "--device",
            "cpu",
            "--cpu-kvcache-space-gib",
            "1",
            "--enforce-eager",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["kv_cache_tokens"] == 524_288
    rc = cli.main(
        ["plan", "--model", str(tiny_dir), "--device", "cpu", "--cpu-kvcache-space-gib", "1", "--tp", "2", "--json"]
    )
    assert json.loads(capsys.readouterr().out)["kv_cache_tokens"] == 1_048_576


def test_table_output_and_exit_1_when_it_does_not_fit(capsys) -> None:
    rc = cli.main(
        ["plan", "--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "A100-80GB", "--max-model-len", "8192"]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "KV pool" in out and "does not fit" in out and "raise --tp to 2" in out


def test_table_output_when_it_fits(capsys) -> None:
    rc = cli.main(
        [
            "plan",
            "--model",
            "TheBloke/Mistral-7B-Instruct-v0.2-AWQ",
            "--gpu-memory-gib",
            "79.15",
            "--max-model-len",
            "8192",
            "--request-tokens",
            "2000",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "fits" in out and "at request length" in out


def test_missing_config_field_names_the_field(capsys, tmp_path) -> None:
    config = {k: v for k, v in TINY_CONFIG.items() if k != "num_attention_heads"}
    config["model_type"] = "some_new_arch"  # a model transformers knows gets its class's default instead
    (tmp_path / "config.json").write_text(json.dumps(config))
    rc = cli.main(["plan", "--model", str(tmp_path), "--gpu", "L4"])
    line = _one_line_error(capsys)
    assert rc == 2 and "config.json" in line and "num_attention_heads" in line


def test_unknown_gpu_lists_the_known_ones(capsys) -> None:
    rc = cli.main(["plan", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "TPU-v9"])
    line = _one_line_error(capsys)
    assert rc == 2 and "TPU-v9" in line and "H100-SXM" in line and "A100-80GB" in line and "--gpu-memory-gib" in line


def test_tp_that_does_not_divide_the_heads(capsys) -> None:
    rc = cli.main(["plan", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "H100", "--tp", "8"])
    line = _one_line_error(capsys)
    assert rc == 2 and "--tp 8" in line and "num_attention_heads 28" in line


@pytest.mark.parametrize("value", ["0", "-0.5", "1.01"])
def test_utilization_out_of_range(capsys, value: str) -> None:
    rc = cli.main(["plan", "--model", "Qwen/Qwen2.5-7B-Instruct", "--gpu", "H100", f"--gpu-memory-utilization={value}"])
    line = _one_line_error(capsys)
    assert rc == 2 and "--gpu-memory-utilization" in line


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--device", "cpu"], "--cpu-kvcache-space-gib"),
        (["--device", "cpu", "--cpu-kvcache-space-gib", "1.5"], "--cpu-kvcache-space-gib"),
        (["--gpu", "H100", "--max-num-seqs", "0"], "--max-num-seqs"),
        (["--gpu", "H100", "--kv-cache-dtype", "int3"], "--kv-cache-dtype"),
        ([], "--gpu"),
    ],
)
def test_other_bad_input_is_one_line(capsys, argv: list[str], flag: str) -> None:
    rc = cli.main(["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", *argv])
    line = _one_line_error(capsys)
    assert rc == 2 and flag in line


@pytest.mark.parametrize(
    "argv, what",
    [
        (["--quantization", "quark"], "quantization quark"),
        (["--quantization", "gguf"], "quantization gguf"),
    ],
)
def test_what_the_planner_cannot_size_is_not_planned_and_exits_0(capsys, argv: list[str], what: str) -> None:
    rc = cli.main(["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", *argv])
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 0 and out.startswith(f"not planned: {what}") and "does not fit" not in out
    rc = cli.main(["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--json", *argv])
    document = json.loads(capsys.readouterr().out)
    assert rc == 0 and document["planned"] is False and document["reason"].startswith(what)


def test_the_plan_page_calls_not_planned_only_what_is_not_planned(capsys) -> None:
    """docs/commands/plan.md lists what the ledger cannot size: each flag it names is "not planned", and none of the
    KV cache dtypes and weight formats the ledger does size is in that list (issue 39 moved several out of it)."""
    from servetune.capacity.kvdtype import KV_CACHE_DTYPES
    from servetune.capacity.settings import QUANTIZATIONS

    text = " ".join((Path(__file__).parents[2] / "docs" / "commands" / "plan.md").read_text().split())
    found = re.search(r"What the ledger cannot size \((.*?)\) is `not planned: REASON`", text)
    assert found, "the plan page no longer says what is not planned"
    named = found.group(1)
    flags = re.findall(r"`(--kv-cache-dtype|--quantization) ([\w-]+)`", named)
    assert flags, named
    for flag, value in flags:
        argv = ["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--json", flag, value]
        assert cli.main(argv) == 0 and json.loads(capsys.readouterr().out)["planned"] is False, (flag, value)
    planned = {*KV_CACHE_DTYPES, *QUANTIZATIONS} - {value for _, value in flags}
    assert not [value for value in planned if re.search(rf"\b{re.escape(value)}\b", named)], named


@pytest.mark.parametrize(
    "argv", [["--kv-cache-dtype", "int4_per_token_head"], ["--kv-cache-dtype", "nvfp4"], ["--quantization", "modelopt"]]
)
def test_kv_dtypes_and_weight_formats_vllm_0_32_takes_are_planned(capsys, argv: list[str]) -> None:
    rc = cli.main(["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--json", *argv])
    document = json.loads(capsys.readouterr().out)
    assert rc == 0 and document["fits"] is True and document.get("planned", True) is not False


def test_a_context_past_the_model_s_positions_is_refused_as_vllm_refuses_it(capsys, monkeypatch) -> None:
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    argv = ["plan", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100", "--max-model-len", "200000"]
    rc = cli.main(argv)
    out = " ".join(capsys.readouterr().out.split())
    assert rc == 1 and "exceeds the model's max_position_embeddings 131072" in out
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM starts anyway, and so the plan sizes it
    assert (
        cli.main([*argv, "--json"]) == 0 and json.loads(capsys.readouterr().out)["settings"]["max_model_len"] == 200000
    )


def test_unknown_model_is_one_line(capsys) -> None:
    rc = cli.main(["plan", "--model", "nobody-nothing", "--gpu", "H100"])
    line = _one_line_error(capsys)
    assert rc == 2 and "nobody-nothing" in line


@pytest.mark.parametrize(
    "hub_id, groups_note",
    [
        ("google/gemma-3-27b-it", "KV cache groups of 10 layers: 6 x sliding 1024, 1 x full"),
        ("openai/gpt-oss-120b", "KV cache groups of 18 layers: 1 x sliding 128, 1 x full"),
        ("openai/gpt-oss-20b", "KV cache groups of 12 layers: 1 x sliding 128, 1 x full"),
    ],
)
def test_sliding_window_models_plan_offline_from_the_catalogue(capsys, hub_id: str, groups_note: str) -> None:
    """#39: gemma-3 and gpt-oss answer offline; window layers hold only their window per request."""
    rc = cli.main(["plan", "--model", hub_id, "--gpu", "H100-SXM", "--max-model-len", "32768", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["fits"] is True
    assert groups_note in out["notes"]
    # Every layer keeping every token would give kv_cache_gib / bytes per token; windows give more.
    full_attention_tokens = out["kv_cache_gib"] * (1 << 30) / out["kv_bytes_per_token"]
    assert out["kv_cache_tokens"] > 1.2 * full_attention_tokens


def test_gemma3_at_its_full_context_on_one_h100_is_refused_with_advice(capsys) -> None:
    rc = cli.main(["plan", "--model", "google/gemma-3-27b-it", "--gpu", "H100-SXM"])
    out = capsys.readouterr().out
    assert rc == 1 and "not enough for one request of max_model_len 131,072" in out
    assert "--kv-cache-dtype fp8" in out
