"""verify.json says where the verified engine ran on the CPU build, in a trial's words (trial/runner.py
``cores_record``): the cores its ranks were bound to (``engine.cpu_binding``), or why it claimed none of its own
(``engine.cpu_unclaimed``), read from the engine verify started (a bare one's, or through Serve its replicas')."""

import contextlib

import pytest

from servetune.verify import run as verification
from servetune.verify.choose import select
from servetune.verify.document import EngineRun, Timeouts, document
from servetune.verify.scenarios import Budget
from tests.builders import copy_recorded_study


class Server:
    """The engine verify started, as far as starting and stopping it go: where its cores are and why."""

    url = "http://127.0.0.1:1"
    startup_s = 1.0
    process = None

    def __init__(self, **cores):
        self.__dict__.update(cores)

    def alive(self):
        return True


class Said:
    def step(self, text, seconds=None):
        pass

    def scenario(self, name, passed, reason):
        pass


@pytest.mark.parametrize(
    "cores",
    [
        {"cpu_binding": "0"},  # a core of its own
        {"cpu_unclaimed": "no 1 of the 2 cores free: other engines hold their locks in /tmp/x; vLLM binds it itself"},
        {"cpu_binding": "0|1", "cpu_unclaimed": "no 2 of the 2 cores free: ...; bound to shared cores 0|1"},
        {},  # GPUs: nothing to say
    ],
)
def test_the_verified_engines_cores_or_why_it_had_none_reach_verify_json(tmp_path, monkeypatch, cores):
    selection = select(copy_recorded_study(tmp_path / "study"), "best")
    server = Server(**{"cpu_binding": None, "cpu_unclaimed": None, **cores})

    @contextlib.contextmanager
    def started(*args, **kwargs):
        yield server

    monkeypatch.setattr(verification, "started", started)
    monkeypatch.setattr(verification, "served_len", lambda server, chosen: 1024)

    async def body(target):
        return "measured"

    log = tmp_path / "verify" / "engine.log"
    run, value, _ = verification.with_engine(selection.winner, log, Timeouts(1, 1, 1), None, Budget.for_device("cpu"),  # type: ignore[arg-type]
                                             Said(), body)  # fmt: skip
    assert value == "measured" and run.cores == cores
    doc = document(selection, Budget.for_device("cpu"), Timeouts(1, 1, 1), run, {}, [])
    engine = {key: doc["engine"][key] for key in ("cpu_binding", "cpu_unclaimed") if key in doc["engine"]}
    assert engine == cores


def test_a_run_that_never_started_says_nothing_of_cores(tmp_path):
    selection = select(copy_recorded_study(tmp_path / "study"), "best")
    doc = document(selection, Budget.for_device("cpu"), Timeouts(1, 1, 1), EngineRun("t", tmp_path / "e.log"), {}, [])
    assert not {"cpu_binding", "cpu_unclaimed"} & set(doc["engine"])
