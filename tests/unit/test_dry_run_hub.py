"""``servetune run --dry-run`` plans and prints from this machine alone (cli/run_hub.py): no access check, no
``config.json`` fetched, no request to any host, unless ``--hub`` asks for them. What it could not ask the hub is
a line each: the access check the run makes, a model in no local cache and how to keep it here."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from servetune.cli import main
from tests.unit.test_search_spaces import SUMMARY

UNCACHED = "acme/never-cached-7b"
SPACE = """
name: hubless
model: {model}
device: gpu
workload: chat
load: {{levels: [2]}}
slo: {{ttft_ms: {{p99: 2000}}}}
hardware: {{devices_per_node: 8, gpu: H100-SXM}}
params:
  max_num_seqs: [64, 128]
"""


@pytest.fixture
def network(monkeypatch) -> list[str]:
    """Every host other than this one that the test looks up or connects to: refused at once, and kept here
    (huggingface_hub turns what it cannot reach into a warning or a "not planned", so the list is the evidence)."""
    from servetune.capacity import source

    source._unreachable.cache_clear()  # the hub probe is asked once per process: this test's own is seen
    tried: list[str] = []
    real_getaddrinfo, real_connect = socket.getaddrinfo, socket.socket.connect

    def here(host: object) -> bool:
        return str(host) in ("localhost", "::1") or str(host).startswith("127.")

    def getaddrinfo(host, *args, **kwargs):
        if not here(host):
            tried.append(str(host))
            raise OSError(f"the test refuses to look up {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    def connect(sock, address):
        if sock.family in (socket.AF_INET, socket.AF_INET6) and not here(address[0]):
            tried.append(str(address[0]))
            raise OSError(f"the test refuses to connect to {address[0]}")
        return real_connect(sock, address)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", connect)
    return tried


@pytest.fixture
def online_empty_caches(tmp_path, monkeypatch) -> None:
    """A user online (no HF_HUB_OFFLINE), without a token, whose caches hold nothing: the hub would be asked."""
    from huggingface_hub import constants

    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))  # servetune's model store: empty
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))  # the Hugging Face cache: empty


def dry_run(tmp_path: Path, model: str, *extra: str) -> int:
    space = tmp_path / "space.yaml"
    space.write_text(SPACE.format(model=model))
    return main(["run", str(space), "--dry-run", "--storage", str(tmp_path / "results"), *extra])


def test_a_hub_model_in_no_cache_is_planned_without_the_hub_saying_how_to_keep_it_here(
    tmp_path, capsys, no_ray, network, online_empty_caches
):  # fmt: skip
    assert dry_run(tmp_path, UNCACHED) == 0
    captured = capsys.readouterr()
    assert network == []
    out = " ".join(captured.out.split())
    found = SUMMARY.search(out)
    assert found and tuple(map(int, found.groups())) == (3, 0, 0), out[-3000:]  # the baseline and 2 points run
    assert out.count(f"not planned: model {UNCACHED}: its config.json is in no local cache, and a dry run asks no hub") == 3  # fmt: skip
    assert f"hub access not asked for {UNCACHED}: a dry run asks no hub" in out
    assert f"`servetune models add {UNCACHED}` keeps its config and size here" in out and "--hub fetches it now" in out
    assert "warning" not in captured.err and not (tmp_path / "results").exists()


def test_a_hub_model_in_servetunes_store_is_planned_from_it_with_no_request(
    tmp_path, capsys, no_ray, network, online_empty_caches
):  # fmt: skip
    from servetune.capacity.source import ModelConfig, store
    from servetune.models.tiny import TINY_CONFIG

    store(ModelConfig(name="acme/kept-tiny", config=TINY_CONFIG, source="servetune models add"))
    assert dry_run(tmp_path, "acme/kept-tiny") == 0
    assert network == []
    out = " ".join(capsys.readouterr().out.split())
    found = SUMMARY.search(out)
    assert found and tuple(map(int, found.groups())) == (3, 0, 0), out[-3000:]
    assert "not planned" not in out and "models add" not in out and out.count("tok/s") == 3  # sized and estimated
    assert "hub access not asked for acme/kept-tiny" in out  # the run checks it before its first trial


def test_hub_asks_the_hub_as_the_run_does(tmp_path, capsys, no_ray, network, online_empty_caches):
    assert dry_run(tmp_path, UNCACHED, "--hub") == 0
    captured = capsys.readouterr()
    assert network  # the access check and the config's fetch each tried the hub (refused by the test)
    assert f"warning: model {UNCACHED}: could not ask the hub for access" in " ".join(captured.err.split())
    out = " ".join(captured.out.split())
    assert out.count(f"not planned: model {UNCACHED}: the hub at") == 3 and "asks no hub" not in out, out[-3000:]
    assert main(["run", str(tmp_path / "space.yaml"), "--hub"]) == 2  # a run always asks: --hub is a dry run's
    assert "--hub lets a dry run ask the hub" in capsys.readouterr().err
