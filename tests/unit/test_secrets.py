"""What is masked: secret environment values and credential engine arguments, never configuration."""

from __future__ import annotations

import dataclasses

import pytest

from servetune.engine.args import load_argspecs
from servetune.secrets import MASK, SECRET_ENGINE_ARGS, is_secret_env, redact_engine_args, redact_env, redact_params


@pytest.mark.parametrize(
    "name",
    ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "WANDB_API_KEY", "OPENAI_API_KEY", "AWS_SECRET_ACCESS_KEY",
     "AWS_ACCESS_KEY_ID", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "AZURE_CLIENT_SECRET",
     "GOOGLE_APPLICATION_CREDENTIALS", "my_secret", "DB_PASSWD", "SSH_PRIVATE_KEY", "RAY_AUTH_TOKEN"],
)  # fmt: skip
def test_environment_names_that_denote_a_secret_are_masked(name: str):
    assert is_secret_env(name)
    assert redact_env({name: "s3cr3t"}) == {name: MASK}


@pytest.mark.parametrize(
    "name",
    ["VLLM_CPU_KVCACHE_SPACE", "MAX_NUM_BATCHED_TOKENS", "VLLM_ATTENTION_BACKEND", "CUDA_VISIBLE_DEVICES",
     "VLLM_CPU_OMP_THREADS_BIND", "TOKENIZERS_PARALLELISM", "HF_HUB_OFFLINE", "KEYBOARD_LAYOUT"],
)  # fmt: skip
def test_configuration_in_the_environment_stays_readable(name: str):
    assert not is_secret_env(name)
    assert redact_env({name: "1"}) == {name: "1"}


def test_every_engine_argument_of_vllm_is_shown_except_the_credentials():
    """Every option of vLLM's own server parser, and every EngineArgs field, goes through unmasked."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    names = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
    specs = load_argspecs()
    assert specs is not None, "vLLM's argument parser could not be read"
    names |= set(specs)
    assert {"max_num_batched_tokens", "max_num_seqs", "max_model_len", "api_key", "hf_token"} <= names
    for value in (4096, "some-text"):
        shown = redact_engine_args(dict.fromkeys(names, value))
        assert {k for k, v in shown.items() if v == MASK} == set(SECRET_ENGINE_ARGS)
        assert all(v == value for k, v in shown.items() if k not in SECRET_ENGINE_ARGS)


def test_hf_token_true_means_the_stored_token_and_is_not_a_secret():
    assert redact_engine_args({"hf_token": True, "api_key": None}) == {"hf_token": True, "api_key": None}
    assert redact_engine_args({"hf_token": "hf_abc", "api-key": "sk"}) == {"hf_token": MASK, "api-key": MASK}


def test_params_follow_the_environment_rule_under_env_and_the_engine_rule_elsewhere():
    params = {"max_num_batched_tokens": 4096, "env.HF_TOKEN": "hf_x", "env.VLLM_CPU_KVCACHE_SPACE": 2, "api_key": "k"}
    assert redact_params(params) == {
        "max_num_batched_tokens": 4096, "env.HF_TOKEN": MASK, "env.VLLM_CPU_KVCACHE_SPACE": 2, "api_key": MASK,
    }  # fmt: skip
