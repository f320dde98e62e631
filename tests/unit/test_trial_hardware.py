"""A GPU trial's capacity check sized from the GPU it got, where the space names none (trial/runner.py)."""

from servetune.config.space import SearchSpace
from servetune.trial.context import StudyContext, resolve_levels
from servetune.trial.runner import capacity_check

H100 = {"gpu_model": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": "79.6"}
L4 = {"gpu_model": "NVIDIA L4", "gpu_memory_gib": "22.5"}


def spec_for(tmp_path, gpu=None):
    hardware = {"devices_per_node": 8, **({"gpu": gpu} if gpu else {})}
    space = SearchSpace.model_validate({"name": "s", "model": "meta-llama/Llama-3.1-8B-Instruct", "device": "gpu",
                                        "workload": "chat", "hardware": hardware,
                                        "engine_args": {"max_model_len": 8192}})  # fmt: skip
    workload = space.resolved_workload(tmp_path)
    return StudyContext(space, workload, tmp_path, space.model, resolve_levels(space, workload)).spec_for({})


def test_without_hardware_gpu_the_check_sizes_the_gpu_the_trial_got(tmp_path):
    spec = spec_for(tmp_path)
    assert capacity_check(spec) is None  # nothing seen, nothing named: no check (as before)
    on_h100, on_l4 = capacity_check(spec, dict(H100)), capacity_check(spec, dict(L4))
    assert on_h100 is not None and on_l4 is not None and on_h100.fits
    assert on_h100.kv_cache_tokens > 4 * on_l4.kv_cache_tokens  # 80 GB against 24, less the same 16 GB of weights


def test_a_gpu_other_than_the_space_names_is_noted_and_the_named_one_is_sized(tmp_path):
    spec = spec_for(tmp_path, gpu="H100-SXM")
    seen = dict(L4)
    checked = capacity_check(spec, seen)
    assert checked is not None and checked.kv_cache_tokens == capacity_check(spec).kv_cache_tokens
    assert seen["hardware_note"].startswith("the space says H100-SXM; the trial got NVIDIA L4")
    same = dict(H100)
    capacity_check(spec, same)
    assert "hardware_note" not in same


def test_a_mig_slice_is_sized_by_its_own_memory_even_where_the_space_names_the_board(tmp_path):
    """telemetry.resolve_devices gave the trial a 3g.40gb slice of an H100 (environment._gpus records the board's
    model, the profile and the slice's memory): the check sizes 40 GB, not the space's 80, and says so."""
    mig = {"gpu_model": "NVIDIA H100 80GB HBM3", "gpu_memory_gib": "39.5", "gpu_mig": "3g.40gb"}
    for gpu in (None, "H100-SXM"):
        spec, seen = spec_for(tmp_path, gpu=gpu), dict(mig)
        on_slice, on_board = capacity_check(spec, seen), capacity_check(spec, dict(H100))
        assert on_slice is not None and on_board is not None and on_slice.fits
        assert on_slice.kv_cache_tokens < on_board.kv_cache_tokens / 2  # 40 GB against 80, less 16 GB of weights
    assert "HBM3 MIG 3g.40gb: " in seen["hardware_note"] and seen["hardware_note"].endswith("H100-SXM (39.5 GiB)")


def test_a_trial_through_serve_samples_no_gpu_of_the_load_clients_node(tmp_path):
    import dataclasses

    from servetune.trial.runner import trial_gpus

    bare = dataclasses.replace(spec_for(tmp_path), extra_env={"CUDA_VISIBLE_DEVICES": "2,3"})
    assert trial_gpus(bare) == [2, 3]  # the bundle's GPUs
    uuids = dataclasses.replace(bare, extra_env={"CUDA_VISIBLE_DEVICES": "GPU-8f3a,MIG-1b2c"})
    assert trial_gpus(uuids) == ["GPU-8f3a", "MIG-1b2c"]  # as given, for telemetry.resolve_devices
    # Through Serve the bundle is a CPU for the load client, and the replicas' GPUs are elsewhere: none.
    assert trial_gpus(dataclasses.replace(bare, serve_replicas=2, extra_env={})) == []
