"""engine/server.py's pure helpers."""

import os

from servetune.shipped import absolute_pythonpath


def test_relative_pythonpath_entries_take_the_absolute_form_this_interpreter_resolved(tmp_path):
    job, other = tmp_path / "job" / "src", tmp_path / "elsewhere" / "lib"
    job.mkdir(parents=True)
    other.mkdir(parents=True)
    path = ["", str(tmp_path / "nothing" / "src"), str(job), str(other)]  # a missing folder is passed over
    value = os.pathsep.join(["src", "/abs/kept", "", "lib"])
    assert absolute_pythonpath(value, path).split(os.pathsep) == [str(job), "/abs/kept", "", str(other)]


def test_an_entry_the_interpreter_does_not_hold_is_made_absolute_where_the_child_starts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert absolute_pythonpath("vendor", ["", "/usr/lib/python3"]) == str(tmp_path / "vendor")
