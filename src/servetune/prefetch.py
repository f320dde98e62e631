"""A hub model's weights fetched once on each node that runs its engines, before the first engine starts.

Without it the first trial on a node downloads the checkpoint inside its start-up clock (and every trial starting
beside it waits on vLLM's download lock), so a 140 GB model's download is scored as that configuration's start-up,
or times it out. Here each such node runs one Ray task, pinned to it (``NodeAffinitySchedulingStrategy``), that
calls ``huggingface_hub.snapshot_download`` into the node's Hugging Face cache, where vLLM then finds the files.

What is fetched is what vLLM 0.32's default loader reads (``model_loader/default_loader.py``,
``weight_utils.download_weights_from_hf``): the files a safetensors index names where the repository has one, else
the first weight format its top-level files have of ``*.safetensors``, ``*.bin``, ``*.pt``; never ``original/``
(vLLM's ``LoadConfig.ignore_patterns``); and the config and tokenizer files beside them. Each node's time is kept in ``study.json``
(:class:`~servetune.results.WeightsPrefetch`), apart from the trials' start-up and their ``load_weights_s``.

Only the nodes of the GPU types an engine of the model asks for fetch it (Ray's ``accelerator_type:T`` resource,
``capacity/hardware.py``): a space comparing H100 and H200 fetches each model on the nodes of every type it runs on,
and none on an A10 node beside them. A cluster whose nodes declare no type cannot be told apart: every GPU node fetches.

A study prefetches before its first trial (:func:`prefetch_study`); ``verify``, ``serve-check`` and ``recheck``
prefetch before they start a point's engine (:func:`prefetch_point`): on this machine for a bare engine, else on the
Ray nodes that can host its Serve replicas.

A failed fetch is not the study's end: it is said, and the trials on that node download on their own.
"""

from __future__ import annotations

import fnmatch
import math
import platform
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from servetune.capacity.hardware import ACCELERATOR, gpu_types, ray_accelerator_type
from servetune.config.space import GPU_PARAM, Range, SearchSpace
from servetune.hub import TOKEN_VARIABLES, offline
from servetune.results import WeightsPrefetch

#: vLLM 0.32's default loader tries these weight formats in this order and reads the first the repository has.
WEIGHT_FORMATS = ("*.safetensors", "*.bin", "*.pt")
#: The config, generation config, tokenizer and chat template files vLLM and the tokenizer read beside the weights.
SIDE_FILES = ("*.json", "*.model", "*.tiktoken", "*.txt", "*.jinja")
#: vLLM's ``LoadConfig.ignore_patterns`` default (``original/**/*``): a repository's ``original/`` checkpoint is not
#: loaded. huggingface_hub matches with ``fnmatch``, where ``*`` crosses ``/``: this leaves out all of ``original/``.
IGNORED = ("original/*",)
#: Above this many grid points the pairs of model and GPU type are not read from the grid: every model is fetched
#: on the nodes of every type the space lists.
GRID_BOUND = 20_000
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


def trial_nodes(
    nodes: Iterable[Mapping[str, Any]], device: str, accelerators: Iterable[str | None] = ()
) -> list[TrialNode]:
    """The live nodes of ``ray.nodes()`` an engine can run on: those with GPUs for a GPU study, with a CPU for a CPU
    study (a head with ``num-cpus: 0`` runs the driver only). ``accelerators``: Ray accelerator types (``H100``)
    the engines ask for; a GPU node must declare one of them (``accelerator_type:T``). None among them (a GPU type
    the catalogue gives no Ray type), none given, or a cluster whose nodes declare no type: every GPU node."""
    wanted = set(accelerators)
    live = [n for n in nodes if n.get("Alive")]
    pinned = device == "gpu" and wanted and None not in wanted and gpu_types(n.get("Resources", {}) for n in live)

    def runs_engines(resources: Mapping[str, float]) -> bool:
        if device != "gpu":
            return resources.get("CPU", 0.0) >= 1
        if resources.get("GPU", 0.0) <= 0:
            return False
        return not pinned or any(resources.get(f"{ACCELERATOR}{t}", 0.0) > 0 for t in wanted)

    return [
        TrialNode(str(n["NodeID"]), str(n.get("NodeManagerAddress", "")))
        for n in live
        if runs_engines(n.get("Resources", {}))
    ]


def model_gpu_types(space: SearchSpace, models: Mapping[str, str]) -> dict[str, list[str | None]]:
    """Per model as trials load it (``models``: the space's name -> the resolved one), the Ray accelerator types of
    the GPUs its trials run on: the ``gpu`` parameter's types (``hardware.gpu``'s without one), narrowed to the
    pairs the grid keeps where the space can be gridded (its constraints may tie a model to a type). An empty list:
    any GPU node (no type named); None in it: a type the catalogue has no Ray type for."""
    types = space.gpu_types()
    if space.device != "gpu" or not types:
        return {loaded: [] for loaded in models.values()}
    try:
        size = math.prod(len(v.grid_values() if isinstance(v, Range) else v) for v in space.params.values())
        kept = space.grid()[0] if size <= GRID_BOUND else [{}]
    except ValueError:  # a continuous range: every model may run on every type
        kept = [{}]
    points = [*kept, *(space.baselines() if space.search.baseline else [])]
    pairs = {(space.model_for(p), gpu) for p in points for gpu in ([space.gpu_for(p)] if GPU_PARAM in p else types)}
    return {
        loaded: list(dict.fromkeys(ray_accelerator_type(gpu) for gpu in types if (model, gpu) in pairs))
        or [ray_accelerator_type(gpu) for gpu in types]
        for model, loaded in models.items()
    }


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


def prefetch(wanted: Sequence[tuple[Fetch, Sequence[TrialNode]]], say: Callable[[str], None],
             run: Runner = ray_runner, status: Callable[[str], Any] | None = None) -> list[WeightsPrefetch]:  # fmt: skip
    """Fetch each fetch of ``wanted`` on each of its nodes, side by side; a line per node as it finishes, and the
    records. ``status``: shows what is still downloading (a spinner's ``update``), as it changes."""
    pairs = [(fetch, node) for fetch, nodes in wanted for node in nodes]
    calls = [(i, node.node_id, fetch) for i, (fetch, node) in enumerate(pairs)]
    total = len(calls)
    records: list[WeightsPrefetch] = []
    started = time.monotonic()
    for count, (key, answer) in enumerate(run(calls), start=1):
        fetch, node = pairs[key]
        record = WeightsPrefetch(
            model=fetch.model, node_id=node.node_id, host=str(answer.get("host") or node.address),
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
                "its engines download the weights themselves, inside their start-up")  # fmt: skip
    return f"prefetch: {record.model} on {record.host}: {record.bytes / 1e9:.1f} GB in {record.download_s:.0f} s"


def plan_line(fetch: Fetch, nodes: Sequence[TrialNode], before: str = "the first trial") -> str:
    """What is about to be fetched, where."""
    size = f"{fetch.bytes / 1e9:.1f} GB" if fetch.bytes else "size unknown"
    return (f"prefetch: {fetch.model} ({size}: {', '.join(fetch.patterns[:1])} and config/tokenizer files) to "
            f"{len(nodes)} node(s) that run its engines, before {before}")  # fmt: skip


def prefetch_models(wanted: Mapping[str, Sequence[TrialNode]], env: Mapping[str, str], engine_args: Mapping[str, Any],
                    say: Callable[[str], None], status: Callable[[str], Any] | None = None, run: Runner = ray_runner,
                    before: str = "the first trial") -> list[WeightsPrefetch]:  # fmt: skip
    """Each hub model of ``wanted`` (as the engines load it: a local directory is an absolute path, the tiny model
    too) fetched on its nodes. A local model, an offline ``env``, a model no live node runs, or a hub that cannot
    list the files: one line saying so, and nothing fetched for it."""
    hub = {m: nodes for m, nodes in wanted.items() if not m.startswith("/")}
    if not hub:
        say("prefetch: nothing to download (the model is a local directory)")
        return []
    if offline(env):
        say("prefetch: none (HF_HUB_OFFLINE is set: the weights come from the nodes' caches)")
        return []
    fetches = []
    for model, nodes in hub.items():
        if not nodes:
            say(f"prefetch: {model}: no live node runs its engines yet (an autoscaler may add them): "
                "they download the weights themselves")  # fmt: skip
            continue
        try:
            fetch = plan_fetch(model, env, engine_args)
        except Exception as exc:  # the hub out of the driver's reach: the nodes' own downloads are the fallback
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            say(f"prefetch: {model}: could not list its files on the hub ({first}); its engines download the weights")
            continue
        say(plan_line(fetch, nodes, before))
        fetches.append((fetch, nodes))
    return prefetch(fetches, say, run, status) if fetches else []


def prefetch_study(space: SearchSpace, models: Mapping[str, str], say: Callable[[str], None],
                   status: Callable[[str], Any] | None = None, nodes: Sequence[Mapping[str, Any]] | None = None,
                   run: Runner = ray_runner) -> list[WeightsPrefetch]:  # fmt: skip
    """Before the study's first trial: each hub model among ``models`` (the space's name -> as the driver resolved
    it) fetched on every node that runs its trials: of the study's device, and of the GPU types its trials run on
    (:func:`model_gpu_types`). ``nodes``: as ``ray.nodes()`` gives them (the connected Ray's, by default)."""
    env = {k: str(v) for k, v in space.env.items()}
    if nodes is None and not offline(env) and any(not m.startswith("/") for m in models.values()):
        import ray

        nodes = ray.nodes()
    types = model_gpu_types(space, models)
    wanted: dict[str, list[TrialNode]] = {}
    for loaded in models.values():
        wanted[loaded] = trial_nodes(nodes or [], space.device, types.get(loaded, []))
    engine_args, _ = space.engine_params({})
    return prefetch_models(wanted, env, engine_args, say, status, run)


def local_runner(calls: Sequence[tuple[int, str, Fetch]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """:data:`Runner` in this process: for an engine this machine starts itself (no Ray)."""
    for key, _, fetch in calls:
        yield key, fetch_on_node(fetch)


#: The node a bare engine of ``verify`` or ``recheck`` runs on: this machine.
THIS_MACHINE = TrialNode("local", platform.node())


def prefetch_point(model: str, env: Mapping[str, str], engine_args: Mapping[str, Any], device: str,
                   say: Callable[[str], None], through_ray: bool, gpu_type: str | None = None,
                   status: Callable[[str], Any] | None = None, nodes: Sequence[Mapping[str, Any]] | None = None,
                   run: Runner | None = None) -> list[WeightsPrefetch]:  # fmt: skip
    """Before a point's engine starts again (``verify``, ``serve-check``, ``recheck``): its model fetched where the
    engine runs. A bare engine (``through_ray`` False) runs on this machine: fetched here, in this process. Through
    Serve, each live Ray node that can host a replica (of the device, and of ``gpu_type``, the Ray accelerator type
    the trial was pinned to) runs one task (``nodes``: as ``ray.nodes()`` gives them; the connected Ray's by
    default)."""
    before = "its engine starts"
    if not through_ray:
        return prefetch_models({model: [THIS_MACHINE]}, env, engine_args, say, status, run or local_runner, before)
    if nodes is None and not offline(env) and not model.startswith("/"):
        import ray

        nodes = ray.nodes()
    hosts = trial_nodes(nodes or [], device, [gpu_type] if gpu_type else [])
    return prefetch_models({model: hosts}, env, engine_args, say, status, run or ray_runner, before)
