"""Bare engines' core claims (engine/cores.py): a physical core each before any SMT sibling, the kernel's CPU lists read."""

from pathlib import Path

from servetune.engine import cores
from servetune.engine.cores import binding, claim, id_list, physical_first


def topology(root: Path, siblings: dict[int, str]) -> Path:
    for cpu, text in siblings.items():
        (root / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (root / f"cpu{cpu}" / "topology" / "thread_siblings_list").write_text(text + "\n")
    return root


def test_the_kernels_cpu_lists_are_read():
    assert id_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11] and id_list("5") == [5]


def test_one_thread_of_every_physical_core_comes_before_any_sibling(tmp_path):
    paired = topology(tmp_path / "paired", {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"})  # siblings numbered side by side
    assert physical_first([3, 2, 1, 0], paired) == [0, 2, 1, 3]
    split = topology(tmp_path / "split", {0: "0,4", 1: "1,5", 4: "0,4", 5: "1,5"})  # siblings a half apart
    assert physical_first([5, 4, 1, 0], split) == [0, 1, 4, 5]
    assert physical_first([1, 0, 7], tmp_path / "none") == [0, 1, 7]  # the kernel does not say: CPU order


def test_two_ranks_claim_two_physical_cores_and_share_one_only_when_no_whole_core_is_free(tmp_path, monkeypatch):
    monkeypatch.setattr(cores, "SYSFS_CPU", topology(tmp_path / "sys", {0: "0-1", 1: "0-1", 2: "2-3", 3: "2-3"}))
    (tmp_path / "locks").mkdir()
    two, held = claim(2, [0, 1, 2, 3], tmp_path / "locks")
    assert two == [0, 2] and binding(2, two, [0, 1, 2, 3]) == "0|2"
    siblings, more = claim(2, [0, 1, 2, 3], tmp_path / "locks")
    assert siblings == [1, 3]
    assert binding(2, [], [0, 1, 2, 3]) == "0|2" and binding(1, [], [0, 1, 2, 3]) is None  # nothing claimed
    for handle in held + more:
        handle.close()


def test_a_lock_directory_that_cannot_be_used_leaves_the_binding_as_without_free_cores(monkeypatch):
    def unusable():
        raise PermissionError("/tmp/servetune-cpu-cores: another user's")

    monkeypatch.setattr(cores, "lock_dir", unusable)
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0, 1})
    one, two = cores.claim_now(1), cores.claim_now(2)
    assert (one.binding, one.held, two.binding, two.held) == (None, [], "0|1", [])
    assert one.unclaimed == two.unclaimed == "core locks unusable (/tmp/servetune-cpu-cores: another user's)"


def test_an_engine_that_cannot_be_launched_lets_its_cores_go(tmp_path, monkeypatch):
    import pytest

    from servetune.engine.server import VllmServer

    monkeypatch.setattr(cores, "lock_dir", lambda: tmp_path)
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.delenv(cores.BIND, raising=False)
    server = VllmServer("m", {}, {}, log_path=tmp_path / "engine.log", cpu_ranks=1)
    monkeypatch.setattr(server, "launch_argv", lambda: [str(tmp_path / "no-such-interpreter")])
    with pytest.raises(FileNotFoundError):
        server.start()
    assert claim(1, [0], tmp_path)[0] == [0]  # the failed launch held core 0 no longer


def test_a_process_with_a_lock_directory_of_its_own_claims_apart_from_the_host_s(tmp_path, monkeypatch):
    host, own = tmp_path / "host", tmp_path / "own" / "worker"
    host.mkdir()
    monkeypatch.setattr(cores.tempfile, "gettempdir", lambda: str(host))
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.delenv(cores.LOCK_DIR_ENV, raising=False)
    held_by_the_host = cores.claim_now(1).held  # another process holds the host's only core
    assert held_by_the_host
    assert cores.claim_now(1)[1] == []
    monkeypatch.setenv(cores.LOCK_DIR_ENV, str(own))
    binding, held, _ = cores.claim_now(1)
    assert (binding, len(held)) == ("0", 1)
    assert (own / "core-0.lock").exists()
    for handle in held_by_the_host + held:
        handle.close()


def test_an_engine_that_finds_no_free_core_says_why_and_its_trial_records_it(tmp_path, monkeypatch):
    """On a shared host other engines may hold every core: the engine starts unbound (vLLM binds it) and the trial
    records why beside where a binding would be, so a reader can tell it from an engine servetune failed to bind."""
    import sys

    from servetune.engine.server import VllmServer
    from servetune.trial.runner import cores_record

    monkeypatch.setattr(cores, "lock_dir", lambda: tmp_path)
    monkeypatch.setattr(cores.os, "sched_getaffinity", lambda pid: {0})
    monkeypatch.delenv(cores.BIND, raising=False)

    def started() -> VllmServer:
        server = VllmServer("m", {}, {}, log_path=tmp_path / "engine.log", cpu_ranks=1)
        monkeypatch.setattr(server, "launch_argv", lambda: [sys.executable, "-c", "pass"])
        server.start()
        return server

    first = started()  # core 0 free: claimed and bound, nothing to explain
    assert cores_record(first) == {"cpu_binding": "0"} and first.cpu_unclaimed is None
    crowded = started()  # core 0 held by the first engine
    record = cores_record(crowded)
    assert "cpu_binding" not in record and cores.BIND not in crowded.env
    assert record["cpu_unclaimed"].startswith("no 1 of the 1 cores free") and str(tmp_path) in record["cpu_unclaimed"]
    assert record["cpu_unclaimed"].endswith("vLLM binds it itself")
    two = cores.claim_now(2)  # several ranks without a claim share the first cores, as export binds them
    assert (two.binding, two.held) == ("0", []) and two.unclaimed.endswith("bound to shared cores 0")
    first.stop()
    crowded.stop()
    again = started()  # the first engine let core 0 go
    assert cores_record(again) == {"cpu_binding": "0"}
    again.stop()
