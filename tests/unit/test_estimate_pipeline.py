"""Pipeline parallelism in the estimate (estimate/pipeline.py): each stage holds the planner's share of the layers,
reads only their weights and KV, passes its activations on, and the engine keeps one micro-batch a stage in flight;
and an MoE target's MTP drafter reads its experts as the target's are laid out over TP x DP."""

from __future__ import annotations

import pytest

from servetune.capacity import load_model_arch, plan_capacity, resolve_hardware
from servetune.capacity.params import ParamSplit, formula_bytes, mtp_params
from servetune.estimate import Load, decode_s, estimate, prefill_s, replica_from_plan
from servetune.estimate.expert_parallel import read_layout
from servetune.estimate.factors import Efficiency
from servetune.estimate.pipeline import boundary_bytes, stage_layers
from servetune.estimate.queueing import closed_loop
from servetune.estimate.roofline import draft_s

LLAMA = "meta-llama/Llama-3.1-8B-Instruct"
MIXTRAL = "mistralai/Mixtral-8x7B-Instruct-v0.1"
DEEPSEEK = "deepseek-ai/DeepSeek-V3"
H100 = resolve_hardware("gpu", "H100-SXM")
H200 = resolve_hardware("gpu", "H200")
# fixed factors, so that a refit of the shipped ones moves none of the pinned numbers
EFF = Efficiency(decode_bandwidth=0.7, prefill_flops=0.5, step_overhead_ms=2.0, sequence_overhead_ms=0.05,
                 allreduce_us=10.0)  # fmt: skip
MTP = {"method": "mtp", "num_speculative_tokens": 1}


def _replica(model: str, hardware=H100, **args):
    arch = load_model_arch(model)
    args = {"max_model_len": 8192, **args}
    plan = plan_capacity(arch, args, hardware)
    assert plan.fits, plan.reason
    return replica_from_plan(arch, plan, args)


@pytest.mark.parametrize(
    ("model", "args", "pinned"),
    [  # computed on main before pipeline parallelism was modelled
        (LLAMA, {}, (0.017428993146268657, 0.06638542480333266, 0.05239959142144279, 0.016478236439748273)),
        (MIXTRAL, {"tensor_parallel_size": 2, "data_parallel_size": 2},
         (0.019616570081250888, 0.061960915492411194, 0.05531286099931254, 0.0199221025108009)),
    ],
)  # fmt: skip
def test_at_pp_1_the_step_times_are_what_they_were(model, args, pinned):
    rep = _replica(model, **args)
    point = closed_loop(rep, EFF, 32, 1024, 256)
    got = (decode_s(rep, EFF, 64, 1500), prefill_s(rep, EFF, 2048, 2048), point.ttft_s, point.tpot_s)
    assert got == pytest.approx(pinned, rel=1e-12)


def test_a_stage_reads_half_the_weights_and_kv_of_a_dense_model_at_pp_2():
    one, two = _replica(LLAMA), _replica(LLAMA, pipeline_parallel_size=2)
    assert (one.layers, two.layers) == (32, 16) == (stage_layers(one.arch, 1), stage_layers(two.arch, 2))
    ends = 2 * 128_256 * 4096 * 2  # embedding and lm_head: the heavier end stays on a stage
    assert two.weight_bytes == pytest.approx((one.weight_bytes - ends) / 2 + ends / 2, rel=0.01)
    assert two.kv.per_sequence(1000) == one.kv.per_sequence(1000) / 2
    assert two.active_params == pytest.approx(one.active_params / 2, rel=1e-9)


def test_at_pp_2_a_tokens_interval_is_pp_1s_plus_the_transfer_and_throughput_grows():
    one, two = _replica(LLAMA), _replica(LLAMA, pipeline_parallel_size=2)
    transfer = two.boundary_s(1, EFF.allreduce_us)
    assert transfer == pytest.approx(boundary_bytes(two.arch, 1) / two.rates.link_bytes_s + 10e-6)
    alone, staged = decode_s(one, EFF, 1, 1500), decode_s(two, EFF, 1, 1500)
    assert alone + transfer < staged < alone * 1.01  # every layer's weights read once, one boundary crossed
    # two micro-batches of one: the second rides in the first's bubble, so a token's interval does not grow
    assert decode_s(two, EFF, 2, 1500) == staged
    # a stage reads its weights for half the batch while the other works
    gains = [decode_s(one, EFF, b, 1500) / decode_s(two, EFF, b, 1500) for b in (16, 64, 256)]
    assert 1.05 < gains[0] < gains[1] < gains[2], gains
    load = Load(input_tokens=1024, output_tokens=256, concurrency=64)
    arch = load_model_arch(LLAMA)
    e1 = estimate(arch, {"max_model_len": 8192}, H100, load)
    e2 = estimate(arch, {"max_model_len": 8192, "pipeline_parallel_size": 2}, H100, load)
    assert e2.output_throughput > 1.3 * e1.output_throughput and e2.tpot_ms < e1.tpot_ms


def test_a_short_prompt_crosses_every_stage_before_its_first_token():
    one, two = _replica(LLAMA), _replica(LLAMA, pipeline_parallel_size=2)
    # one prompt in one chunk: its FLOPs on both stages, one after the other, as at PP 1
    t1 = closed_loop(one, EFF, 1, 1024, 256).ttft_s
    t2 = closed_loop(two, EFF, 1, 1024, 256).ttft_s
    assert t1 < t2 < t1 * 1.02


def test_an_moe_stage_holds_half_the_experts_and_exchanges_over_its_own_layers():
    args = {"tensor_parallel_size": 2, "data_parallel_size": 2}
    one, two = _replica(MIXTRAL, **args), _replica(MIXTRAL, **args, pipeline_parallel_size=2)
    assert two.expert_bytes == one.expert_bytes / 2
    assert one.exchange is not None and two.exchange is not None
    assert (one.exchange.moe_layers, two.exchange.moe_layers) == (32, 16)
    assert two.allreduce_s(8, 10.0) == one.allreduce_s(8, 10.0) / 2
    assert two.link_s(8, 10.0) == pytest.approx(one.link_s(8, 10.0) / 2, rel=1e-12)
    alone, staged = decode_s(one, EFF, 1, 1500), decode_s(two, EFF, 1, 1500)
    assert alone < staged < alone * 1.02
    assert 64 / decode_s(two, EFF, 64, 1500) > 1.15 * 64 / decode_s(one, EFF, 64, 1500)


def _touched(arch, tokens: float) -> float:
    return 1 - (1 - arch.num_experts_per_tok / arch.num_experts) ** tokens


def test_an_moe_targets_mtp_drafter_reads_its_experts_as_the_target_lays_them_over_tp_x_dp():
    one = _replica(DEEPSEEK, H200, tensor_parallel_size=8, speculative_config=MTP)
    two = _replica(DEEPSEEK, H200, tensor_parallel_size=8, data_parallel_size=2, speculative_config=MTP)
    arch = one.arch
    assert one.speculation is not None and two.speculation is not None
    layout = read_layout(arch, plan_capacity(arch, {"max_model_len": 8192, "tensor_parallel_size": 8,
                                                    "data_parallel_size": 2, "speculative_config": MTP}, H200).settings)  # fmt: skip
    held = formula_bytes(arch, ParamSplit(0, 0, mtp_params(arch, 8, shards=layout).experts), arch.quant, 2)
    assert two.speculation.expert_bytes == held == pytest.approx(one.speculation.expert_bytes / 2, rel=1e-9)
    for rep, dp in ((one, 1), (two, 2)):
        spec = rep.speculation
        assert spec is not None
        for batch in (1, 16):  # a pass reads the experts the DP engines' tokens select, as the target's step does
            read = spec.pass_bytes - spec.expert_bytes * (1 - _touched(arch, dp * batch))
            read += batch * 2000 * spec.kv_bytes_per_token
            memory = read / (rep.rates.hbm_bytes_s * EFF.decode_bandwidth)
            assert draft_s(rep, EFF, batch, 2000) == pytest.approx(memory, rel=1e-9)
    # a DP rank holds half the experts but reads them for both engines' tokens: less than one engine's rank
    assert draft_s(two, EFF, 16, 2000) < draft_s(one, EFF, 16, 2000)


def test_vllm_keeps_one_batch_ahead_of_the_pipeline_and_staggers_each_sequence_by_its_stages(monkeypatch):
    """What estimate/pipeline.py's "How the steps overlap" reads in vLLM (imported, never started): on CUDA the V2
    model runner is the default where no feature it lacks is asked for, async scheduling is then on under PP, and the
    engine keeps ``p + 1`` batches in flight (V1, without async scheduling: ``p``); the async scheduler gives a decoding
    sequence its next step ``p`` steps after its last, so it rides in one of ``min(p, b)`` micro-batches either way."""
    from types import SimpleNamespace

    vllm_config = pytest.importorskip("vllm.config.vllm")
    async_scheduler = pytest.importorskip("vllm.v1.core.sched.async_scheduler")
    config = vllm_config.VllmConfig

    monkeypatch.setattr(vllm_config, "HAS_TRITON", True)  # CUDA's
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    default = SimpleNamespace(attention_config=SimpleNamespace(hisparse_config=None),
                              _get_v2_model_runner_unsupported_features=list)  # fmt: skip
    assert config.use_v2_model_runner.fget(default) is True

    def engine(pp: int, v2: bool, async_scheduling: bool) -> int:
        return config.max_concurrent_batches.fget(SimpleNamespace(
            parallel_config=SimpleNamespace(pipeline_parallel_size=pp), use_v2_model_runner=v2,
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling)))  # fmt: skip

    assert [engine(p, v2=True, async_scheduling=True) for p in (1, 2, 4)] == [2, 3, 5]
    assert [engine(p, v2=False, async_scheduling=False) for p in (1, 2, 4)] == [1, 2, 4]

    def base_init(self, *args, **kwargs):
        self.parallel_config, self.num_spec_tokens = SimpleNamespace(pipeline_parallel_size=4), 0

    monkeypatch.setattr(async_scheduler.Scheduler, "__init__", base_init)
    assert async_scheduler.AsyncScheduler().decode_stagger == 4
