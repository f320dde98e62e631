"""The start-up timeout sized from the checkpoint (capacity/startup.py), where a space asks for it, and what a
timed-out start says (engine/server.py, engine/startup.py)."""

from __future__ import annotations

import pytest

from servetune.capacity import load_catalog
from servetune.capacity.checkpoint import Checkpoint
from servetune.capacity.params import count_parameters
from servetune.capacity.startup import FLOOR_S, MARGIN, UNSIZED_S, checkpoint_bytes, startup_budget
from servetune.config.space import SearchSpace
from servetune.engine.server import VllmServer
from servetune.engine.startup import waiting_on
from servetune.trial.context import StudyContext, resolve_levels, startup_budget_for

LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
LLAMA_70B = "meta-llama/Llama-3.1-70B-Instruct"


def arch(name: str = LLAMA_8B):
    return load_catalog()[name]


def test_checkpoint_bytes_come_from_the_safetensors_counts_at_their_stored_dtypes():
    with_counts = arch().model_copy(update={"checkpoint": Checkpoint(parameters={"BF16": 1000, "F32": 10, "I8": 7})})
    assert checkpoint_bytes(with_counts) == 2 * 1000 + 4 * 10 + 7
    # without headers: about the parameter count at the checkpoint's own dtype (bfloat16 here) ...
    assert checkpoint_bytes(arch()) == pytest.approx(2 * count_parameters(arch()), rel=0.01)
    # ... in its own quantization: an FP8 checkpoint of the same model is about half
    fp8 = checkpoint_bytes(arch("RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8"))
    assert 0.45 < fp8 / checkpoint_bytes(arch()) < 0.65


def test_the_budget_is_the_sum_of_its_parts_times_the_margin_and_grows_with_the_checkpoint():
    small, large = startup_budget(arch(LLAMA_8B)), startup_budget(arch(LLAMA_70B))
    for budget in (small, large):
        parts = budget.load_s + budget.compile_s + budget.cuda_graphs_s + budget.distributed_s + budget.process_s
        assert budget.expected_s == pytest.approx(parts)
        assert budget.load_s == pytest.approx(budget.checkpoint_bytes / (budget.load_gbps * 1e9))
        assert budget.timeout_s == pytest.approx(max(FLOOR_S, MARGIN * parts), abs=0.5)
    assert large.checkpoint_bytes > 8 * small.checkpoint_bytes and large.timeout_s > small.timeout_s
    assert large.compile_s > small.compile_s  # 80 layers against 32


def test_the_assumed_bandwidth_is_overridable_and_sets_the_load_time():
    slow, fast = startup_budget(arch(LLAMA_70B), load_gbps=0.25), startup_budget(arch(LLAMA_70B), load_gbps=1.0)
    assert slow.load_s == pytest.approx(4 * fast.load_s)
    assert slow.timeout_s > fast.timeout_s
    assert "at 0.25 GB/s" in slow.describe()


def test_parallelism_shapes_the_budget():
    one = startup_budget(arch(LLAMA_70B))
    tp4 = startup_budget(arch(LLAMA_70B), tp=4)
    pp4 = startup_budget(arch(LLAMA_70B), pp=4)
    dp2 = startup_budget(arch(LLAMA_70B), dp=2)
    assert tp4.load_s == one.load_s and tp4.distributed_s > one.distributed_s == 0  # shards read side by side
    assert pp4.compile_s < one.compile_s  # a stage compiles its own layers
    assert dp2.load_s == pytest.approx(2 * one.load_s)  # each replica reads the whole checkpoint
    eager = startup_budget(arch(LLAMA_70B), enforce_eager=True)
    assert eager.compile_s == eager.cuda_graphs_s == 0
    assert startup_budget(arch(LLAMA_70B), device="cpu").cuda_graphs_s == 0


def test_a_small_model_gets_the_floor():
    tiny = startup_budget(arch("Qwen/Qwen3-0.6B"), enforce_eager=True)
    assert MARGIN * tiny.expected_s < FLOOR_S and tiny.timeout_s == FLOOR_S
    assert f"at least {FLOOR_S:g} s" in tiny.describe()


SPACE = {
    "name": "s", "model": LLAMA_70B, "device": "gpu", "workload": "chat", "hardware": {"devices_per_node": 8},
    "engine_args": {"tensor_parallel_size": 2}, "params": {"pipeline_parallel_size": [1, 2]},
}  # fmt: skip


def test_a_space_sizes_its_timeout_unless_it_gives_one():
    auto = SearchSpace.model_validate(SPACE)
    assert auto.load.startup_timeout_s == "auto"
    sized = startup_budget_for(auto, {}, LLAMA_70B)
    assert sized.timeout_s == startup_budget(arch(LLAMA_70B), tp=2).timeout_s
    slower = SearchSpace.model_validate({**SPACE, "load": {"weights_load_gbps": 0.1}})
    assert startup_budget_for(slower, {}, LLAMA_70B).timeout_s > sized.timeout_s
    fixed = SearchSpace.model_validate({**SPACE, "load": {"startup_timeout_s": 77}})
    budget = startup_budget_for(fixed, {}, LLAMA_70B)
    assert budget.timeout_s == 77 and "load.startup_timeout_s" in budget.describe()


def test_each_trial_gets_the_budget_of_its_own_parallelism(tmp_path):
    space = SearchSpace.model_validate(SPACE)
    workload = space.resolved_workload(tmp_path)
    context = StudyContext(space, workload, tmp_path, LLAMA_70B, resolve_levels(space, workload))
    one, two = (context.spec_for({"pipeline_parallel_size": pp}) for pp in (1, 2))
    assert one.startup_timeout_s == startup_budget(arch(LLAMA_70B), tp=2).timeout_s
    assert two.startup_timeout_s == startup_budget(arch(LLAMA_70B), tp=2, pp=2).timeout_s
    assert two.startup_expected == startup_budget(arch(LLAMA_70B), tp=2, pp=2).describe()


def test_a_model_that_cannot_be_sized_keeps_the_fixed_timeout_and_says_why(tmp_path):
    space = SearchSpace.model_validate({**SPACE, "model": str(tmp_path)})
    budget = startup_budget_for(space, {}, str(tmp_path))  # a directory without config.json
    assert budget.timeout_s == UNSIZED_S and "not sized from the checkpoint" in budget.describe()


# vLLM 0.32's own lines (their format strings: vllm/v1/worker/gpu_model_runner.py "Starting to load model %s...",
# vllm/compilation/backends.py "%sUsing cache directory: %s for vLLM's torch.compile", vllm/compilation/monitor.py
# "%storch.compile took %.2f s in total", vllm/model_executor/model_loader/default_loader.py "Loading weights took
# %.2f seconds", vllm/v1/engine/core.py "init engine (profile, create kv cache, warmup model) took %.2f s").
HEAD = "INFO 12-05 07:00:01 [utils.py:253] non-default args: {'model': 'meta-llama/Llama-3.1-70B-Instruct'}"
LOADING = "(EngineCore pid=812) INFO 12-05 07:00:09 [gpu_model_runner.py:5040] Starting to load model meta-llama/Llama-3.1-70B-Instruct..."
LOADED = "(EngineCore pid=812) INFO 12-05 07:03:40 [default_loader.py:502] Loading weights took 210.44 seconds"
COMPILING = "(EngineCore pid=812) INFO 12-05 07:03:52 [backends.py:1105] Using cache directory: /root/.cache/vllm/torch_compile_cache/3f2a/rank_0_0/backbone for vLLM's torch.compile"
COMPILED = "(EngineCore pid=812) INFO 12-05 07:04:40 [monitor.py:20] torch.compile took 47.95 s in total"
READY = "(EngineCore pid=812) INFO 12-05 07:05:30 [core.py:403] init engine (profile, create kv cache, warmup model) took 80.12 s"


@pytest.mark.parametrize(
    ("lines", "phase"),
    [
        ([], "it logged nothing"),
        ([HEAD], "vLLM's imports and engine start"),
        ([HEAD, LOADING], "the weights to download or load"),
        ([HEAD, LOADING, LOADED], "the memory profile"),
        ([HEAD, LOADING, LOADED, COMPILING], "torch.compile"),
        ([HEAD, LOADING, LOADED, COMPILING, COMPILED], "the memory profile"),
        ([HEAD, LOADING, LOADED, COMPILING, COMPILED, READY], "the API server"),
    ],
)
def test_a_start_says_which_phase_it_was_still_in(lines, phase):
    said = waiting_on("\n".join(lines))
    assert phase in said
    if lines:
        assert said.endswith(lines[-1][-200:])


def test_a_timed_out_start_says_what_was_expected_and_what_it_waited_for(tmp_path):
    budget = startup_budget(arch(LLAMA_70B), tp=2)
    server = VllmServer(LLAMA_70B, log_path=tmp_path / "engine.log", startup_timeout_s=budget.timeout_s,
                        startup_expected=budget.describe())  # fmt: skip
    server.log_path.write_text("\n".join([HEAD, LOADING]) + "\n")
    reason = server.timeout_reason()
    assert reason.startswith(f"vLLM did not become healthy within {budget.timeout_s:g} s (expected ")
    assert f"loading {budget.checkpoint_bytes / 1e9:.1f} GB" in reason
    assert "it was waiting for the weights to download or load" in reason
