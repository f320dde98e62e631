"""A hub model's weights fetched once on each node that runs trials, before the first trial starts.

Without it the first trial on a node downloads the checkpoint inside its start-up clock (and every trial starting
beside it waits on vLLM's download lock), so a 140 GB model's download is scored as that configuration's start-up,
or times it out. Here each such node runs one Ray task, pinned to it (``NodeAffinitySchedulingStrategy``), that
calls ``huggingface_hub.snapshot_download`` into the node's Hugging Face cache, where vLLM then finds the files.

What is fetched is what vLLM 0.32's default loader reads (``model_loader/default_loader.py``,
``weight_utils.download_weights_from_hf``): the files a safetensors index names where the repository has one, else
the first weight format its top-level files have of ``*.safetensors``, ``*.bin``, ``*.pt``; never ``original/``
(vLLM's ``LoadConfig.ignore_patterns``); and the config and tokenizer files beside them. Each node's time is kept in ``study.json``
(:class:`~servetune.results.WeightsPrefetch`), apart from the trials' start-up and their ``load_weights_s``.

A failed fetch is not the study's end: it is said, and the trials on that node download on their own.
"""

from __future__ import annotations

import fnmatch
import os
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from servetune.hub import OFFLINE_VARIABLES, TOKEN_VARIABLES
from servetune.results import WeightsPrefetch

if TYPE_CHECKING:
    from servetune.config.space import SearchSpace

#: vLLM 0.32's default loader tries these weight formats in this order and reads the first the repository has.
WEIGHT_FORMATS = ("*.safetensors", "*.bin", "*.pt")
#: The config, generation config, tokenizer and chat template files vLLM and the tokenizer read beside the weights.
SIDE_FILES = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
#: vLLM's ``LoadConfig.ignore_patterns`` default (``original/**/*``): a repository's ``original/`` checkpoint is not
#: loaded. huggingface_hub matches with ``fnmatch``, where ``*`` crosses ``/``: this leaves out all of ``original/``.
IGNORED = ("original/*",)
#: The safetensors index vLLM reads to fetch only the shards its ``weight_map`` names.
SAFETENSORS_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class TrialNode:
    """A live Ray node that can run one of the study's trials."""

    node_id: str
    address: str


@dataclass(frozen=True)
class Fetch:
    """What every node fetches of one model: the file patterns, and the bytes they come to (0: unknown)."""

    model: str
    patterns: tuple[str, ...]
    bytes: int
    revision: str | None = None
    cache_dir: str | None = None  # vLLM's ``download_dir``, else the node's Hugging Face cache
    token: str | None = None  # the space's env: token; None: the node's own (HF_TOKEN, or its stored token)
    endpoint: str | None = None  # the space's env: HF_ENDPOINT (a mirror); None: the node's own


def trial_nodes(nodes: Iterable[Mapping[str, Any]], device: str) -> list[TrialNode]:
    """The live nodes of ``ray.nodes()`` a trial can run on: those with GPUs for a GPU study, with a CPU for a CPU
    study (a head with ``num-cpus: 0`` runs the driver only)."""

    def runs_trials(resources: Mapping[str, float]) -> bool:
        return resources.get("GPU", 0.0) > 0 if device == "gpu" else resources.get("CPU", 0.0) >= 1

    return [
        TrialNode(str(n["NodeID"]), str(n.get("NodeManagerAddress", "")))
        for n in nodes
        if n.get("Alive") and runs_trials(n.get("Resources", {}))
    ]


def fetch_patterns(files: Sequence[str], weight_map: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The patterns a node fetches of a repository of ``files``: the shards of its safetensors index's ``weight_map``
    where it has one, else the weight format vLLM would load (the first of :data:`WEIGHT_FORMATS` among the
    top-level files, as vLLM lists them), and the side files. None of the formats: the side files only (vLLM will
    say what it misses)."""
    if weight_map:
        return (*sorted(set(weight_map.values())), *SIDE_FILES)
    top = [f for f in files if "/" not in f]
    weights = next((pattern for pattern in WEIGHT_FORMATS if fnmatch.filter(top, pattern)), None)
    return (*([weights] if weights else []), *SIDE_FILES)


def matched_bytes(sizes: Mapping[str, int | None], patterns: Sequence[str]) -> int:
    """The bytes of the files ``snapshot_download`` fetches for the patterns (it matches as ``fnmatchcase``)."""
    return sum(
        size or 0
        for name, size in sizes.items()
        if any(fnmatch.fnmatchcase(name, p) for p in patterns)
        and not any(fnmatch.fnmatchcase(name, p) for p in IGNORED)
    )


def plan_fetch(model: str, space_env: Mapping[str, str], engine_args: Mapping[str, Any]) -> Fetch:
    """Ask the hub (from the driver, once) which files of ``model`` the nodes fetch, and how many bytes they are.
    Raises what ``huggingface_hub`` raises when the hub cannot be asked."""
    import huggingface_hub

    token = space_token(space_env)
    endpoint = space_env.get("HF_ENDPOINT") or None
    revision = engine_args.get("revision")
    info = huggingface_hub.HfApi(endpoint=endpoint).model_info(
        model, revision=revision, token=token, files_metadata=True
    )
    sizes = {s.rfilename: s.size for s in info.siblings or []}
    weight_map = None
    if SAFETENSORS_INDEX in sizes:  # as vLLM: only the shards the index names (a repository may hold others)
        import json
        import tempfile

        with tempfile.TemporaryDirectory(prefix="servetune-index-") as scratch:  # read here, kept nowhere
            index = huggingface_hub.hf_hub_download(model, SAFETENSORS_INDEX, revision=revision, token=token,
                                                    endpoint=endpoint, cache_dir=scratch)  # fmt: skip
            weight_map = json.loads(Path(index).read_text()).get("weight_map")
    patterns = fetch_patterns(list(sizes), weight_map)
    download_dir = engine_args.get("download_dir")
    return Fetch(model, patterns, matched_bytes(sizes, patterns), revision=None if revision is None else str(revision),
                 cache_dir=None if download_dir is None else str(download_dir), token=token, endpoint=endpoint)  # fmt: skip


def space_token(space_env: Mapping[str, str]) -> str | None:
    """The token the space's ``env:`` gives the trials (its first of HF_TOKEN, HUGGING_FACE_HUB_TOKEN), else None."""
    return next((str(space_env[n]) for n in TOKEN_VARIABLES if space_env.get(n)), None)


def offline(space_env: Mapping[str, str]) -> bool:
    """Whether the space or this process tells Hugging Face to stay offline (the weights come from a cache)."""
    merged = {**os.environ, **space_env}
    return any(merged.get(n) not in (None, "", "0", "false", "False") for n in OFFLINE_VARIABLES)


def fetch_on_node(fetch: Fetch) -> dict[str, Any]:
    """Run on the node (a Ray task): ``snapshot_download`` of the fetch into the node's cache; how long it took,
    the bytes now there, the host; ``error`` (one line) instead of raising, so the driver hears every node."""
    import huggingface_hub
    from huggingface_hub.utils import tqdm

    class Quiet(tqdm):  # the bars of a Ray task reach the driver as a mess of lines
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **{**kwargs, "disable": True})

    started = time.monotonic()
    try:
        folder = huggingface_hub.snapshot_download(
            fetch.model, revision=fetch.revision, cache_dir=fetch.cache_dir, token=fetch.token, endpoint=fetch.endpoint,
            allow_patterns=list(fetch.patterns), ignore_patterns=list(IGNORED), tqdm_class=Quiet,
        )  # fmt: skip
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return {"host": platform.node(), "download_s": time.monotonic() - started, "error": f"{type(exc).__name__}: {first}"}  # fmt: skip
    size = sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())  # the cache's links, followed
    return {"host": platform.node(), "download_s": time.monotonic() - started, "bytes": size}


#: Runs ``fetch_on_node`` for each (key, node id, fetch) and yields (key, its answer) as each finishes.
Runner = Callable[[Sequence[tuple[int, str, Fetch]]], Iterator[tuple[int, dict[str, Any]]]]


def ray_runner(calls: Sequence[tuple[int, str, Fetch]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """:data:`Runner` on the connected Ray: one task per call, pinned to its node, answered as they finish."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fetch_on_node)
    pending = {
        task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(fetch): key
        for key, node_id, fetch in calls
    }
    try:
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            key = pending.pop(done[0])
            try:
                yield key, ray.get(done[0])
            except Exception as exc:  # the node died, or could not run the task
                yield key, {"download_s": 0.0, "error": str(exc).splitlines()[0] if str(exc) else type(exc).__name__}
    finally:
        for ref in pending:  # stopped early (Ctrl-C): the downloads left are not waited for
            ray.cancel(ref, force=True)


def prefetch(fetches: Sequence[Fetch], nodes: Sequence[TrialNode], say: Callable[[str], None],
             run: Runner = ray_runner, status: Callable[[str], Any] | None = None) -> list[WeightsPrefetch]:  # fmt: skip
    """Fetch each of ``fetches`` on each of ``nodes``, side by side; a line per node as it finishes, and the
    records. ``status``: shows what is still downloading (a spinner's ``update``), as it changes."""
    calls = [(i, node.node_id, fetch) for i, (fetch, node) in enumerate((f, n) for f in fetches for n in nodes)]
    total = len(calls)
    records: list[WeightsPrefetch] = []
    started = time.monotonic()
    for count, (key, answer) in enumerate(run(calls), start=1):
        _, node_id, fetch = calls[key]
        node = next(n for n in nodes if n.node_id == node_id)
        record = WeightsPrefetch(
            model=fetch.model, node_id=node_id, host=str(answer.get("host") or node.address),
            download_s=round(float(answer.get("download_s", 0.0)), 3), bytes=int(answer.get("bytes", 0)),
            error=answer.get("error"),
        )  # fmt: skip
        records.append(record)
        say(node_line(record))
        if status is not None and count < total:
            status(f"prefetching weights: {count} of {total} node download(s) done, {time.monotonic() - started:.0f} s")
    return records


def node_line(record: WeightsPrefetch) -> str:
    """``prefetch: org/model on host-1: 16.1 GB in 93 s`` (or why it failed, and what follows)."""
    if record.error:
        return (f"prefetch: {record.model} on {record.host} failed after {record.download_s:.0f} s ({record.error}); "
                "its trials download the weights themselves, inside their start-up")  # fmt: skip
    return f"prefetch: {record.model} on {record.host}: {record.bytes / 1e9:.1f} GB in {record.download_s:.0f} s"


def plan_line(fetch: Fetch, nodes: Sequence[TrialNode]) -> str:
    """What is about to be fetched, where."""
    size = f"{fetch.bytes / 1e9:.1f} GB" if fetch.bytes else "size unknown"
    return (f"prefetch: {fetch.model} ({size}: {', '.join(fetch.patterns[:1])} and config/tokenizer files) to "
            f"{len(nodes)} node(s) that run trials, before the first trial")  # fmt: skip


def prefetch_study(space: SearchSpace, models: Iterable[str], say: Callable[[str], None],
                   status: Callable[[str], Any] | None = None, nodes: Sequence[TrialNode] | None = None,
                   run: Runner = ray_runner) -> list[WeightsPrefetch]:  # fmt: skip
    """Before the study's first trial: each hub model among ``models`` (as the driver resolved them: a local
    directory is an absolute path, the tiny model too) fetched on every node that runs trials (``nodes``: the
    connected Ray's, by default). A local model, an offline space, or a hub that cannot list the files: one line
    saying so, and nothing fetched."""
    hub = [m for m in dict.fromkeys(models) if not m.startswith("/")]
    if not hub:
        say("prefetch: nothing to download (the model is a local directory)")
        return []
    env = {k: str(v) for k, v in space.env.items()}
    if offline(env):
        say("prefetch: none (HF_HUB_OFFLINE is set: the weights come from the nodes' caches)")
        return []
    if nodes is None:
        import ray

        nodes = trial_nodes(ray.nodes(), space.device)
    if not nodes:
        say(f"prefetch: no live node runs {space.device.upper()} trials yet (an autoscaler may add them): "
            "their trials download the weights themselves")  # fmt: skip
        return []
    engine_args, _ = space.engine_params({})
    fetches = []
    for model in hub:
        try:
            fetch = plan_fetch(model, env, engine_args)
        except Exception as exc:  # the hub out of the driver's reach: the nodes' own downloads are the fallback
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            say(f"prefetch: {model}: could not list its files on the hub ({first}); its trials download the weights")
            continue
        say(plan_line(fetch, nodes))
        fetches.append(fetch)
    return prefetch(fetches, nodes, say, run, status) if fetches else []
