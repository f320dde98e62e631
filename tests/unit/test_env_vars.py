"""env_defaults: a default for an environment variable for a block, never over the user's value, gone afterwards
(local_ray's wait for Ray's GCS port and tracking/'s MLflow settings use it)."""

from __future__ import annotations

import os

import pytest

from servetune.env_vars import env_defaults

SET = "SERVETUNE_TEST_ENV_DEFAULT_SET"
USERS = "SERVETUNE_TEST_ENV_DEFAULT_USERS"


@pytest.fixture
def environ(monkeypatch):
    monkeypatch.delenv(SET, raising=False)
    monkeypatch.setenv(USERS, "the user's")


def test_a_default_is_set_for_the_block_and_the_users_value_stands(environ):
    with env_defaults({SET: "120", USERS: "ours"}):
        assert (os.environ[SET], os.environ[USERS]) == ("120", "the user's")
    assert SET not in os.environ and os.environ[USERS] == "the user's"


def test_what_it_set_is_removed_when_the_block_raises(environ):
    with pytest.raises(RuntimeError, match="inside"), env_defaults({SET: "120", USERS: "ours"}):
        assert os.environ[SET] == "120"
        raise RuntimeError("inside")
    assert SET not in os.environ and os.environ[USERS] == "the user's"
