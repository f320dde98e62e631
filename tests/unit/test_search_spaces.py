"""The shipped search spaces, and a user's mistakes in one, through ``servetune run`` in-process.

Every file in search_spaces/ must load against vLLM's own argument parser (parameter names and
choices) and dry-run: the table of trials, with those the constraints exclude and those the
memory ledger rejects. A mistake in a space is exit code 2 and one line on stderr naming the file
and the field, before anything starts: no study directory, no Ray.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from servetune.capacity import load_catalog
from servetune.cli import main
from servetune.config.space import Range, SearchSpace
from servetune.engine.args import load_argspecs
from servetune.space_file import load_space

ROOT = Path(__file__).resolve().parents[2]
SPACES = sorted((ROOT / "search_spaces").glob("*.yaml"))
#: Checklist section 12's scenarios, one GPU space each.
GPU_SCENARIOS = ("chat-latency", "rag", "offline-batch", "long-context")
SUMMARY = re.compile(
    r"(\d+) trial\(s\) would run, (\d+) rejected by the capacity check, (\d+) excluded by the constraints"
)


@pytest.fixture(scope="module")
def argspecs():
    specs = load_argspecs()
    if specs is None:
        pytest.skip("vLLM is not installed here: parameter names cannot be checked against its parser")
    return specs


def values(space: SearchSpace, name: str) -> list:
    """The values a parameter or a fixed engine argument takes in a space."""
    if name in space.params:
        v = space.params[name]
        return v.grid_values() if isinstance(v, Range) else list(v)
    return [space.engine_args[name]]


def test_every_scenario_is_shipped():
    assert {p.stem for p in SPACES} >= {*GPU_SCENARIOS, "cpu-tiny"}


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.stem)
def test_space_loads_against_vllms_parser(path, argspecs):
    space = load_space(path, argspecs)
    assert space.name == path.stem
    assert space.params, "a search space with nothing to search"
    kept, _ = space.grid()
    assert kept, "the constraints leave nothing to run"


@pytest.mark.parametrize("path", SPACES, ids=lambda p: p.stem)
def test_dry_run_lists_trials_and_rejections(path, argspecs, tmp_path, capsys, no_ray):
    storage = tmp_path / "results"
    assert main(["run", str(path), "--dry-run", "--storage", str(storage)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    found = SUMMARY.search(out)
    assert found, out[-2000:]
    would_run, infeasible, excluded = map(int, found.groups())
    space = load_space(path, argspecs)
    kept, rejected = space.grid()
    assert would_run + infeasible == len(kept) + space.search.baseline
    assert excluded == len(rejected)
    assert out.count("excluded:") == excluded
    assert not storage.exists(), "a dry run wrote to the storage"
    if space.device == "gpu":  # the capacity catalogue knows the model: every point is checked offline
        assert "not checked" not in out
    from servetune.trial.context import resolve_levels

    top = max(resolve_levels(space, space.resolved_workload(path.parent)), key=lambda lv: lv.value)
    assert f"estimate at {top.kind} {top.value:g}" in out  # every point of the grid estimated at the top level
    assert out.count("tok/s") >= would_run - out.count("none:")
    assert "estimate: requests of" in out


@pytest.mark.parametrize("name", GPU_SCENARIOS)
def test_gpu_scenario_runs_on_an_h100_node(name, argspecs):
    space = load_space(ROOT / "search_spaces" / f"{name}.yaml", argspecs)
    assert space.device == "gpu"
    assert (space.hardware.devices_per_node, space.hardware.gpu, space.hardware.cpus_per_trial) == (8, "H100-SXM", 8)
    assert space.model in load_catalog()
    assert 1.0 <= space.price_per_device_hour <= 15.0  # USD per H100-hour, on-demand
    assert space.engine_args.get("dtype") == "bfloat16"
    assert space.engine_args.get("enable_chunked_prefill") is True
    assert space.engine_args.get("enable_prefix_caching") is True
    assert space.slo.error_rate == 0.001
    assert "tensor_parallel_size * data_parallel_size <= devices_per_node" in space.constraints
    assert "enable_chunked_prefill or max_num_batched_tokens >= max_model_len" in space.constraints
    assert space.search.algorithm == ("nsga2" if len(space.search.objectives) > 1 else "tpe")
    assert space.search.num_trials and space.search.max_concurrent * min(space.devices(p) for p in space.grid()[0]) <= 8


# Checklist section 12 (and 5 for max_num_seqs of RAG): the ranges each scenario starts from.
CHECKLIST_RANGES = {
    "chat-latency": {"max_model_len": (8192, 16384), "gpu_memory_utilization": (0.88, 0.92),
                     "max_num_seqs": (16, 64), "max_num_batched_tokens": (2048, 8192)},
    "rag": {"max_model_len": (16384, 32768), "max_num_seqs": (16, 64), "max_num_batched_tokens": (4096, 16384)},
    "offline-batch": {"max_num_seqs": (128, 1024), "max_num_batched_tokens": (16384, 65536),
                      "gpu_memory_utilization": (0.92, 0.97)},
    "long-context": {"max_model_len": (32768, 131072), "max_num_seqs": (4, 32),
                     "max_num_batched_tokens": (4096, 32768), "tensor_parallel_size": (2, 8)},
}  # fmt: skip


@pytest.mark.parametrize("name", GPU_SCENARIOS)
def test_gpu_scenario_starts_from_the_checklist_ranges(name, argspecs):
    space = load_space(ROOT / "search_spaces" / f"{name}.yaml", argspecs)
    for param, (low, high) in CHECKLIST_RANGES[name].items():
        got = values(space, param)
        assert min(got) == low and max(got) == high, (param, got)


def test_scenario_specifics(argspecs):
    spaces = {name: load_space(ROOT / "search_spaces" / f"{name}.yaml", argspecs) for name in GPU_SCENARIOS}
    chat = spaces["chat-latency"]
    slo = ["ttft_ms_p95 <= 800", "ttft_ms_p99 <= 2000", "tpot_ms_p95 <= 40", "error_rate <= 0.001"]
    assert [str(b) for b in chat.slo_bounds.bounds] == slo
    assert [(o.metric, o.mode) for o in chat.search.objectives] == [
        ("cost_per_mtok_usd", "min"),
        ("ttft_ms_p99", "min"),
    ]
    assert min(values(chat, "tensor_parallel_size")) == 1  # the smallest TP that holds an 8B model
    assert spaces["rag"].workload == "rag" and spaces["offline-batch"].workload == "batch"
    assert spaces["long-context"].workload == "summary"
    assert "fp8" in values(spaces["long-context"], "kv_cache_dtype")
    assert [o.metric for o in spaces["offline-batch"].search.objectives] == ["cost_per_mtok_usd"]


# --- a user's mistakes ---------------------------------------------------------------------

BASE = """\
name: my-study
model: tiny
device: cpu
workload: cpu-tiny
load:
  levels: [1, 4]
  requests_per_level: 16
slo:
  ttft_ms: {p95: 500}
hardware:
  devices_per_node: 2
engine_args:
  max_model_len: 1024
  enable_chunked_prefill: true
params:
  max_num_seqs: [2, 8]
  max_num_batched_tokens: [256, 1024]
constraints:
  - max_num_batched_tokens >= max_num_seqs
search:
  algorithm: grid
"""

ON_A_GPU_NODE = [
    ("model: tiny", "model: meta-llama/Llama-3.1-8B-Instruct"),
    ("device: cpu", "device: gpu"),
    ("devices_per_node: 2", "devices_per_node: 4\n  gpu: H100-SXM"),
]
AS_TPE = [
    ("algorithm: grid", "algorithm: tpe\n  num_trials: 4"),
    ("params:\n", "params:\n  gpu_memory_utilization: {low: 0.85, high: 0.95}\n"),
]

# (id, edits of BASE, what the one line must name: the field, then the culprit)
MISTAKES = [
    ("typo-top-level-key", [("search:", "serach:")], ["serach", "unknown key"]),
    ("typo-nested-key", [("requests_per_level", "request_per_level")], ["load.request_per_level", "unknown key"]),
    ("requests-per-level-not-a-count", [("requests_per_level: 16", "requests_per_level: many")], ["load.requests_per_level", "'many'"]),
    ("param-vllm-does-not-know", [("params:\n", "params:\n  enable_prefix_cache: [true, false]\n")],
     ["params", "'enable_prefix_cache'", "did you mean enable_prefix_caching"]),
    ("engine-arg-vllm-does-not-know", [("enable_chunked_prefill: true", "enable_chunked_prefil: true")],
     ["engine_args", "'enable_chunked_prefil'", "did you mean enable_chunked_prefill"]),
    ("value-vllm-does-not-accept", [("params:\n", "params:\n  kv_cache_dtype: [auto, fp9]\n")], ["params", "kv_cache_dtype", "fp9"]),
    ("empty-list", [("max_num_seqs: [2, 8]", "max_num_seqs: []")], ["params", "max_num_seqs", "empty"]),
    ("empty-range", [("max_num_seqs: [2, 8]", "max_num_seqs: {low: 64, high: 8}")], ["max_num_seqs", "empty range"]),
    ("constraint-excludes-everything", [("constraints:\n", "constraints:\n  - max_num_seqs > 100\n")],
     ["constraints", "exclude every point"]),
    ("constraint-syntax", [("constraints:\n", "constraints:\n  - max_num_seqs <=\n")], ["constraints", "max_num_seqs <="]),
    ("constraint-unknown-variable", [(">= max_num_seqs", ">= max_num_seq")], ["constraint", "'max_num_seq'"]),
    ("constraint-unknown-variable-tpe", [(">= max_num_seqs", ">= max_num_seq"), *AS_TPE], ["constraint", "'max_num_seq'"]),
    ("constraint-unknown-variable-unevaluated", [("- max_num_batched_tokens >= max_num_seqs", "- enable_chunked_prefill or max_num_batched_token >= max_model_len")],
     ["constraint", "'max_num_batched_token'"]),
    ("slo-unknown-metric", [("ttft_ms: {p95: 500}", "queue_ms: {p95: 500}")], ["slo.queue_ms", "unknown key"]),
    ("slo-unknown-statistic", [("ttft_ms: {p95: 500}", "ttft_ms: {p999: 500}")], ["slo.ttft_ms", "p999"]),
    ("objective-unknown-metric", [("algorithm: grid", "algorithm: grid\n  objectives: [{metric: ttft_p99, mode: min}]")],
     ["search.objectives", "ttft_p99"]),
    ("more-gpus-than-a-node", [*ON_A_GPU_NODE, ("params:\n", "params:\n  tensor_parallel_size: [8]\n")],
     ["hardware.devices_per_node", "needs 8 devices"]),
    ("more-gpus-than-a-node-fixed", [*ON_A_GPU_NODE, ("max_model_len: 1024", "max_model_len: 1024\n  tensor_parallel_size: 8")],
     ["hardware.devices_per_node", "needs 8 devices"]),
    ("more-gpus-than-a-node-tpe", [*ON_A_GPU_NODE, *AS_TPE, ("params:\n", "params:\n  tensor_parallel_size: [8, 16]\n")],
     ["hardware.devices_per_node", "needs 8 devices"]),
]  # fmt: skip


def write_space(tmp_path: Path, edits: list[tuple[str, str]]) -> Path:
    text = BASE
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new, 1)
    path = tmp_path / "my-study.yaml"
    path.write_text(text)
    return path


def test_base_of_the_mistakes_is_a_valid_space(tmp_path, argspecs, capsys, no_ray):
    assert main(["run", str(write_space(tmp_path, [])), "--dry-run", "--storage", str(tmp_path / "r")]) == 0
    assert "5 trial(s) would run" in " ".join(capsys.readouterr().out.split())  # the baseline and 2 x 2


@pytest.mark.parametrize("dry_run", [False, True], ids=["run", "dry-run"])
@pytest.mark.parametrize("edits, needles", [pytest.param(e, n, id=i) for i, e, n in MISTAKES])
def test_mistake_is_one_line_naming_file_and_field(edits, needles, dry_run, tmp_path, argspecs, capsys, no_ray):
    path = write_space(tmp_path, edits)
    storage = tmp_path / "results"
    rc = main(["run", str(path), "--storage", str(storage), *(["--dry-run"] if dry_run else [])])
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert len(lines) == 1 and "Traceback" not in err, err
    line = lines[0]
    assert line.startswith(f"servetune run: error: {path}: "), line
    for needle in needles:
        assert needle in line, f"{needle!r} not in: {line}"
    assert not storage.exists(), "the study directory was created before the space was checked"


UNPLANNED_SPACE = """
name: unplanned
model: meta-llama/Llama-3.1-8B-Instruct
device: gpu
workload: chat
load: {levels: [2]}
slo: {ttft_ms: {p99: 2000}}
hardware: {devices_per_node: 8, gpu: H100-SXM}
params:
  kv_cache_dtype: [auto, int4_per_token_head]
  quantization: [null, gguf, inc]
  max_model_len: [8192]
"""


def test_what_the_planner_cannot_size_would_run_not_planned(tmp_path, capsys, argspecs, no_ray):
    space = tmp_path / "unplanned.yaml"
    space.write_text(UNPLANNED_SPACE)
    assert main(["run", str(space), "--dry-run", "--storage", str(tmp_path / "results")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    found = SUMMARY.search(out)
    # 3 x 2 points and the baseline (vLLM's defaults), none refused
    assert found and tuple(map(int, found.groups())) == (7, 0, 0), out[-3000:]
    assert out.count("not planned:") == 4  # gguf (no .gguf file) or inc: the ledger sizes the rest
    assert "infeasible" not in out


def test_a_model_whose_config_cannot_be_read_would_run_not_planned_saying_why(tmp_path, capsys, argspecs, no_ray, monkeypatch):  # fmt: skip
    """Offline with nothing cached: the ledger has no architecture, so each trial starts unplanned with the reason
    (issue 39: "not checked (architecture unknown offline)" said neither what nor what to do), never refused."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))  # servetune's model store: empty
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))  # the Hugging Face cache: empty
    space = tmp_path / "offline.yaml"
    space.write_text(UNPLANNED_SPACE.replace("meta-llama/Llama-3.1-8B-Instruct", "acme/never-cached-7b"))
    assert main(["run", str(space), "--dry-run", "--storage", str(tmp_path / "results")]) == 0
    out = " ".join(capsys.readouterr().out.split())
    found = SUMMARY.search(out)
    assert found and tuple(map(int, found.groups())) == (7, 0, 0), out[-3000:]
    assert out.count("not planned: model acme/never-cached-7b: offline (HF_HUB_OFFLINE)") == 7, out[-3000:]
    assert "servetune models add acme/never-cached-7b" in out and "architecture unknown" not in out
