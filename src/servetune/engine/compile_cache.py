"""Where a trial's engine keeps vLLM's compile cache: one directory per node, shared by its trials.

On a GPU, ``torch.compile`` is a large part of an engine's start (tens of seconds), and vLLM
caches what it compiled under ``VLLM_CACHE_ROOT`` (default ``~/.cache/vllm``), keyed by a hash of
everything that shapes the compiled graph: the model, dtype, quantization, ``max_model_len``, KV-cache
dtype, block size, parallel sizes, ``max_num_seqs`` and ``max_num_batched_tokens`` (the scheduler
config's own hash holds both: vLLM 0.32's ``vllm/config/scheduler.py:277-281``), but not
``gpu_memory_utilization``, the KV-cache size, prefix caching or chunked prefill. Which engine arguments,
and where vLLM hashes each: config/graphs.py (``GRAPH_ARGS``; ``search.graph_steps`` draws their ranges at
fewer values so that trials share graphs). A later trial on the same node whose graph is the same loads it
instead of compiling.

Sharing is safe where the writers are on one machine: PyTorch 2.10 and later (vLLM pins newer)
writes its artifacts atomically. It is not safe where engines on several nodes write one directory
over a network filesystem: that is how "corrupted compilation artifact" start-up failures came
about. So a home directory on NFS, Lustre and the like gets a node-local cache instead
(``<temp dir>/servetune-vllm-cache-<uid>``). A ``VLLM_CACHE_ROOT`` (or
``VLLM_DISABLE_COMPILE_CACHE``) the user set, in the search space's ``env`` or the worker's
environment, is left as it is.

Triton's kernel cache is shared more widely than vLLM's graphs. vLLM points Inductor's and
Triton's caches inside the keyed directory, so a trial with another ``max_num_batched_tokens``
compiles every kernel again, though most come out the same (the same source for any bound on the
token count). vLLM keeps a ``TRITON_CACHE_DIR`` its caller set (``InductorAdaptor.initialize_cache``),
and Triton keys each kernel on its source, target and compile options, writing each file
atomically, as its default cache shared by all of a user's processes already requires. So the
trials of a node share one Triton cache beside vLLM's (``<vLLM's cache root>/servetune-triton-cache``,
node-local as above); a ``TRITON_CACHE_DIR`` the user set is kept, and a disabled compile cache
turns this off too. How much of a cold compile it saves on a GPU: ``bench/triton_cache.py``.
"""

from __future__ import annotations

import functools
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

#: Filesystems whose files other machines see: a directory on one is written by every node.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smbfs", "smb3", "lustre", "gpfs", "beegfs", "cephfs", "ceph", "glusterfs",
    "fuse.glusterfs", "fuse.sshfs", "fuse.cephfs", "fuse.juicefs", "fuse.gcsfuse", "fuse.s3fs", "fuse.lustre",
    "9p", "afs", "wekafs", "panfs", "pvfs2", "orangefs", "fuse.weka",
})  # fmt: skip

TRITON_DIR_NAME = "servetune-triton-cache"


def vllm_default_root(environ: Mapping[str, str]) -> Path:
    """Where vLLM keeps its cache when nothing says otherwise (its ``envs.VLLM_CACHE_ROOT``)."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vllm"


def filesystem_type(path: Path, partitions: Sequence[tuple[str, str]]) -> str | None:
    """The type of the filesystem ``path`` is (or would be) on: its longest mount point prefix."""
    resolved = str(path.resolve())
    best: tuple[int, str] | None = None
    for mountpoint, fstype in partitions:
        inside = resolved == mountpoint or resolved.startswith(mountpoint.rstrip("/") + "/")
        if inside and (best is None or len(mountpoint) > best[0]):
            best = (len(mountpoint), fstype)
    return best[1] if best else None


@functools.cache
def _partitions() -> tuple[tuple[str, str], ...]:
    """The mount table, read once per process: every trial spec asks (the driver makes one per proposal)."""
    return tuple((p.mountpoint, p.fstype) for p in psutil.disk_partitions(all=True))


def node_local_root() -> Path:
    """The compile cache servetune gives a node whose vLLM default lies on a network filesystem."""
    return Path(tempfile.gettempdir()) / f"servetune-vllm-cache-{os.getuid()}"


def compile_cache_env(
    env: Mapping[str, str],
    environ: Mapping[str, str] | None = None,
    partitions: Callable[[], Sequence[tuple[str, str]]] = _partitions,
) -> dict[str, str]:
    """What to add to an engine's environment so that the trials of a node share a compile cache
    safely: a node-local ``VLLM_CACHE_ROOT`` where vLLM's default lies on a network filesystem, and a
    Triton cache beside it; nothing the user chose is overridden."""
    environ = os.environ if environ is None else environ

    def chosen(name: str) -> str | None:
        return env.get(name, environ.get(name))

    if chosen("VLLM_DISABLE_COMPILE_CACHE") not in (None, "", "0"):
        return {}  # cold starts asked for: nothing shared
    added: dict[str, str] = {}
    root = Path(chosen("VLLM_CACHE_ROOT") or vllm_default_root(environ))
    on_network = (filesystem_type(root, partitions()) or "").lower() in NETWORK_FILESYSTEMS
    if on_network and chosen("VLLM_CACHE_ROOT") is None:
        added["VLLM_CACHE_ROOT"] = str(node_local_root())
    if chosen("TRITON_CACHE_DIR") is None:
        added["TRITON_CACHE_DIR"] = str((node_local_root() if on_network else root) / TRITON_DIR_NAME)
    return added
