"""The GPU type as a search dimension (``params: {gpu: [...]}``): each trial's type places, sizes, prices and
names it (config/space.py gpu_for, trial/context.py, trial/runner.py)."""

import pytest

from servetune.capacity.hardware import load_gpu_catalog
from servetune.capacity.prices import load_price_table
from servetune.config.space import SearchSpace
from servetune.errors import UserError
from servetune.study.driver import proposals
from servetune.study.nodes import placement_problem_of
from servetune.study.searcher import ConstrainedOptunaSearch
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import capacity_check, price_trial

GPUS = ["H100-SXM", "H200", "L40S"]
HEAD = {"CPU": 0.0, "node:__internal_head__": 1.0}
H100 = {"CPU": 8.0, "GPU": 8.0, "accelerator_type:H100": 1.0}
H200 = {"CPU": 8.0, "GPU": 8.0, "accelerator_type:H200": 1.0}


def space(params=None, **more) -> SearchSpace:
    return SearchSpace.model_validate({
        "name": "s", "model": "meta-llama/Llama-3.1-70B-Instruct", "workload": "chat", "device": "gpu",
        "hardware": {"devices_per_node": 8}, "engine_args": {"max_model_len": 8192},
        "params": {"gpu": GPUS, "tensor_parallel_size": [2], **(params or {})}, **more,
    })  # fmt: skip


def context(s: SearchSpace, tmp_path, nodes=()) -> StudyContext:
    workload = s.resolved_workload(tmp_path)
    return StudyContext(s, workload, tmp_path, s.model, resolve_levels(s, workload), nodes=tuple(nodes))


def test_each_grid_point_and_baseline_runs_on_its_own_gpu_type():
    s = space()
    kept, rejected = s.grid()
    assert sorted(p["gpu"] for p in kept) == sorted(GPUS) and not rejected
    assert s.baselines() == [{"gpu": g} for g in GPUS]  # vLLM's defaults measured on every type
    assert [p.get("gpu") for p in proposals(s, None)] == GPUS + GPUS
    assert s.engine_params(kept[0])[0] == {"max_model_len": 8192, "tensor_parallel_size": 2}  # not an engine argument
    # a single hardware.gpu keeps working: one type, no dimension
    one = SearchSpace.model_validate({**s.model_dump(exclude={"params"}), "hardware": {"gpu": "H200"}})
    assert one.gpu_for({}) == "H200" and one.gpu_types() == ["H200"] and one.baselines() == [{}]


def test_the_searcher_proposes_a_baseline_per_gpu_type_then_samples_types():
    searcher = ConstrainedOptunaSearch(space(search={"algorithm": "tpe"}), baseline=True)
    firsts = [searcher.suggest(f"t{i}")["params"] for i in range(len(GPUS))]
    assert firsts == [{"gpu": g} for g in GPUS]
    assert searcher.suggest("t9")["params"]["gpu"] in GPUS


def test_each_trials_spec_has_its_own_type_id_bundle_capacity_and_price(tmp_path):
    s = space()
    ctx = context(s, tmp_path, [HEAD, H100, H200])
    specs = {g: ctx.spec_for({"gpu": g, "tensor_parallel_size": 2}) for g in GPUS}
    assert {g: spec.gpu for g, spec in specs.items()} == {g: g for g in GPUS}
    assert len({spec.trial_id for spec in specs.values()}) == 3  # one engine, three types: three trials
    assert specs["H200"].gpu_type == "H200" and specs["H100-SXM"].gpu_type == "H100"
    # the type no node has is refused at once, naming the types the cluster has
    assert placement_problem_of(ctx, {"gpu": "L40S"}) == "needs GPUs of type L40S; the cluster's nodes have H100, H200"
    assert placement_problem_of(ctx, {"gpu": "H200"}) is None
    # 70B in bf16 over 2 GPUs: 70 GB a GPU, beyond an L40S's 48 GB; an H200 keeps more KV cache than an H100
    capacity = {g: capacity_check(spec) for g, spec in specs.items()}
    assert not capacity["L40S"].fits and capacity["H100-SXM"].fits and capacity["H200"].fits
    assert capacity["H200"].kv_cache_tokens > capacity["H100-SXM"].kv_cache_tokens
    memory = {g: load_gpu_catalog()[g].memory_gib for g in ("H100-SXM", "H200")}
    assert memory["H200"] > memory["H100-SXM"]
    from tests.builders import level, trial

    for g in ("H100-SXM", "H200"):  # no NVML name (the CPU stand-in): priced by the trial's own type
        result = trial("t", {"gpu": g}, [level(8, 900.0, 400)], devices=2, price=1.0)
        price_trial(result, specs[g])
        assert result.price.gpu == g and result.price_per_device_hour == load_price_table()[g].usd_per_device_hour


def test_each_trials_estimates_are_priced_at_its_own_types_price_before_it_runs(tmp_path):
    """What pruning, seeding and the dry run cost a trial at before it runs (``TrialSpec.price_per_device_hour``) is
    its type's listed price, as its measured cost will be, not the space's fallback of 1 USD."""
    specs = {g: context(space(), tmp_path).spec_for({"gpu": g, "tensor_parallel_size": 2}) for g in GPUS}
    assert {g: s.price_per_device_hour for g, s in specs.items()} == {
        g: load_price_table()[g].usd_per_device_hour for g in GPUS
    }
    fixed = context(space(price_per_device_hour=2.5), tmp_path).spec_for({"gpu": "L40S", "tensor_parallel_size": 2})
    assert fixed.price_per_device_hour == 2.5  # the space's own price still overrides the list


def test_a_single_type_space_keeps_its_trial_ids(tmp_path):
    single = SearchSpace.model_validate({**space().model_dump(exclude={"params"}), "hardware": {"gpu": "H200"},
                                         "params": {"tensor_parallel_size": [2]}})  # fmt: skip
    spec = context(single, tmp_path).spec_for({"tensor_parallel_size": 2})
    plain = SearchSpace.model_validate({**single.model_dump(exclude={"hardware"}), "hardware": {"gpu": "H100-SXM"}})
    assert (
        spec.gpu == "H200" and spec.trial_id == context(plain, tmp_path).spec_for({"tensor_parallel_size": 2}).trial_id
    )


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("  gpu: [H100-SXM, B999]\n", "params: gpu: unknown GPU B999; known: "),
        ("  gpu: {low: 1, high: 2}\n", "params: gpu: list the GPU types to compare"),
        ("  gpu: [H200, H200]\n", "params: gpu: a GPU type is listed twice"),
    ],
)
def test_a_bad_gpu_list_is_one_line_naming_file_and_field(tmp_path, text, field):
    from servetune.space_file import load_space

    path = tmp_path / "space.yaml"
    path.write_text("name: t\nmodel: meta-llama/Llama-3.1-8B-Instruct\ndevice: gpu\nworkload: chat\nparams:\n" + text)
    with pytest.raises(UserError) as info:
        load_space(path)
    message = str(info.value)
    assert message.startswith(str(path)) and field in message and "\n" not in message


def test_hardware_gpu_may_list_the_types_to_compare_as_params_gpu_does(tmp_path):
    """``hardware.gpu: [H100-SXM, H200, L40S]`` is ``params: {gpu: [...]}``: the same types, trials and ids."""
    from servetune.space_file import load_space

    head = "name: t\nmodel: meta-llama/Llama-3.1-70B-Instruct\ndevice: gpu\nworkload: chat\n"
    listed, param = tmp_path / "listed.yaml", tmp_path / "param.yaml"
    listed.write_text(
        head + "hardware: {devices_per_node: 8, gpu: [H100-SXM, H200, L40S]}\nparams: {tensor_parallel_size: [2, 4]}\n"
    )
    param.write_text(
        head + "hardware: {devices_per_node: 8}\nparams: {gpu: [H100-SXM, H200, L40S], tensor_parallel_size: [2, 4]}\n"
    )
    a, b = load_space(listed), load_space(param)
    assert a.gpu_types() == b.gpu_types() == GPUS and a.hardware.gpu is None
    ids = [{context(s, tmp_path).spec_for(p).trial_id for p in s.grid()[0]} for s in (a, b)]
    assert ids[0] == ids[1] and len(ids[0]) == 6
    both = tmp_path / "both.yaml"
    both.write_text(head + "hardware: {gpu: [H100-SXM, H200]}\nparams: {gpu: [L40S]}\n")
    with pytest.raises(UserError) as info:
        load_space(both)
    message = str(info.value)
    assert message.startswith(str(both)) and "hardware.gpu" in message and "\n" not in message


def test_gpu_types_are_compared_on_gpus_only_and_with_the_catalogues_memory():
    with pytest.raises(ValueError, match=r"params\.gpu: GPU types are compared with device: gpu"):
        space(device="cpu")
    with pytest.raises(ValueError, match=r"hardware\.gpu_memory_gib: sizes one GPU"):
        space(hardware={"gpu_memory_gib": 40})


def test_the_quality_reference_runs_on_the_first_gpu_type_unless_it_names_one():
    quality = {"suites": ["agreement"]}
    assert space(quality=quality).quality_reference == {"gpu": "H100-SXM"}
    named = space(quality={**quality, "reference": {"gpu": "L40S", "tensor_parallel_size": 2}})
    assert named.quality_reference == {"gpu": "L40S", "tensor_parallel_size": 2}
