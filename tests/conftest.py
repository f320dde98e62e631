from __future__ import annotations

import atexit
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from servetune.engine.cores import LOCK_DIR_ENV
from servetune.models.tiny import build_tiny_model
from servetune.testing.fake_openai import FakeOpenAI, serve_in_thread, write_fake_python
from tests import ray_token_guard
from tests.tiers import Tiers


def _terminated(signum: int, frame: object) -> None:
    pytest.exit(f"stopped by signal {signum}", returncode=128 + signum)


def _stop_on_sigterm() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


_verdict: list[int] = []


def _exit_with_the_verdict() -> None:
    """The session's exit status, without the interpreter's teardown that follows the last ``atexit`` handler.

    Tests start and shut down Ray in this process (``local_ray``, the CLI called in-process), and Ray leaves
    native threads running after ``ray.shutdown`` (its GCS client's io thread, gRPC's pollers and timers;
    ``ray.init``/``ray.shutdown`` on Ray 2.60 leaves seven, a ``GcsClient`` that failed to connect as many).
    Tearing the interpreter and the libraries' C++ statics down under them crashed one full run here
    (SIGSEGV after "1076 passed", so ``make test`` failed with every test passed; Ray documents the hazard
    of restarting it in one process with threads still using it, ray-project/ray#31145). Registered first,
    this handler runs after every other ``atexit`` handler (pytest's, Ray's, MLflow's) and ends the process
    with pytest's own status; a crash before it still prints its stacks (the Makefile runs pytest with
    ``-X faulthandler``)."""
    if _verdict:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_verdict[-1])


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM (CI's timeout, a user's kill) stops the session: the running test's ``finally`` blocks and every
    fixture teardown run, so the Ray clusters, engines and drivers it started are stopped by process group, not
    left behind (Python's default for SIGTERM exits at once, running none of them). ``pytest.exit`` rather than
    KeyboardInterrupt, which servetune's CLI catches when a test calls it in-process. A session that leaves
    ``~/.ray/auth_token`` behind fails (tests/ray_token_guard.py)."""
    _stop_on_sigterm()
    atexit.register(_exit_with_the_verdict)
    config.pluginmanager.register(Tiers(), "servetune-tiers")
    ray_token_guard.register(config)  # in the controller (or the only process): it spans every worker's tests
    _cores_of_this_worker()
    # MLflow's import starts a thread that asks config.mlflow-telemetry.io for its telemetry settings, unless it sees
    # a CI or a running test (none yet while pytest collects): the tests ask no host outside this one
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")


def _cores_of_this_worker() -> None:
    """Under ``make test`` (TEST_PROCESSES, 3 by default) each test process keeps its own core locks (engine/cores.py):
    a test checks that its engines got cores of their own, and another process's engines held the host-wide locks
    (one such run had two one-replica Serve trials on core 0). The processes' engines may then share cores,
    as two users' would; a test's own engines still never do."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        directory = Path(tempfile.gettempdir()) / f"servetune-cpu-cores-{os.getppid()}-{worker}"
        os.environ.setdefault(LOCK_DIR_ENV, str(directory))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session) -> None:
    """The status pytest exits with, for :func:`_exit_with_the_verdict`, after every other plugin's say on it
    (unset where the session never started, so an import or usage error exits as pytest would)."""
    _verdict.append(int(session.exitstatus))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Again before each test: an in-process ``ray.init`` replaces the handler with Ray's own."""
    _stop_on_sigterm()


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny")


@pytest.fixture
def no_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Fail at once, instead of starting a cluster, if a command called in-process (``servetune.cli.main``: a dry
    run, a refusal before any trial) gets as far as Ray; and leave Ray as the test found it."""
    import ray

    import servetune.study.tuner as tuner

    def refuse(address: str | None = None) -> None:
        raise AssertionError("servetune run got as far as starting Ray")

    monkeypatch.setattr(tuner, "init_ray", refuse)
    initialized_before = ray.is_initialized()  # by another test of this session, if any
    yield
    assert initialized_before or not ray.is_initialized()


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub in its offline mode (``HF_HUB_OFFLINE``'s constant, read at its import): every request it
    would send to the hub fails at once, as an unreachable hub's does, and none leaves this host. A test of a
    command on a hub id the test made up (``org/tiny-chat``) goes the way it goes here without a hub, on a host
    with one too. The variable itself stays unset: servetune's own offline checks (hub.py ``offline``) see none."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)


@pytest.fixture(scope="session")
def fake_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fake engine's interpreter (``write_fake_python``), one path for the whole session.

    The fake hands ``-c`` look-ups to the real interpreter, so it reads the vLLM argument table that
    the real one cached (``engine.args.load_argspecs`` keeps one per vLLM version). Tests run one at
    a time and each checks that none of its engines outlived it, so processes that name this path
    are the running test's.
    """
    return write_fake_python(tmp_path_factory.mktemp("fake-engine"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model: Path):
    """The tiny model's tokenizer as servetune loads it (tests/unit/test_tokenizer.py checks that it
    agrees with transformers' AutoTokenizer)."""
    from servetune.load.tokenizer import load_tokenizer

    return load_tokenizer(str(tiny_model))


serve_fake = serve_in_thread  # the name the tests import


@pytest.fixture
def fake_server() -> Iterator[tuple[FakeOpenAI, str]]:
    fake = FakeOpenAI(ttft_ms=40.0, itl_ms=10.0)
    with serve_fake(fake) as url:
        yield fake, url
