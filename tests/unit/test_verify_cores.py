"""verify.json says where the verified engine ran on the CPU build, in a trial's words (trial/runner.py
``cores_record``): the cores its ranks were bound to (``engine.cpu_binding``), or why it claimed none of its own
(``engine.cpu_unclaimed``), read from the engine verify started (a bare one's, or through Serve its replicas')."""

import contextlib
import os

import pytest

from servetune.engine.cores import LOCK_DIR_ENV
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
    run, seen = _verified(tmp_path, monkeypatch, Server(**{"cpu_binding": None, "cpu_unclaimed": None, **cores}))
    assert seen and {k: v for k, v in run.cores.items() if not k.startswith("client_")} == cores
    selection = select(copy_recorded_study(tmp_path / "again"), "best")
    doc = document(selection, Budget.for_device("cpu"), Timeouts(1, 1, 1), run, {}, [])
    engine = {key: doc["engine"][key] for key in ("cpu_binding", "cpu_unclaimed") if key in doc["engine"]}
    assert engine == cores


def test_a_run_that_never_started_says_nothing_of_cores(tmp_path):
    selection = select(copy_recorded_study(tmp_path / "study"), "best")
    doc = document(selection, Budget.for_device("cpu"), Timeouts(1, 1, 1), EngineRun("t", tmp_path / "e.log"), {}, [])
    assert not {"cpu_binding", "cpu_unclaimed"} & set(doc["engine"])


CLIENT = {"client_unpinned": "a GPU engine: its ranks are bound to no cores"}


@pytest.mark.parametrize(
    ("server", "said"),
    [
        (Server(cpu_ranks=None, cpu_binding=None, cpu_unclaimed=None), CLIENT),
        (Server(cpu_ranks=1, cpu_binding=None, cpu_unclaimed="no 1 of the 2 cores free: ...; vLLM binds it itself"),
         {"client_unpinned": "the engine is not bound to known cores (no CPU binding)"}),
    ],
)  # fmt: skip
def test_verify_leaves_its_client_where_it_is_beside_an_engine_on_no_known_core_and_says_why(tmp_path, monkeypatch,
                                                                                             server, said):  # fmt: skip
    before = os.sched_getaffinity(0)
    run, seen = _verified(tmp_path, monkeypatch, server)
    assert seen == before and {k: v for k, v in run.cores.items() if k.startswith("client_")} == said
    doc = document(select(copy_recorded_study(tmp_path / "again"), "best"), Budget.for_device("cpu"),
                   Timeouts(1, 1, 1), run, {}, [])  # fmt: skip
    assert {k: v for k, v in doc["engine"].items() if k.startswith("client_")} == said


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="a core apart from the engine's needs two")
def test_verify_measures_from_the_cores_its_cpu_engine_is_not_bound_to_and_lets_them_go_after(tmp_path, monkeypatch):
    monkeypatch.setenv(LOCK_DIR_ENV, str(tmp_path / "locks"))  # the host's other engines' locks are not this test's
    before = os.sched_getaffinity(0)
    engine = min(before)
    run, seen = _verified(tmp_path, monkeypatch, Server(cpu_ranks=1, cpu_binding=str(engine), cpu_unclaimed=None))
    assert seen == before - {engine} and run.cores["client_cores"] == ",".join(map(str, sorted(seen)))
    assert os.sched_getaffinity(0) == before


def _verified(tmp_path, monkeypatch, server):
    """verify's engine run against ``server``, and the cores its body measured from."""
    selection = select(copy_recorded_study(tmp_path / "study"), "best")

    @contextlib.contextmanager
    def started(*args, **kwargs):
        yield server

    monkeypatch.setattr(verification, "started", started)
    monkeypatch.setattr(verification, "served_len", lambda server, chosen: 1024)

    async def body(target):
        return os.sched_getaffinity(0)

    run, seen, _ = verification.with_engine(selection.winner, tmp_path / "verify" / "engine.log", Timeouts(1, 1, 1),
                                            None, Budget.for_device("cpu"), Said(), body)  # type: ignore[arg-type]  # fmt: skip
    return run, seen
