"""``servetune init``: a search space from a model, GPUs and a scenario, pruned by the memory ledger."""

import pytest
import yaml

from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.cli import main
from servetune.config.scenarios import SCENARIOS, render_space
from servetune.config.workload import load_workload, mean_lengths
from servetune.errors import UserError
from servetune.space_file import load_space


def servetune(capsys, *argv) -> tuple[int, str, str]:
    """The command called in this process (``servetune.cli.main``, as the other CLI tests call it): its exit status,
    stdout and stderr. A subprocess each cost this file about 12 interpreter starts, each dry run importing Ray Tune
    again (3-4 core-s each)."""
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_a_70b_long_context_space_is_pruned_by_the_ledger(tmp_path):
    text = render_space("meta-llama/Llama-3.1-70B-Instruct", "long-context", "H100-SXM", 8)
    data = yaml.safe_load(text)
    params = data["params"]
    assert params["tensor_parallel_size"] == [2, 4]  # TP 1 cannot hold 140 GB of weights; 2 and the next one
    assert "TP 1: does not fit (weights need" in text
    assert params["max_model_len"] == [32768, 65536, 131072] and params["kv_cache_dtype"] == ["auto", "fp8"]
    assert data["search"]["baseline"] is False  # vLLM's default TP 1 would not fit
    hardware, arch = resolve_hardware("gpu", "H100-SXM"), load_model_arch("meta-llama/Llama-3.1-70B-Instruct")
    for constraint in data["constraints"][3:]:  # each generated pair is one the ledger rejects
        tp, ctx = (int(part.split("==")[1].strip(" )")) for part in constraint.split(" and "))
        args = {"tensor_parallel_size": tp, "max_model_len": ctx, "gpu_memory_utilization": 0.92, "max_num_seqs": 4}
        assert not plan_capacity(arch, args, hardware).fits
    assert data["constraints"][3:], "TP 2 cannot hold a 128K-token request of a 70B model"
    assert data["quality"]["reference"]["kv_cache_dtype"] == "auto"  # FP8 KV is checked against BF16 KV
    path = tmp_path / "space.yaml"
    path.write_text(text)
    space = load_space(path)
    assert space.quality_reference["tensor_parallel_size"] == 2


def test_without_price_the_space_is_priced_by_the_shipped_list_and_says_at_what(tmp_path):
    """No ``--price``: the space sets no price_per_device_hour (which would override the price list for every GPU
    type), and a comment cites the listed price it will be costed at; ``--price`` still sets one."""
    from servetune.capacity.prices import load_price_table

    listed = load_price_table()["L40S"]
    path = tmp_path / "space.yaml"
    path.write_text(render_space("meta-llama/Llama-3.1-8B-Instruct", "chat", "L40S", 1))
    space = load_space(path)
    assert "price_per_device_hour" not in space.model_fields_set
    assert space.pricing.resolve("L40S").usd_per_device_hour == listed.usd_per_device_hour
    assert listed.describe("L40S") in path.read_text()
    path.write_text(render_space("meta-llama/Llama-3.1-8B-Instruct", "chat", "L40S", 1, price=2.5))
    assert load_space(path).pricing.resolve("L40S").usd_per_device_hour == 2.5


def test_contexts_above_the_model_limit_are_dropped_with_a_reason():
    text = render_space("Qwen/Qwen2.5-7B-Instruct", "long-context", "H100-SXM", 2)  # a 32K model
    data = yaml.safe_load(text)
    assert data["params"]["max_model_len"] == [32768]
    assert "65536: above the model's 32768-token limit" in text and "131072: above" in text
    assert data["params"]["tensor_parallel_size"] == [1, 2]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_every_scenario_writes_a_space_that_loads_and_dry_runs(tmp_path, scenario, capsys, no_ray):
    out = tmp_path / "space.yaml"
    code, _, err = servetune(capsys, "init", "--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "L40S", "--gpus",
                             "4", "--scenario", scenario, "--price", "1.5", "--out", out)  # fmt: skip
    assert code == 0, err[-2000:]
    space = load_space(out)
    assert space.price_per_device_hour == 1.5 and space.hardware.devices_per_node == 4
    assert space.params["tensor_parallel_size"] == [1, 2]
    load_workload(space.workload)  # a shipped workload (agent included)
    code, dry, err = servetune(capsys, "run", out, "--dry-run", "--storage", tmp_path / "results")
    assert code == 0 and "would run" in dry, err[-2000:]


def test_slo_replaces_the_scenarios():
    data = yaml.safe_load(
        render_space("meta-llama/Llama-3.1-8B-Instruct", "chat", "H100-SXM", 1, slo="ttft_ms.p99=500,error_rate=0.01")
    )
    assert data["slo"] == {"ttft_ms": {"p99": 500}, "error_rate": 0.01}
    assert data["params"]["tensor_parallel_size"] == [1]


def test_agent_workload_is_multi_turn_with_long_outputs_and_json_tool_calls():
    w = load_workload("agent")
    assert w.sessions is not None and w.sessions.max_context_tokens == 32768
    plan, tool_call = w.classes
    assert plan.output_tokens.median >= 500 and w.shared_prefix.fraction >= 0.9
    assert w.structured_of(plan) is None
    structured = w.structured_of(tool_call)
    assert structured is not None and structured.kind == "json_schema"  # the tool call's schema
    assert structured.valid('{"tool": "search", "arguments": {"query": "x"}}')
    assert not structured.valid('{"tool": "rm -rf", "arguments": {}}')
    assert w.sampling_of(tool_call)["ignore_eos"] is False  # a call ends where its JSON ends


def test_the_agent_scenario_searches_the_structured_outputs_backend_and_others_do_not():
    agent = yaml.safe_load(render_space("meta-llama/Llama-3.1-8B-Instruct", "agent", "L40S", 4))
    assert agent["params"]["structured_outputs_config.backend"] == ["xgrammar", "guidance"]
    assert agent["workload"] == "agent"
    for name in set(SCENARIOS) - {"agent"}:
        other = yaml.safe_load(render_space("meta-llama/Llama-3.1-8B-Instruct", name, "L40S", 4))
        assert not any(p.startswith("structured_outputs_config") for p in other["params"]), name


def test_speculation_is_searched_where_the_guide_says_it_pays_and_nowhere_else(tmp_path):
    for name, scenario in SCENARIOS.items():
        text = render_space("meta-llama/Llama-3.1-8B-Instruct", name, "L40S", 4)
        data = yaml.safe_load(text)
        mean_in, mean_out = mean_lengths(load_workload(scenario.workload))
        # Decode-heavy (decode steps, not prompts, take a request's time) at low to mid concurrency.
        pays = mean_in <= 4 * mean_out and scenario.seqs[1] <= 64
        searched = {p: v for p, v in data["params"].items() if p.startswith("speculative.")}
        if not pays:
            assert not searched, name
            continue
        assert searched["speculative.method"] == ["none", "ngram"], name
        counts = searched["speculative.num_speculative_tokens"]
        assert 3 in counts and len(counts) >= 2, name  # the guide's example, and more to see where it stops paying
        assert data["quality"]["reference"]["speculative.method"] == "none"  # lossless against no speculation
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        space = load_space(path)
        point = {**space.quality_reference, "speculative.method": "ngram", "speculative.num_speculative_tokens": 3}
        engine, _ = space.engine_params(point)
        assert engine["speculative_config"] == {"method": "ngram", "num_speculative_tokens": 3}
        assert "speculative_config" not in space.engine_params(space.quality_reference)[0]
    assert {n for n, s in SCENARIOS.items() if s.speculative_tokens} == {"chat", "agent"}


def test_a_scenario_that_searches_speculation_sends_text_not_random_words():
    """Random words give n-gram speculation nothing to find (issue #41 item 6): the workload of every scenario whose
    space searches it cuts its prompts from text, or its acceptance and gain would be measured on noise."""
    for name, scenario in SCENARIOS.items():
        if scenario.speculative_tokens:
            workload = load_workload(scenario.workload)
            assert workload.text != "random" and workload.source_text, name


def test_init_writes_a_floor_given_by_slo_and_the_agent_space_loads_with_it(tmp_path):
    text = render_space("meta-llama/Llama-3.1-8B-Instruct", "agent", "L40S", 1,
                        slo="ttft_ms.p99=3000,structured_valid.min=0.98")  # fmt: skip
    assert yaml.safe_load(text)["slo"] == {"ttft_ms": {"p99": 3000}, "structured_valid": {"min": 0.98}}
    path = tmp_path / "space.yaml"
    path.write_text(text)
    assert "structured_valid >= 0.98" in [str(b) for b in load_space(path).slo_bounds.bounds]


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--model", "no-such-model", "--scenario", "chat"],
            "not a hub id (org/name) and not in servetune's catalogue",
        ),
        (
            ["--model", "meta-llama/Llama-3.1-70B-Instruct", "--gpu", "L4", "--gpus", "2", "--scenario", "chat"],
            "no tensor-parallel size up to 2 GPUs holds it",
        ),
        (
            [
                "--model",
                "meta-llama/Llama-3.1-8B-Instruct",
                "--gpu",
                "H100-SXM",
                "--scenario",
                "chat",
                "--slo",
                "ttft.p99=1",
            ],
            "--slo: unknown metric 'ttft'",
        ),
        (["--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H9000", "--scenario", "chat"], "H9000"),
        (
            ["--model", "meta-llama/Llama-3.1-8B-Instruct", "--gpu", "H100-SXM", "--scenario", "chat", "--gpus", "0"],
            "--gpus must be at least 1",
        ),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, argv, needle, capsys):
    out = tmp_path / "space.yaml"
    code, _, err = servetune(capsys, "init", *argv, "--out", out)  # a traceback would fail the test here
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.iterdir())


def test_unknown_scenario_is_refused():
    with pytest.raises(UserError, match="known scenarios are chat, rag, batch"):
        render_space("meta-llama/Llama-3.1-8B-Instruct", "gaming", "H100-SXM", 1)
