"""``servetune plan`` and ``models add`` on a model only the hub knows, through huggingface_hub itself pointed at a
hub on 127.0.0.1 (``HF_ENDPOINT``): config.json downloaded, safetensors headers read by range, a gated repository
refused without ``HF_TOKEN``, offline planning from the caches (capacity/source.py)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from tests.conftest import serve_fake

COMMIT = "0123456789abcdef0123456789abcdef01234567"
TOKEN = "hf_secret_for_the_test"
CONFIG = {  # a Llama-3.2-1B-shaped model no catalogue knows
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
# The checkpoint holds more than the decoder (a 0.4B-parameter vision tower): the ledger must count what is stored.
TENSORS = {
    "model.embed_tokens.weight": ("BF16", [128256, 2048]),
    "model.layers.weight": ("BF16", [16, 60_821_504]),
    "vision_tower.weight": ("F32", [400_000_000]),
}


def safetensors_header() -> bytes:
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in TENSORS.items():
        count = 1
        for dim in shape:
            count *= dim
        size = count * (4 if dtype == "F32" else 2)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw


class FakeHub:
    """The hub's ``resolve`` route: ``org/gated`` needs the test's token; files are config.json and a
    model.safetensors whose first bytes are a real header (the weights after it are never asked for)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, str]] = []  # method, path, Authorization, Range
        self.files = {"config.json": json.dumps(CONFIG).encode(), "model.safetensors": safetensors_header()}

    def app(self) -> web.Application:
        async def resolve(request: web.Request) -> web.Response:
            info = request.match_info
            repo, filename = f"{info['org']}/{info['name']}", info["filename"]
            auth = request.headers.get("Authorization", "")
            self.seen.append((request.method, request.path, auth, request.headers.get("Range", "")))
            if repo == "org/gated" and auth != f"Bearer {TOKEN}":
                return web.Response(status=401, headers={"X-Error-Code": "GatedRepo", "X-Error-Message": "gated"})
            if filename not in self.files:
                return web.Response(status=404, headers={"X-Error-Code": "EntryNotFound"})
            body = self.files[filename]
            headers = {"X-Repo-Commit": COMMIT, "ETag": f'"{filename}-etag"'}
            return web.Response(body=body, headers=headers, content_type="application/octet-stream")

        app = web.Application()
        app.router.add_get("/{org}/{name}/resolve/{revision}/{filename}", resolve)
        return app


def servetune(tmp_path: Path, endpoint: str, *argv: str, token: str = "", offline: bool = False):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE")}
    env.update(HF_ENDPOINT=endpoint, HF_HOME=str(tmp_path / "hf-home"))  # no stored token either
    if token:
        env["HF_TOKEN"] = token
    if offline:
        env["HF_HUB_OFFLINE"] = "1"
    return subprocess.run([sys.executable, "-m", "servetune", *argv], capture_output=True, text=True, timeout=120,
                          env=env)  # fmt: skip


def plan(tmp_path: Path, endpoint: str, model: str, **kw) -> subprocess.CompletedProcess:
    return servetune(tmp_path, endpoint, "plan", "--model", model, "--gpu", "H100-SXM", "--json", **kw)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = [ln for ln in done.stderr.splitlines() if ln.strip()]
    return line


def stored_gib() -> float:
    """The checkpoint's bytes served in bfloat16 (the float32 tower cast on load), from TENSORS."""
    total = 0
    for _, shape in TENSORS.values():
        count = 1
        for dim in shape:
            count *= dim
        total += count * 2
    return total / 2**30


@pytest.fixture
def hub():
    fake = FakeHub()
    with serve_fake(fake) as endpoint:
        yield fake, endpoint


def test_a_public_hub_model_plans_from_its_config_and_safetensors_headers(tmp_path, hub) -> None:
    fake, endpoint = hub
    done = plan(tmp_path, endpoint, "org/open")
    assert done.returncode == 0, done.stderr[-2000:]
    ledger = json.loads(done.stdout)
    assert ledger["model"] == "org/open" and ledger["fits"]
    # The stored bytes, not the formula's 1.24B parameters: the vision tower is counted (the rope cache is 16 MiB).
    assert ledger["weights_gib"] == pytest.approx(stored_gib(), abs=0.02)
    assert ledger["weights_gib"] > ledger["parameters_b"] * 2e9 / 2**30 + 0.5
    ranges = [rng for method, path, _, rng in fake.seen if path.endswith("model.safetensors") and method == "GET"]
    assert ranges and all(rng.startswith("bytes=0-") for rng in ranges)  # headers only, by range
    # Offline later: the same plan from the store, without a request.
    asked = len(fake.seen)
    again = plan(tmp_path, endpoint, "org/open", offline=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout)["weights_gib"] == ledger["weights_gib"] and len(fake.seen) == asked
    # Only the Hugging Face cache's config.json left: still plans offline, weights from the formula.
    (tmp_path / "hf-home" / "servetune" / "models" / "org--open.json").unlink()
    cached = plan(tmp_path, endpoint, "org/open", offline=True)
    assert cached.returncode == 0, cached.stderr[-2000:]
    assert json.loads(cached.stdout)["weights_gib"] < ledger["weights_gib"] - 0.5


def test_a_gated_model_needs_hf_token_and_plans_with_it(tmp_path, hub) -> None:
    fake, endpoint = hub
    line = one_line(plan(tmp_path, endpoint, "org/gated"))
    assert "model org/gated: gated on the hub" in line and "HF_TOKEN" in line
    done = plan(tmp_path, endpoint, "org/gated", token=TOKEN)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["model"] == "org/gated"
    assert ("GET", "/org/gated/resolve/main/config.json", f"Bearer {TOKEN}", "") in fake.seen
    assert TOKEN not in done.stdout + done.stderr


def test_offline_with_nothing_cached_says_how_to_give_the_model_in_one_line(tmp_path, hub) -> None:
    fake, endpoint = hub
    line = one_line(plan(tmp_path, endpoint, "org/open", offline=True))
    assert "model org/open: offline (HF_HUB_OFFLINE)" in line and "--model /path/to/model" in line
    assert fake.seen == []


def test_models_add_keeps_a_model_for_offline_planning(tmp_path, hub) -> None:
    fake, endpoint = hub
    added = servetune(tmp_path, endpoint, "models", "add", "org/open")
    assert added.returncode == 0, added.stderr[-2000:]
    assert "kept org/open (LlamaForCausalLM" in added.stdout
    record = json.loads((tmp_path / "hf-home" / "servetune" / "models" / "org--open.json").read_text())
    assert record["config"] == CONFIG and set(record["parameters"]) == {"BF16", "F32"}
    asked = len(fake.seen)
    done = plan(tmp_path, endpoint, "org/open", offline=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["weights_gib"] == pytest.approx(stored_gib(), abs=0.02)
    assert len(fake.seen) == asked
    assert "--model /path/to/model" in one_line(
        servetune(tmp_path, endpoint, "models", "add", "org/open", offline=True)
    )


def test_init_writes_a_space_for_a_model_only_the_hub_knows(tmp_path, hub) -> None:
    _, endpoint = hub
    out = tmp_path / "space.yaml"
    args = ("init", "--model", "org/open", "--gpu", "H100-SXM", "--gpus", "8", "--scenario", "chat", "--out", str(out))
    done = servetune(tmp_path, endpoint, *args)
    assert done.returncode == 0, done.stderr[-2000:]
    assert 'model: "org/open"' in out.read_text() and "tensor_parallel_size: [1, 2]" in out.read_text()


def test_an_unreachable_hub_with_nothing_cached_is_one_line(tmp_path) -> None:
    from servetune.engine.server import free_port

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    line = one_line(plan(tmp_path, endpoint, "org/open"))
    assert f"the hub at {endpoint} cannot be reached" in line and "servetune models add org/open" in line
