"""Where a trial's engine keeps vLLM's compile cache (engine/compile_cache.py), and the fake engine's key."""

from __future__ import annotations

import os

from servetune.engine.compile_cache import compile_cache_env, filesystem_type, vllm_default_root
from servetune.testing.fake_openai import compile_key

LOCAL = [("/", "ext4"), ("/proc", "proc"), ("/tmp", "tmpfs")]


def home_on(fstype: str):
    return lambda: [*LOCAL, ("/home", fstype)]


def test_the_longest_mount_point_decides_the_filesystem():
    parts = [("/", "ext4"), ("/home", "nfs4"), ("/home/local", "xfs")]
    assert filesystem_type(vllm_default_root({"XDG_CACHE_HOME": "/home/ann/.cache"}), parts) == "nfs4"
    assert filesystem_type(vllm_default_root({"XDG_CACHE_HOME": "/home/local/.cache"}), parts) == "xfs"
    assert filesystem_type(vllm_default_root({"XDG_CACHE_HOME": "/homework/.cache"}), parts) == "ext4"  # not under /home


def test_a_node_local_default_is_left_to_vllm():
    assert compile_cache_env({}, {"XDG_CACHE_HOME": "/home/ann/.cache"}, home_on("ext4")) == {}


def test_a_home_on_a_network_filesystem_gets_a_node_local_cache():
    for fstype in ("nfs", "nfs4", "lustre", "fuse.sshfs"):
        added = compile_cache_env({}, {"XDG_CACHE_HOME": "/home/ann/.cache"}, home_on(fstype))
        root = added["VLLM_CACHE_ROOT"]
        assert root.endswith(f"servetune-vllm-cache-{os.getuid()}"), (fstype, added)
        assert filesystem_type(vllm_default_root({"XDG_CACHE_HOME": root}), LOCAL) != fstype


def test_what_the_user_chose_is_kept():
    nfs = home_on("nfs4")
    environ = {"XDG_CACHE_HOME": "/home/ann/.cache"}
    assert compile_cache_env({"VLLM_CACHE_ROOT": "/scratch/vllm"}, environ, nfs) == {}
    assert compile_cache_env({}, {**environ, "VLLM_CACHE_ROOT": "/scratch/vllm"}, nfs) == {}
    assert compile_cache_env({"VLLM_DISABLE_COMPILE_CACHE": "1"}, environ, nfs) == {}


def test_the_fake_engine_keys_its_graph_on_what_shapes_it_as_vllm_does():
    base = ["--model", "/m", "--port", "8001", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.9"]
    same = ["--model", "/m", "--port", "9002", "--max-num-seqs", "16", "--gpu-memory-utilization", "0.8",
            "--enable-prefix-caching"]  # fmt: skip
    assert compile_key(base) == compile_key(same)
    assert compile_key(base) != compile_key([*base[:5], "32", *base[6:]])
    assert compile_key(base) != compile_key([*base, "--enforce-eager"])
    assert compile_key(base) != compile_key([*base, "--dtype=float16"])
