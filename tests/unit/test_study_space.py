"""The files a study's workload names (LoRA adapters, empirical length files, a trace, a prompt text) are found
when verify and serve-check reload the space the study keeps, as they were when its trials ran (space_file.py
load_study_space)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from servetune.config.space import SearchSpace
from servetune.errors import UserError
from servetune.serve.study import read_picked
from servetune.space_file import load_space, load_study_space
from servetune.study.driver import prepare_study_dir, study_info
from servetune.verify.choose import select
from tests.builders import level, trial, write_study
from tests.builders import study_info as recorded_info

WORKLOAD = """\
  name: files
  input_tokens: {dist: empirical, file: data/lengths.jsonl, field: n}
  output_tokens: {dist: fixed, value: 4}
  text: data/prompts.txt
  arrival: {process: trace, file: data/log.jsonl}
  adapters:
    - {name: sql, path: adapters/sql}
"""


def inputs(root: Path, inline: bool = True) -> Path:
    """A space beside the files its workload names, each by a path relative to the space (or workload) file."""
    (root / "data").mkdir(parents=True)
    (root / "data" / "lengths.jsonl").write_text('{"n": 5}\n{"n": 9}\n')
    (root / "data" / "prompts.txt").write_text("the quick brown fox jumps over the lazy dog\n")
    (root / "data" / "log.jsonl").write_text(
        '{"timestamp": 0, "input_tokens": 3, "output_tokens": 1}\n{"timestamp": 2, "input_tokens": 3, "output_tokens": 1}\n'
    )
    (root / "adapters" / "sql").mkdir(parents=True)
    (root / "adapters" / "sql" / "adapter_config.json").write_text(json.dumps({"r": 4}))
    if inline:
        workload = "workload:\n" + WORKLOAD
    else:
        (root / "w.yaml").write_text("\n".join(line.removeprefix("  ") for line in WORKLOAD.splitlines()) + "\n")
        workload = "workload: w.yaml\n"
    space = root / "space.yaml"
    space.write_text(
        "name: demo\nmodel: tiny\ndevice: cpu\n" + workload + "load: {levels: [2, 8], requests_per_level: 16}\n"
        "slo: {ttft_ms: {p99: 2000}}\n"
    )
    return space


def study_of(space: Path, root: Path, space_file: str | None = None) -> Path:
    """A finished study of ``space`` (one trial), its space kept as ``servetune run`` keeps it."""
    info = recorded_info(device="cpu", model="tiny", space_file=space_file or str(space.resolve()))
    t = trial("t1", {"max_num_seqs": 8}, [level(2, 200, 300), level(8, 800, 600)], device="cpu")
    write_study(root, info, [t])
    prepare_study_dir(root, space, resume=True)
    return root


@pytest.mark.parametrize("inline", [True, False], ids=["inline workload", "workload file"])
def test_verify_and_serve_check_find_the_files_the_workload_names(tmp_path, inline):
    space = inputs(tmp_path / "inputs", inline)
    study = study_of(space, tmp_path / "study")
    original = load_space(space)
    expected = original.resolved_workload(space.parent).model_dump(mode="json")
    selection = select(study, "t1")
    picked = read_picked(study, "t1")
    for workload in (selection.workload, picked.workload):
        # the workload as the trials had it, so every trial id computed from it is the one the study recorded
        assert workload.model_dump(mode="json") == expected
        assert workload.source_text is not None and "quick brown fox" in workload.source_text
        assert workload.arrival.trace_times() == (0.0, 2.0)
        assert workload.adapters[0].directory(tmp_path / "unused") == (space.parent / "adapters" / "sql").resolve()
    lora = selection.winner.spec.engine_args["lora_modules"]
    assert lora == [f"sql={(space.parent / 'adapters' / 'sql').resolve()}"]


def test_the_kept_copy_alone_resolves_its_paths_against_the_study_folder(tmp_path):
    """What loading the kept copy as any space file does (what verify did before): the files are not there."""
    space = inputs(tmp_path / "inputs")
    study = study_of(space, tmp_path / "study")
    with pytest.raises(UserError, match=r"not a PEFT adapter directory|cannot read"):
        load_space(study / "space.yaml")


def test_a_study_records_where_its_space_file_is_whatever_the_working_folder(tmp_path, monkeypatch):
    space = inputs(tmp_path / "inputs")
    monkeypatch.chdir(tmp_path)
    info = study_info(load_space(Path("inputs/space.yaml")), Path("inputs/space.yaml"), "tiny")
    assert Path(info.space_file) == space.resolve()
    assert info.price_list == "default" and info.prices == {}  # what the report prices unmeasured GPU types from
    monkeypatch.chdir(space.parent.parent.parent)  # verify run from elsewhere still finds the files
    study = study_of(space, tmp_path / "study", info.space_file)
    assert load_study_space(study, info.space_file)[1].adapters[0].rank == 4


def test_a_study_that_recorded_a_relative_space_file_is_found_from_the_working_folder(tmp_path, monkeypatch):
    space = inputs(tmp_path / "inputs")
    study = study_of(space, tmp_path / "study", space_file="space.yaml")  # as studies recorded it before
    monkeypatch.chdir(space.parent)
    space_model, workload = load_study_space(study, "space.yaml")
    assert isinstance(space_model, SearchSpace) and workload.adapters[0].rank == 4


@pytest.mark.parametrize(
    ("gone", "field"),
    [("adapters/sql", "workload.adapters.0"), ("data/lengths.jsonl", "workload.input_tokens"),
     ("data/log.jsonl", "workload.arrival"), ("data/prompts.txt", "workload")],
)  # fmt: skip
def test_a_file_that_is_gone_is_one_line_naming_the_kept_space_and_the_field(tmp_path, gone, field):
    space = inputs(tmp_path / "inputs")
    study = study_of(space, tmp_path / "study")
    target = space.parent / gone
    shutil.rmtree(target) if target.is_dir() else target.unlink()
    with pytest.raises(UserError) as info:
        select(study, "t1")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{study / 'space.yaml'}: {field}")
    assert str(target) in message
