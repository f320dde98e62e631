"""A hub model's weights fetched once per node that runs its engines, before the first trial or before verify,
serve-check and recheck start a point's engine (servetune/prefetch.py): which nodes (of the GPU types asked for),
which files, each node's time kept apart from the engines' start-up. huggingface_hub is replaced at its
boundary (``HfApi.model_info``, ``snapshot_download``): no hub is reachable here."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import huggingface_hub
import pytest
from aiohttp import web
from huggingface_hub.hf_api import RepoSibling

from servetune.accounting import prefetch_lines
from servetune.config.space import SearchSpace
from servetune.prefetch import (
    IGNORED,
    Fetch,
    fetch_on_node,
    fetch_patterns,
    matched_bytes,
    model_gpu_types,
    plan_fetch,
    prefetch_point,
    prefetch_study,
    trial_nodes,
)
from servetune.results import StudyInfo, WeightsPrefetch
from tests.conftest import serve_fake

MODEL = "org/model"
SECRET = "hf_secret_for_the_test"


def node(node_id: str, alive: bool = True, **resources: float) -> dict[str, Any]:
    return {"NodeID": node_id, "NodeManagerAddress": f"10.0.0.{len(node_id)}", "Alive": alive, "Resources": resources}


def test_the_nodes_that_run_trials_are_the_live_ones_with_the_studys_device():
    nodes = [node("head", CPU=0.0), node("gpu-a", CPU=64, GPU=8), node("gpu-dead", alive=False, CPU=64, GPU=8),
             node("cpu-only", CPU=16)]  # fmt: skip
    assert [n.node_id for n in trial_nodes(nodes, "gpu")] == ["gpu-a"]
    assert [n.node_id for n in trial_nodes(nodes, "cpu")] == ["gpu-a", "cpu-only"]  # a head of num-cpus 0 runs none


H100 = {"accelerator_type:H100": 1.0}
H200 = {"accelerator_type:H200": 1.0}
TYPED = [node("head", CPU=8), node("h100-1", CPU=64, GPU=8, **H100), node("h200-1", CPU=64, GPU=8, **H200),
         node("a10-1", CPU=16, GPU=4, **{"accelerator_type:A10G": 1.0}), node("h200-dead", alive=False, GPU=8, **H200)]  # fmt: skip


def test_a_gpu_engine_fetches_only_on_live_nodes_of_the_gpu_types_it_asks_for():
    def ids(accelerators: list[str | None], nodes: list[dict[str, Any]] = TYPED) -> list[str]:
        return [n.node_id for n in trial_nodes(nodes, "gpu", accelerators)]

    assert ids(["H100"]) == ["h100-1"]
    assert ids(["H100", "H200"]) == ["h100-1", "h200-1"]
    assert ids([]) == ids([None]) == ids(["H100", None]) == ["h100-1", "h200-1", "a10-1"]  # no type, or one unknown
    untyped = [node("gpu-a", CPU=64, GPU=8), node("gpu-b", CPU=64, GPU=8)]  # GPUs given by hand: no type declared
    assert ids(["H100"], untyped) == ["gpu-a", "gpu-b"]
    assert [n.node_id for n in trial_nodes(TYPED, "cpu", ["H100"])] == ["head", "h100-1", "h200-1", "a10-1"]


def test_the_weight_files_are_the_ones_vllm_loads_and_original_is_left_out():
    assert fetch_patterns(["config.json", "model-1.safetensors", "pytorch_model.bin"])[0] == "*.safetensors"
    # safetensors only under original/ (vLLM lists the top-level files): the .bin at the top is what it loads
    assert fetch_patterns(["original/consolidated.safetensors", "pytorch_model.bin"])[0] == "*.bin"
    assert fetch_patterns(["model.pt", "tokenizer.json"])[0] == "*.pt"
    side = fetch_patterns(["README.md"])
    assert not any(p in side for p in ("*.safetensors", "*.bin", "*.pt")) and "*.json" in side
    # with a safetensors index, only the shards it names (not a consolidated.safetensors beside them)
    files = ["model-1.safetensors", "model-2.safetensors", "consolidated.safetensors", "model.safetensors.index.json"]
    named = fetch_patterns(files, {"a.weight": "model-1.safetensors", "b.weight": "model-2.safetensors"})
    sizes = dict.fromkeys(files, 10) | {"original/consolidated.00.pth": 1000, "original/params.json": 1000}
    assert matched_bytes(sizes, named) == 30  # two shards and the index: original/ is left out
    assert (
        matched_bytes(
            {"model.safetensors": 100, "config.json": 2, "README.md": 50}, fetch_patterns(["model.safetensors"])
        )
        == 102
    )


def fake_snapshot(tmp_path: Path, calls: list[dict[str, Any]], fail_on: str | None = None):
    """``snapshot_download`` writing two files of 3 and 5 bytes into a folder of its own per call."""

    def snapshot_download(repo_id: str, **kwargs: Any) -> str:
        calls.append({"repo_id": repo_id, **kwargs})
        if fail_on is not None and kwargs.get("cache_dir") == fail_on:
            raise OSError("No space left on device\nmore detail")
        folder = tmp_path / f"snapshot-{len(calls)}"
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"abc")
        (folder / "config.json").write_bytes(b"{...}")
        return str(folder)

    return snapshot_download


def test_a_node_fetches_what_it_is_told_into_its_cache_and_says_how_long_and_how_much(tmp_path, monkeypatch):
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot(tmp_path, calls, fail_on="/full"))
    fetch = Fetch(MODEL, ("*.safetensors", "*.json"), 8, revision="abc123", cache_dir="/models", token=SECRET)
    answer = fetch_on_node(fetch)
    assert answer["bytes"] == 8 and answer["download_s"] >= 0 and "error" not in answer
    (call,) = calls
    assert call["repo_id"] == MODEL and call["allow_patterns"] == ["*.safetensors", "*.json"]
    assert call["ignore_patterns"] == list(IGNORED) and call["token"] == SECRET
    assert call["revision"] == "abc123" and call["cache_dir"] == "/models"
    failed = fetch_on_node(Fetch(MODEL, ("*.bin",), 0, cache_dir="/full"))
    assert failed["error"] == "OSError: No space left on device" and "bytes" not in failed


def local_runner(calls: Sequence[tuple[int, str, Fetch]]) -> Iterator[tuple[int, dict[str, Any]]]:
    """The Ray runner's contract, here: each node's task run in this process, the last node's answered first."""
    for key, node_id, fetch in reversed(calls):
        answer = fetch_on_node(Fetch(**{**fetch.__dict__, "cache_dir": node_id}))  # the node's cache, by its id
        yield key, answer


SPACE = {"name": "s", "model": MODEL, "device": "gpu", "workload": "chat", "hardware": {"devices_per_node": 8},
         "env": {"HF_TOKEN": SECRET}, "engine_args": {"revision": "v1"}}  # fmt: skip
NODES = [node("node-a", CPU=64, GPU=8), node("node-b", CPU=64, GPU=8)]  # as ray.nodes() gives them


@pytest.fixture
def hub(tmp_path, monkeypatch) -> list[dict[str, Any]]:
    """The hub's file listing of ``org/model`` (with sizes) and a ``snapshot_download`` that records its calls."""
    asked: list[dict[str, Any]] = []

    def model_info(self: Any, repo_id: str, **kwargs: Any) -> Any:
        asked.append({"repo_id": repo_id, **kwargs})
        if repo_id == "org/unreachable":
            raise ConnectionError("[Errno -2] Name or service not known")
        siblings = [RepoSibling("model-00001.safetensors", size=4_000_000_000),
                    RepoSibling("model-00002.safetensors", size=2_000_000_000),
                    RepoSibling("original/consolidated.pth", size=6_000_000_000), RepoSibling("config.json", size=700)]  # fmt: skip
        return type("Info", (), {"siblings": siblings})()

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot(tmp_path, calls, fail_on="node-b"))
    return calls


def test_a_hub_model_is_fetched_once_on_every_node_that_runs_trials_with_the_spaces_token_unsaid(hub):
    said: list[str] = []
    records = prefetch_study(SearchSpace.model_validate(SPACE), {MODEL: MODEL}, said.append, nodes=NODES,
                             run=local_runner)  # fmt: skip
    assert sorted(r.node_id for r in records) == ["node-a", "node-b"]  # once per node
    assert {c["repo_id"] for c in hub} == {MODEL} and {c["cache_dir"] for c in hub} == {"node-a", "node-b"}
    assert all(
        c["token"] == SECRET and c["revision"] == "v1" and c["allow_patterns"][0] == "*.safetensors" for c in hub
    )
    fetched = next(r for r in records if r.node_id == "node-a")
    assert fetched.error is None and fetched.bytes == 8 and fetched.download_s >= 0
    failed = next(r for r in records if r.node_id == "node-b")
    assert failed.error is not None and "No space left" in failed.error
    assert "6.0 GB" in said[0] and "2 node(s)" in said[0]  # the plan: the weights vLLM loads, not original/
    assert any("node-b" not in line and "failed" in line and "download the weights themselves" in line for line in said)
    assert SECRET not in " ".join(said) + " ".join(r.model_dump_json() for r in records)


def test_a_space_comparing_gpu_types_fetches_each_model_on_the_nodes_of_every_type_it_runs_on(hub):
    """``org/big`` is tied to H200 by a constraint: it is fetched on the H200 node only; ``org/model`` runs on both
    types; the A10G node runs neither and fetches nothing."""
    compared = SearchSpace.model_validate({**SPACE, "params": {"gpu": ["H100-SXM", "H200"], "model": [MODEL, "org/big"]},
                                           "constraints": ["model == 'org/model' or gpu == 'H200'"]})  # fmt: skip
    models = {MODEL: MODEL, "org/big": "org/big"}
    assert model_gpu_types(compared, models) == {MODEL: ["H100", "H200"], "org/big": ["H200"]}
    said: list[str] = []
    records = prefetch_study(compared, models, said.append, nodes=TYPED, run=local_runner)
    assert sorted((r.model, r.node_id) for r in records) == [
        ("org/big", "h200-1"),
        (MODEL, "h100-1"),
        (MODEL, "h200-1"),
    ]
    assert sum("to 2 node(s)" in line for line in said) == 1 and sum("to 1 node(s)" in line for line in said) == 1
    one_type = SearchSpace.model_validate({**SPACE, "hardware": {"devices_per_node": 8, "gpu": "H200"}})
    records = prefetch_study(one_type, {MODEL: MODEL}, said.append, nodes=TYPED, run=local_runner)
    assert [r.node_id for r in records] == ["h200-1"]


def test_a_points_engine_fetches_on_this_machine_when_bare_and_on_the_nodes_that_can_host_its_replicas_through_serve(
    hub, monkeypatch
):
    """verify, serve-check and recheck (``prefetch_point``): a bare engine starts on this machine, whose cache is
    filled in this process (no Ray); through Serve each live node of the trial's GPU type fetches in a task."""
    said: list[str] = []
    env = {"HF_TOKEN": SECRET}
    (here,) = prefetch_point(MODEL, env, {"revision": "v1"}, "gpu", said.append, through_ray=False)
    assert here.node_id == "local" and here.error is None and here.bytes == 8
    assert [(c["repo_id"], c["revision"], c["token"]) for c in hub] == [(MODEL, "v1", SECRET)]
    assert "before its engine starts" in said[0] and SECRET not in " ".join(said)
    served = prefetch_point(MODEL, env, {}, "gpu", said.append, through_ray=True, gpu_type="H200", nodes=TYPED,
                            run=local_runner)  # fmt: skip
    assert [r.node_id for r in served] == ["h200-1"]
    cpu = prefetch_point(MODEL, env, {}, "cpu", said.append, through_ray=True, nodes=TYPED, run=local_runner)
    assert sorted(r.node_id for r in cpu) == ["a10-1", "h100-1", "h200-1", "head"]
    hub.clear()
    assert prefetch_point("/models/local", env, {}, "gpu", said.append, through_ray=False) == []
    assert "local directory" in said[-1]
    assert prefetch_point(MODEL, {"HF_HUB_OFFLINE": "1"}, {}, "gpu", said.append, through_ray=False) == []
    assert "offline" in said[-1].lower() and hub == []


def test_a_local_model_an_offline_space_or_an_unlisted_model_fetch_nothing_and_say_so_once(hub, tmp_path):
    def never(calls: Sequence[tuple[int, str, Fetch]]) -> Iterator[tuple[int, dict[str, Any]]]:
        raise AssertionError("nothing is to run")

    space = SearchSpace.model_validate(SPACE)
    said: list[str] = []
    assert prefetch_study(space, {"tiny": str(tmp_path / "tiny")}, said.append, nodes=NODES, run=never) == []
    assert len(said) == 1 and "local directory" in said[0]
    offline = SearchSpace.model_validate({**SPACE, "env": {"HF_HUB_OFFLINE": "1"}})
    assert prefetch_study(offline, {MODEL: MODEL}, said.append, nodes=NODES, run=never) == []
    assert "offline" in said[-1].lower()
    assert prefetch_study(space, {"org/unreachable": "org/unreachable"}, said.append, nodes=NODES, run=never) == []
    assert "could not list its files" in said[-1] and "Name or service not known" in said[-1]
    assert prefetch_study(space, {MODEL: MODEL}, said.append, nodes=[], run=never) == [] and "no live node" in said[-1]
    assert hub == []


def test_each_nodes_download_time_is_kept_in_study_json_and_accounted_apart_from_the_start_up():
    records = [WeightsPrefetch(model=MODEL, node_id="a", host="h-a", download_s=93.2, bytes=16_100_000_000),
               WeightsPrefetch(model=MODEL, node_id="b", host="h-b", download_s=41.0, bytes=16_100_000_000),
               WeightsPrefetch(model=MODEL, node_id="c", host="h-c", download_s=3.0, error="OSError: disk full")]  # fmt: skip
    info = StudyInfo(name="s", created="now", space_file="s.yaml", model=MODEL, workload="chat", device="gpu",
                     algorithm="grid", objectives=[], slo=[], price_per_device_hour=1.0, servetune_version="0",
                     prefetch=records)  # fmt: skip
    again = StudyInfo.model_validate_json(info.model_dump_json())
    assert again.prefetch == records
    older = StudyInfo.model_validate_json(info.model_dump_json(exclude={"prefetch"}))  # a study.json from before
    assert older.prefetch == []
    (line,) = prefetch_lines(records)
    assert "16.1 GB on 2 node(s), 93 s on the slowest" in line and "failed on 1" in line
    assert "loading weights" in line  # said to be outside load_weights_s
    (none,) = prefetch_lines(records[2:])
    assert "failed on every node" in none
    assert prefetch_lines([]) == []


SHA = "a" * 40
INDEX = {"weight_map": {"w1": "model-1.safetensors", "w2": "model-2.safetensors"}}
REPO = {"config.json": b'{"a": 1}', "model-1.safetensors": b"x" * 1000, "model-2.safetensors": b"y" * 500,
        "consolidated.safetensors": b"z" * 3000, "model.safetensors.index.json": json.dumps(INDEX).encode(),
        "original/consolidated.00.pth": b"o" * 4000, "README.md": b"hello"}  # fmt: skip


class FakeHub:
    """The hub's model info, file tree and ``resolve`` for one repository (``REPO`` at commit ``SHA``), recording the
    files fetched and the token they were fetched with."""

    def __init__(self) -> None:
        self.got: list[tuple[str, str | None]] = []

    def app(self) -> web.Application:
        def sha1(body: bytes) -> str:
            return hashlib.sha1(body).hexdigest()

        async def info(request: web.Request) -> web.Response:
            siblings = [{"rfilename": name, "size": len(body)} for name, body in REPO.items()]
            return web.json_response({"id": "org/m", "sha": SHA, "private": False, "siblings": siblings})

        async def tree(request: web.Request) -> web.Response:
            return web.json_response(
                [{"type": "file", "path": n, "size": len(b), "oid": sha1(b)} for n, b in REPO.items()]
            )

        async def resolve(request: web.Request) -> web.Response:
            name = request.match_info["path"]
            if name not in REPO:
                return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
            body = REPO[name]
            if request.method == "GET":
                self.got.append((name, request.headers.get("Authorization")))
            headers = {"X-Repo-Commit": SHA, "ETag": f'"{sha1(body)}"', "Content-Length": str(len(body))}
            return web.Response(body=b"" if request.method == "HEAD" else body, headers=headers)

        app = web.Application()
        app.router.add_get("/api/models/{org}/{name}", info)
        app.router.add_get("/api/models/{org}/{name}/revision/{rev}", info)
        app.router.add_get("/api/models/{org}/{name}/tree/{rev}", tree)
        app.router.add_route("*", "/{org}/{name}/resolve/{rev}/{path:.*}", resolve)
        return app


def test_huggingface_hub_fetches_only_the_shards_vllm_loads_into_the_nodes_cache(tmp_path):
    """huggingface_hub itself, against a hub on 127.0.0.1 (the space's ``HF_ENDPOINT``): the index's shards, the config and the index are fetched
    (not the consolidated copy, not original/), the plan's bytes are what lands, a second fetch downloads nothing."""
    hub = FakeHub()
    with serve_fake(hub) as url:  # the space's env: HF_ENDPOINT, as the engines would get it
        cache = tmp_path / "node-cache"
        fetch = plan_fetch("org/m", {"HF_TOKEN": SECRET, "HF_ENDPOINT": url}, {"download_dir": str(cache)})
        hub.got.clear()  # the driver read the index to plan
        first = fetch_on_node(fetch)
        fetched = sorted(name for name, _ in hub.got)
        second = fetch_on_node(fetch)
    expected = ["config.json", "model-1.safetensors", "model-2.safetensors", "model.safetensors.index.json"]
    assert "error" not in first, first
    assert fetched == expected and {auth for _, auth in hub.got} == {f"Bearer {SECRET}"}
    assert first["bytes"] == fetch.bytes == sum(len(REPO[n]) for n in expected)
    (snapshot,) = (cache / "models--org--m" / "snapshots").iterdir()  # the cache layout vLLM reads
    assert sorted(p.name for p in snapshot.iterdir()) == expected and snapshot.name == SHA
    assert second["bytes"] == first["bytes"] and len(hub.got) == len(expected)  # cached: nothing downloaded again


def test_servetune_run_prefetches_once_before_the_first_trial_and_keeps_it_in_study_json(tmp_path, monkeypatch):
    """``run_study``'s wiring, Ray and Tune replaced at their boundary: the prefetch runs once, after Ray is up and
    before the trials are handed to Tune; its records land in study.json and the closing lines; --no-prefetch skips."""
    import argparse

    import servetune.prefetch as prefetch_module
    import servetune.study.tuner as tuner
    from servetune.cli import run as run_cli
    from servetune.results import STUDY_FILE

    events: list[str] = []
    record = WeightsPrefetch(model=MODEL, node_id="a", host="h-a", download_s=12.0, bytes=5_000_000_000)

    def fake_prefetch(space: Any, models: Any, say: Any, status: Any = None) -> list[WeightsPrefetch]:
        events.append(f"prefetch {sorted(set(models))}")
        return [record]

    monkeypatch.setattr(prefetch_module, "prefetch_study", fake_prefetch)
    monkeypatch.setattr(tuner, "init_ray", lambda *a, **k: events.append("ray") or True)
    monkeypatch.setattr(tuner, "cluster_devices", lambda space: [8.0])
    monkeypatch.setattr(tuner, "run_tuner", lambda context, points, *a, **k: events.append(f"tune {len(points)}"))
    monkeypatch.chdir(tmp_path)
    space_file = tmp_path / "space.yaml"
    space_file.write_text(f"name: s\nmodel: {MODEL}\ndevice: gpu\nworkload: chat\nhardware: {{gpu: H100-80GB}}\n"
                          "params: {max_num_seqs: [8, 16]}\n")  # fmt: skip
    from servetune.space_file import load_space

    space = load_space(space_file, None)

    def run(no_prefetch: bool) -> str:
        args = argparse.Namespace(space=space_file, storage=tmp_path / "results", resume=False, unprune=False,
                                  max_trials=None, no_checks=True, no_prefetch=no_prefetch, python="python",
                                  tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", address=None)  # fmt: skip
        assert run_cli.run_study(space, args) == 0
        return (tmp_path / "results" / "s" / STUDY_FILE).read_text()

    study = StudyInfo.model_validate_json(run(no_prefetch=False))
    assert events == ["ray", f"prefetch ['{MODEL}']", "tune 3"]  # before Tune, once, the model once
    assert study.prefetch == [record]
    events.clear()
    shutil.rmtree(tmp_path / "results")
    assert StudyInfo.model_validate_json(run(no_prefetch=True)).prefetch == [] and events == ["ray", "tune 3"]


def test_a_refused_checkpoint_of_the_model_parameter_is_named_with_its_field(tmp_path, monkeypatch):
    """The access check before anything starts (servetune/hub.py, cli/run_hub.py ``check_hub_models``): the line names
    the field that lists the refused model, ``params.model`` for a checkpoint the search varies."""
    import httpx
    from huggingface_hub.errors import GatedRepoError

    from servetune.cli.run_hub import check_hub_models
    from servetune.errors import UserError

    def auth_check(repo_id: str, token: str | None = None) -> None:
        if repo_id == "org/gated":
            response = httpx.Response(401, request=httpx.Request("GET", f"https://hub/api/models/{repo_id}/auth-check"))
            raise GatedRepoError("gated", response=response)

    monkeypatch.setattr(huggingface_hub, "auth_check", auth_check)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    space = SearchSpace.model_validate({**SPACE, "env": {}, "params": {"model": [MODEL, "org/gated"]}})
    with pytest.raises(UserError) as refused:
        check_hub_models(space, tmp_path)
    assert str(refused.value).startswith("params.model org/gated: gated on the hub") and "without a token" in str(
        refused.value
    )
    check_hub_models(SearchSpace.model_validate({**SPACE, "env": {}}), tmp_path)  # served: nothing said
