import pytest

from servetune.config.space import Range, SearchSpace
from servetune.errors import UserError
from tests.builders import space_from

#: What this module's spaces have beneath builders.SPACE_HEAD.
BASE = """\
hardware: {devices_per_node: 2}
engine_args: {max_model_len: 1024}
"""


def space(tmp_path, text, argspecs=None):
    return space_from(tmp_path, BASE + text, argspecs)


def test_grid_with_constraints(tmp_path):
    s = space(
        tmp_path,
        """
params:
  max_num_batched_tokens: [512, 2048]
  enable_chunked_prefill: [true, false]
  tensor_parallel_size: [1, 2, 4]
constraints:
  - enable_chunked_prefill or max_num_batched_tokens >= max_model_len
""",
    )
    kept, rejected = s.grid()
    assert len(kept) + len(rejected) == 12
    assert {"max_num_batched_tokens": 512, "enable_chunked_prefill": False, "tensor_parallel_size": 1} not in kept
    assert all(p["tensor_parallel_size"] != 4 for p in kept)  # a node has 2 devices
    reasons = {r for _, broken in rejected for r in broken}
    assert "needs 4 devices, a node has 2" in reasons
    assert len(kept) == 2 * 3  # tp 1 or 2, times 3 of the 4 (tokens, chunked prefill) pairs


def test_env_parameters_and_devices(tmp_path):
    s = space(
        tmp_path,
        "env: {A: 1}\nparams:\n  env.VLLM_CPU_KVCACHE_SPACE: [1, 2]\n  data_parallel_size: [1, 2]\nconstraints: ['env.VLLM_CPU_KVCACHE_SPACE * data_parallel_size <= 2']\n",
    )
    engine, env = s.engine_params({"env.VLLM_CPU_KVCACHE_SPACE": 2, "data_parallel_size": 1})
    assert env == {"A": "1", "VLLM_CPU_KVCACHE_SPACE": "2"} and engine == {
        "max_model_len": 1024,
        "data_parallel_size": 1,
    }
    assert s.devices({"data_parallel_size": 2}) == 2
    kept, _ = s.grid()
    assert {"env.VLLM_CPU_KVCACHE_SPACE": 2, "data_parallel_size": 2} not in kept and len(kept) == 3


def test_ranges():
    assert Range(low=16, high=128, log=True).grid_values() == [16, 32, 64, 128]
    assert Range(low=0.85, high=0.95, step=0.05).grid_values() == [0.85, 0.9, 0.95]
    with pytest.raises(ValueError, match="needs a step"):
        Range(low=0.1, high=0.9).grid_values()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("serach: {algorithm: grid}\n", "serach: unknown key"),
        ("params: {max_num_seqs: []}\n", "params: max_num_seqs: empty list"),
        ("params: {max_num_seqs: {low: 64, high: 8}}\n", "empty range"),
        (
            "params: {max_num_seqs: [1, 2]}\nconstraints: ['max_num_seqs > 5']\n",
            "constraints: they exclude every point",
        ),
        (
            "params: {max_num_seqs: [1]}\nconstraints: ['max_num_seqs > nonsense']\n",
            "'nonsense' is neither a parameter",
        ),
        ("params: {max_num_seqs: [1]}\nconstraints: ['__import__(\"os\")']\n", "'Call' is not allowed"),
        ("slo: {ttft: {p99: 5}}\n", "slo.ttft: unknown key"),
        ("slo: {ttft_ms: {p42: 5}}\n", "slo.ttft_ms.p42"),
        ("search: {objectives: [{metric: speed, mode: max}]}\n", "unknown metric 'speed'"),
        ("engine_args: {tensor_parallel_size: 4}\n", "needs 4 devices"),
    ],
)
def test_bad_space_is_one_line_naming_file_and_field(tmp_path, text, needle):
    with pytest.raises(UserError) as info:
        space(tmp_path, text)
    message = str(info.value)
    assert message.startswith(str(tmp_path / "space.yaml")), message
    assert needle in message and "\n" not in message


def test_unknown_vllm_argument_with_parser(tmp_path):
    from servetune.engine.args import ArgSpec

    specs = {
        "max_num_seqs": ArgSpec("max_num_seqs", "--max-num-seqs", "value"),
        "max_model_len": ArgSpec("max_model_len", "--max-model-len", "value"),
    }
    with pytest.raises(
        UserError, match=r"space.yaml: params: unknown engine argument 'max_num_seq'.*did you mean max_num_seqs"
    ):
        space(tmp_path, "params: {max_num_seq: [1, 2]}\n", specs)


def test_objective_and_slo(tmp_path):
    s = space(
        tmp_path,
        "slo: {ttft_ms: {p95: 800, p99: 2000}, error_rate: 0.001}\nsearch: {algorithm: nsga2, objectives: [{metric: cost_per_mtok_usd, mode: min}, {metric: ttft_ms_p99, mode: min}]}\n",
    )
    assert [str(b) for b in s.slo_bounds.bounds] == ["ttft_ms_p95 <= 800", "ttft_ms_p99 <= 2000", "error_rate <= 0.001"]
    assert isinstance(s, SearchSpace) and len(s.search.objectives) == 2


def test_prefill_context_parallelism_counts_in_a_trials_devices(tmp_path):
    """vLLM's world size is pipeline x tensor x prefill-context parallel: a PCP=2 engine runs two ranks."""
    s = space(tmp_path, "params:\n  prefill_context_parallel_size: [1, 2]\n  tensor_parallel_size: [1, 2]\n")
    assert s.devices({"prefill_context_parallel_size": 2, "tensor_parallel_size": 1}) == 2
    kept, rejected = s.grid()  # a node has two devices: PCP 2 x TP 2 does not fit
    assert {"prefill_context_parallel_size": 2, "tensor_parallel_size": 2} not in kept and len(kept) == 3
    assert any("needs 4 devices" in r for _, broken in rejected for r in broken)


def test_decode_context_parallelism_adds_no_devices(tmp_path):
    """vLLM's DCP reuses the TP ranks (ParallelConfig: TP must be divisible by DCP): TP 2 x DCP 2 is two GPUs."""
    s = space(tmp_path, "params:\n  decode_context_parallel_size: [1, 2]\n  tensor_parallel_size: [2]\n")
    assert s.devices({"decode_context_parallel_size": 2, "tensor_parallel_size": 2}) == 2
    kept, _ = s.grid()
    assert {"decode_context_parallel_size": 2, "tensor_parallel_size": 2} in kept


@pytest.mark.parametrize(
    ("text", "field"),
    [
        (
            "engine_args: {max_model_len: 1024, distributed_executor_backend: ray}\n",
            "engine_args.distributed_executor_backend",
        ),
        ("params: {distributed_executor_backend: [mp, ray]}\n", "params.distributed_executor_backend"),
        ("params: {data_parallel_size: [2], data_parallel_backend: [ray]}\n", "params.data_parallel_backend"),
    ],
)
def test_a_ray_executor_for_a_bare_engine_trial_is_refused_in_one_line(tmp_path, text, field):
    with pytest.raises(UserError) as refused:
        space(tmp_path, text)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'space.yaml'}: {field}: 'ray' makes each trial's engine a Ray driver")
    assert "\n" not in message and "pipeline parallelism across nodes" in message


def test_the_mp_executor_and_data_parallel_backends_other_than_ray_are_accepted(tmp_path):
    s = space(tmp_path, "params: {distributed_executor_backend: [mp], data_parallel_backend: [mp]}\n")
    assert s.params["distributed_executor_backend"] == ["mp"]
