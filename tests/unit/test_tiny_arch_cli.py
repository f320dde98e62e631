"""``servetune models tiny-arch NAME --out DIR``: the tiny checkpoints ``bench/arch_vllm.py`` serves, written for
``servetune plan --model DIR`` (no engine), and an unknown NAME in one line."""

from __future__ import annotations

import json

import pytest

import servetune.cli as cli
from servetune.capacity import arch_from_hf_config, plan_capacity, resolve_hardware
from servetune.models.tinyarch import TINY_ARCHS

pytest.importorskip("transformers")
pytest.importorskip("torch")

FLAGS = "avx512f,avx512_bf16"
ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 4096, "max_num_seqs": 128,
          "max_num_batched_tokens": 2048}  # fmt: skip


def test_the_checkpoint_it_writes_plans_as_its_config_does(tmp_path, capsys) -> None:
    out = tmp_path / "granite"
    assert cli.main(["models", "tiny-arch", "granite-4.0-h", "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote the tiny granite-4.0-h (GraniteMoeHybridForCausalLM) to {out}"
    files = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors"} <= files and any(name.startswith("tokenizer") for name in files)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["GraniteMoeHybridForCausalLM"]
    argv = ["plan", "--model", str(out), "--device", "cpu", "--cpu-kvcache-space-gib", "1", "--cpu-flags", FLAGS,
            "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096", "--max-num-seqs", "128",
            "--max-num-batched-tokens", "2048", "--json"]  # fmt: skip
    assert cli.main(argv) == 0
    planned = json.loads(capsys.readouterr().out)
    expected = plan_capacity(
        arch_from_hf_config(TINY_ARCHS["granite-4.0-h"], "tiny-granite-4.0-h"),
        ENGINE,
        resolve_hardware(device="cpu", cpu_flags=FLAGS.split(",")),
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
    )
    assert planned["mamba_layers"] == 6 and planned["fits"] is True
    got = (planned["kv_cache_tokens"], planned["max_concurrency"], planned["settings"]["block_size"])
    assert got == (expected.kv_cache_tokens, expected.max_concurrency, expected.settings.block_size)


def test_an_unknown_name_is_one_line_listing_the_known_ones(tmp_path, capsys) -> None:
    out = tmp_path / "llama9"
    assert cli.main(["models", "tiny-arch", "llama9", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"servetune models: error: models tiny-arch llama9: unknown architecture; known: {', '.join(TINY_ARCHS)}\n"
    )
    assert not out.exists()


def test_help_lists_the_names() -> None:
    models = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["models"]._actions
                  if hasattr(a, "choices") and isinstance(a.choices, dict))  # fmt: skip
    text = " ".join(models.choices["tiny-arch"].format_help().split())
    assert all(name in text for name in TINY_ARCHS)


def test_the_mtp_checkpoint_carries_one_mtp_layer_as_vllm_loads_it(tmp_path, capsys) -> None:
    """``qwen3-next-mtp``: the tiny Qwen3-Next plus one MTP layer under ``mtp.*`` (vLLM's ``Qwen3NextMTP`` loads
    those names and drops the rest), declared by ``num_nextn_predict_layers``, which the planner and the space's
    "MTP needs MTP heads" check read."""
    from safetensors import safe_open

    from servetune.capacity import load_model_arch
    from servetune.config.speculative import mtp_layers

    out = tmp_path / "mtp"
    assert cli.main(["models", "tiny-arch", "qwen3-next-mtp", "--out", str(out)]) == 0
    capsys.readouterr()
    config = json.loads((out / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and mtp_layers(config) == 1
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}  # noqa: SIM118
    mtp = {name: shape for name, shape in shapes.items() if name.startswith("mtp.")}
    assert mtp["mtp.fc.weight"] == (256, 512)
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"] == (512, 256)  # the gated attention's q and gate
    norms = ("mtp.norm.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight")
    assert all(mtp[name] == (256,) for name in norms)
    # every tensor of the target's full-attention layer (3), once more under mtp.layers.0
    layer = {
        name.removeprefix("model.layers.3."): s for name, s in shapes.items() if name.startswith("model.layers.3.")
    }
    assert {name.removeprefix("mtp.layers.0."): s for name, s in mtp.items() if ".layers." in name} == layer
    assert load_model_arch(str(out)).mtp_layers == 1
