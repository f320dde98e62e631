"""Where a trial's engine keeps vLLM's compile cache (engine/compile_cache.py), and the fake engine's key."""

from __future__ import annotations

import os
import tempfile

from servetune.engine.compile_cache import compile_cache_env, filesystem_type, vllm_default_root
from servetune.testing.fake_openai import compile_key

LOCAL = [("/", "ext4"), ("/proc", "proc"), ("/tmp", "tmpfs")]


def home_on(fstype: str):
    return lambda: [*LOCAL, ("/home", fstype)]


def test_the_longest_mount_point_decides_the_filesystem():
    parts = [("/", "ext4"), ("/home", "nfs4"), ("/home/local", "xfs")]
    assert filesystem_type(vllm_default_root({"XDG_CACHE_HOME": "/home/ann/.cache"}), parts) == "nfs4"
    assert filesystem_type(vllm_default_root({"XDG_CACHE_HOME": "/home/local/.cache"}), parts) == "xfs"
    assert (
        filesystem_type(vllm_default_root({"XDG_CACHE_HOME": "/homework/.cache"}), parts) == "ext4"
    )  # not under /home


def test_a_node_local_default_is_left_to_vllm_with_a_triton_cache_beside_it():
    added = compile_cache_env({}, {"XDG_CACHE_HOME": "/home/ann/.cache"}, home_on("ext4"))
    assert added == {"TRITON_CACHE_DIR": "/home/ann/.cache/vllm/servetune-triton-cache"}


def test_a_home_on_a_network_filesystem_gets_a_node_local_cache():
    for fstype in ("nfs", "nfs4", "lustre", "fuse.sshfs"):
        added = compile_cache_env({}, {"XDG_CACHE_HOME": "/home/ann/.cache"}, home_on(fstype))
        root = added["VLLM_CACHE_ROOT"]
        assert root.endswith(f"servetune-vllm-cache-{os.getuid()}"), (fstype, added)
        assert filesystem_type(vllm_default_root({"XDG_CACHE_HOME": root}), LOCAL) != fstype
        assert added["TRITON_CACHE_DIR"] == f"{root}/servetune-triton-cache", added


def test_what_the_user_chose_is_kept():
    nfs = home_on("nfs4")
    environ = {"XDG_CACHE_HOME": "/home/ann/.cache"}
    # their own root: Triton's cache beside it where it is node-local, on the node where it is not
    assert compile_cache_env({"VLLM_CACHE_ROOT": "/scratch/vllm"}, environ, nfs) == {
        "TRITON_CACHE_DIR": "/scratch/vllm/servetune-triton-cache"}  # fmt: skip
    on_nfs = compile_cache_env({}, {**environ, "VLLM_CACHE_ROOT": "/home/ann/vllm"}, nfs)
    assert "VLLM_CACHE_ROOT" not in on_nfs and on_nfs["TRITON_CACHE_DIR"].startswith(tempfile.gettempdir()), on_nfs
    assert compile_cache_env({"TRITON_CACHE_DIR": "/scratch/triton"}, environ, home_on("ext4")) == {}
    assert compile_cache_env({}, {**environ, "TRITON_CACHE_DIR": "/scratch/triton"}, nfs).keys() == {"VLLM_CACHE_ROOT"}
    # cold starts asked for: nothing shared; "0" asks for nothing
    assert compile_cache_env({"VLLM_DISABLE_COMPILE_CACHE": "1"}, environ, nfs) == {}
    assert compile_cache_env({}, {**environ, "VLLM_DISABLE_COMPILE_CACHE": "1"}, home_on("ext4")) == {}
    assert "TRITON_CACHE_DIR" in compile_cache_env({"VLLM_DISABLE_COMPILE_CACHE": "0"}, environ, home_on("ext4"))


def test_the_fake_engine_keys_its_graph_on_what_shapes_it_as_vllm_does():
    base = ["--model", "/m", "--port", "8001", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.9"]
    same = ["--model", "/m", "--port", "9002", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.8",
            "--enable-prefix-caching"]  # fmt: skip
    assert compile_key(base) == compile_key(same)
    assert compile_key(base) != compile_key([*base[:5], "32", *base[6:]])
    assert compile_key(base) != compile_key([*base, "--enforce-eager"])
    assert compile_key(base) != compile_key([*base, "--dtype=float16"])


def test_a_study_s_engines_get_the_node_s_triton_cache_and_their_record_names_it(tmp_path, monkeypatch):
    from servetune.config.space import SearchSpace
    from servetune.trial.context import StudyContext, resolve_levels
    from servetune.trial.runner import placement_record

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("VLLM_DISABLE_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path / "vllm"))  # the worker's own root, node-local
    for env, expected in (({}, str(tmp_path / "vllm" / "servetune-triton-cache")), ({"TRITON_CACHE_DIR": "/t"}, None)):
        space = SearchSpace.model_validate({"name": "s", "model": "m", "workload": "cpu-tiny", "env": env})
        workload = space.resolved_workload(tmp_path)
        spec = StudyContext(space, workload, tmp_path, "m", resolve_levels(space, workload)).spec_for(
            {"max_num_seqs": 4}
        )
        assert spec.extra_env.get("TRITON_CACHE_DIR") == expected, spec.extra_env
        assert placement_record(spec).get("triton_cache_dir") == expected
        assert "VLLM_CACHE_ROOT" not in spec.extra_env  # the worker's choice stands


def test_a_trial_compiles_with_the_cpus_it_reserved_not_the_hosts(tmp_path, monkeypatch):
    from servetune.config.space import SearchSpace
    from servetune.trial.context import COMPILE_THREADS, StudyContext, resolve_levels
    from servetune.trial.runner import placement_record

    monkeypatch.delenv(COMPILE_THREADS, raising=False)

    def threads(env=None, **space_fields) -> str | None:
        space = SearchSpace.model_validate({"name": "s", "model": "m", "workload": "cpu-tiny", "env": env or {},
                                            **space_fields})  # fmt: skip
        workload = space.resolved_workload(tmp_path)
        context = StudyContext(space, workload, tmp_path, "m", resolve_levels(space, workload))
        return context.spec_for({"tensor_parallel_size": 2}).extra_env.get(COMPILE_THREADS)

    assert threads(device="gpu", hardware={"cpus_per_trial": 6}) == "6"  # beside its 2 GPUs, not the node's CPUs
    space = SearchSpace.model_validate({"name": "s", "model": "m", "workload": "cpu-tiny", "device": "gpu"})
    workload = space.resolved_workload(tmp_path)
    spec = StudyContext(space, workload, tmp_path, "m", resolve_levels(space, workload)).spec_for({})
    assert placement_record(spec)["compile_threads"] == "1"  # recorded in the trial's environment
    assert threads(device="cpu") == "2"  # a core per rank
    assert threads({COMPILE_THREADS: "3"}, device="gpu") is None  # the space's own value reaches the engine as is
    monkeypatch.setenv(COMPILE_THREADS, "5")
    assert threads(device="gpu") is None  # and so does the environment's
