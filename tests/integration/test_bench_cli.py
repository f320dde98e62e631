"""``servetune bench`` as a user runs it, against the fake server (``--url``) and on bad input."""

import json
import os
import shutil
from pathlib import Path

import pytest

from servetune.cli import main
from servetune.engine.cores import BIND, LOCK_DIR_ENV, claim, physical_first
from servetune.results import BenchResult
from servetune.testing.process import fake_server_process
from tests.processes import processes_mentioning


def run_cli(capsys, *argv):
    code = main(["bench", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_bench_against_a_running_server(tmp_path, capsys, tiny_model):
    out_file = tmp_path / "res" / "bench.json"
    with fake_server_process("--ttft-ms", "30", "--itl-ms", "5", "--model", "fake-7b") as url:
        code, out, err = run_cli(
            capsys, "--url", url, "--tokenizer", str(tiny_model), "--workload", "cpu-tiny",
            "--concurrency", "1,4", "--num-requests", "8", "--warmup-requests", "2",
            "--slo", "ttft_ms.p99=25,tpot_ms.p95=40", "--json", str(out_file),
        )  # fmt: skip
    assert code == 0, err
    result = BenchResult.model_validate_json(out_file.read_text())
    assert result.served_model_name == "fake-7b" and result.url == url
    assert [lv.summary.level for lv in result.levels] == [{"concurrency": 1.0}, {"concurrency": 4.0}]
    for level in result.levels:
        assert level.summary.completed == 8 and level.summary.warmup_excluded == 2
        assert not level.meets_slo and level.slo_violations[0].startswith("ttft_ms_p99")  # 30 ms > 25 ms
        assert level.server_metrics["generation_tokens"] == 10 * 32
    lines = (tmp_path / "res" / "bench.requests.jsonl").read_text().splitlines()
    assert len(lines) == 20 and json.loads(lines[0])["warmup"] is True
    assert "broken" in out


def test_bench_splits_each_level_across_client_processes(tmp_path, capsys, tiny_model, monkeypatch):
    import servetune.trial.measure as measure

    splits = []

    async def run_sharded(settings, specs, level, processes, **kwargs):
        splits.append((level.value, processes))
        return await real(settings, specs, level, processes, **kwargs)

    real = measure.run_sharded
    monkeypatch.setattr(measure, "run_sharded", run_sharded)
    out_file = tmp_path / "bench.json"
    with fake_server_process("--ttft-ms", "10", "--itl-ms", "2") as url:
        code, _, err = run_cli(
            capsys, "--url", url, "--tokenizer", str(tiny_model), "--workload", "cpu-tiny", "--concurrency", "4",
            "--num-requests", "12", "--warmup-requests", "2", "--client-processes", "2", "--json", str(out_file),
        )  # fmt: skip
    assert code == 0, err
    assert splits == [(4.0, 2)]
    result = BenchResult.model_validate_json(out_file.read_text())
    (level,) = result.levels
    assert result.client_processes == 2 and level.summary.completed == 12 and level.summary.warmup_excluded == 2
    rows = [json.loads(line) for line in (tmp_path / "bench.requests.jsonl").read_text().splitlines()]
    assert len(rows) == 14 and sum(r["warmup"] for r in rows) == 2


def bench_repeats(tmp_path, capsys, tiny_model, ttft_ms: str, slo: str):
    """One level at 2 in flight, three runs asked, against the fake server: the level and its records."""
    out_file = tmp_path / "bench.json"
    with fake_server_process("--ttft-ms", ttft_ms, "--itl-ms", "2") as url:
        code, _, err = run_cli(
            capsys, "--url", url, "--tokenizer", str(tiny_model), "--workload", "cpu-tiny", "--concurrency", "2",
            "--num-requests", "6", "--warmup-requests", "1", "--repeats", "3", "--slo", slo, "--json", str(out_file),
        )  # fmt: skip
    assert code == 0, err
    (level,) = BenchResult.model_validate_json(out_file.read_text()).levels
    rows = [json.loads(line) for line in (tmp_path / "bench.requests.jsonl").read_text().splitlines()]
    return level, rows


def test_bench_repeats_each_level_and_reports_its_median_run(tmp_path, capsys, tiny_model):
    level, rows = bench_repeats(tmp_path, capsys, tiny_model, ttft_ms="30", slo="ttft_ms.p99=25")
    # 30 ms > 25 ms in the first two runs: the majority broke the SLO, so no third run.
    assert len(level.runs) == 2 and not level.meets_slo
    assert level.summary in [run.summary for run in level.runs]
    assert [sum(r["repeat"] == k for r in rows) for k in range(3)] == [7, 7, 0]
    # Each run draws its own prompts.
    assert {r["input_tokens"] for r in rows if r["repeat"] == 0} != {
        r["input_tokens"] for r in rows if r["repeat"] == 1
    }


def test_bench_repeats_a_level_that_meets_the_slo_three_times(tmp_path, capsys, tiny_model):
    level, rows = bench_repeats(tmp_path, capsys, tiny_model, ttft_ms="5", slo="ttft_ms.p99=500")
    assert len(level.runs) == 3 and level.meets_slo and len(rows) == 3 * 7
    assert level.measured_s == pytest.approx(sum(run.summary.duration_s for run in level.runs))


def test_an_engine_that_dies_mid_level_keeps_what_was_measured(tmp_path, capsys, tiny_model, fake_python):
    # The fake engine dies 4.5 s after it started serving: after the level at 8 in flight (two waves of
    # about 0.64 s, done about 2 s after it started), during the one at 1 (nine requests of about 0.64 s
    # each, until about 8 s): some 2.5 s of room on either side for a loaded host.
    out_file = tmp_path / "b.json"
    code, _, err = run_cli(
        capsys, "--model", str(tiny_model), "--python", str(fake_python), "--workload", "cpu-tiny",
        "--env", "SERVETUNE_FAKE_CRASH_AFTER_S=4.5", "--env", "SERVETUNE_FAKE_ITL_MS=20",
        "--concurrency", "8,1", "--num-requests", "8", "--json", str(out_file),
    )  # fmt: skip
    assert code == 3
    assert "servetune bench: error: the engine died during concurrency 1" in err and "engine log (last lines)" in err, (
        err
    )
    result = BenchResult.model_validate_json(out_file.read_text())
    finished, died_in = result.levels
    assert finished.summary.completed == 8 and finished.summary.failed == 0
    assert died_in.summary.failed > 0 and died_in.summary.completed < 8, died_in.summary
    rows = [json.loads(line) for line in (tmp_path / "b.requests.jsonl").read_text().splitlines()]
    assert len(rows) == 8 + 8 + 1 + 8  # warm-up included
    assert processes_mentioning(fake_python) == []


def test_an_engine_that_fails_to_start_is_one_error_with_its_log_tail_and_writes_nothing(
    tmp_path, capsys, tiny_model, fake_python
):
    # On real vLLM the study's end-to-end test has an engine fail at start-up (a block size vLLM refuses).
    code, _, err = run_cli(
        capsys, "--model", str(tiny_model), "--python", str(fake_python), "--workload", "cpu-tiny",
        "--env", "SERVETUNE_FAKE_FAIL_STARTUP=1", "--concurrency", "1", "--json", str(tmp_path / "b.json"),
    )  # fmt: skip
    assert code == 3
    first = err.strip().splitlines()[0]
    assert first.startswith("servetune bench: error: vLLM exited with code 1"), err
    assert "engine log (last lines)" in err and "injected startup failure" in err, err
    assert not (tmp_path / "b.json").exists() and not (tmp_path / "b.requests.jsonl").exists()
    assert processes_mentioning(fake_python) == []


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--model", "/nonexistent/model"], "--model /nonexistent/model: no such directory"),
        (["--model", "{tmp}"], "has no config.json"),
        (["--url", "http://127.0.0.1:9", "--model", "x"], "--url http://127.0.0.1:9: cannot reach the server"),
        (["--model", "{tmp}", "--concurrency", "1,x"], "--concurrency '1,x' is not a comma-separated list"),
        (["--model", "{tmp}", "--slo", "ttft.p99=1"], "--slo: unknown metric 'ttft'"),
        (
            ["--model", "{tmp}", "--workload", "{tmp}/w.yaml"],
            "w.yaml: output_tokens.value: Input should be greater than or equal to 1",
        ),
        (["--model", "{tmp}", "--env", "NOEQUALS"], "--env 'NOEQUALS' is not KEY=VALUE"),
        (["--model", "{tmp}", "--repeats", "0"], "--repeats must be 1 to 9, got 0"),
        (
            ["--model", "{tmp}", "--workload", "cpu-tiny", "--speedup", "2"],
            "--speedup is for a workload that replays a trace",
        ),
        (
            ["--model", "{tmp}", "--workload", "{tmp}/trace.yaml", "--speedup", "0"],
            "--speedup needs positive numbers, got '0'",
        ),
    ],
)
def test_bad_input_is_one_line_and_nonzero(tmp_path, capsys, argv, needle):
    (tmp_path / "w.yaml").write_text(
        "name: w\ninput_tokens: {dist: fixed, value: 3}\noutput_tokens: {dist: fixed, value: 0}\n"
    )
    (tmp_path / "log.jsonl").write_text(
        "".join(f'{{"ts": {t}, "input_tokens": 3, "output_tokens": 1}}\n' for t in (0, 1))
    )
    (tmp_path / "trace.yaml").write_text("name: t\ninput_tokens: {dist: fixed, value: 3}\noutput_tokens: {dist: fixed, value: 1}\n"
                                         "arrival: {process: trace, file: log.jsonl}\n")  # fmt: skip
    code, _, err = run_cli(capsys, *(a.replace("{tmp}", str(tmp_path)) for a in argv))
    assert code == 2
    assert needle in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.parametrize("crash_after_s, kept", [("1000", False), ("2", True)])
def test_without_json_the_engine_log_is_removed_unless_vllm_failed(
    tmp_path, capsys, monkeypatch, tiny_model, fake_python, crash_after_s, kept
):
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(temp))  # where mkdtemp puts the log's directory
    code, _, err = run_cli(
        capsys, "--model", str(tiny_model), "--python", str(fake_python), "--workload", "cpu-tiny",
        "--env", f"SERVETUNE_FAKE_CRASH_AFTER_S={crash_after_s}", "--env", "SERVETUNE_FAKE_ITL_MS=10",
        "--concurrency", "8,1", "--num-requests", "8",
    )  # fmt: skip
    logs = list(temp.glob("servetune-bench-*/bench.engine.log"))
    if kept:
        assert code == 3 and len(logs) == 1 and f"vLLM's log is kept at {logs[0]}\n" in err, err
    else:
        assert code == 0 and list(temp.glob("servetune-bench-*")) == [], err
        assert f"(log: {temp}/servetune-bench-" in err and "removed at the end unless vLLM fails" in err, err
    assert processes_mentioning(fake_python) == []


LORA_WORKLOAD = (
    "name: lora\ninput_tokens: {dist: fixed, value: 8}\noutput_tokens: {dist: fixed, value: 4}\n"
    "adapters:\n  - {name: tiny-a, path: tiny}\n"
)


@pytest.mark.parametrize("outcome", ["finished", "failed to start", "--json"])
def test_bench_builds_the_tiny_adapter_where_it_cleans_up(
    tmp_path, capsys, tiny_model, fake_python, monkeypatch, outcome
):
    """Without --json the tiny adapter is built beside the temporary engine log and removed with it (the log alone is
    kept when the engine failed); with --json it is built beside the result, as the log is."""
    import servetune.cli.bench as bench

    logs: list[Path] = []

    def engine_log_path(json_out):
        logs.append(real_log_path(json_out))
        return logs[-1]

    real_log_path = bench.engine_log_path
    monkeypatch.setattr(bench, "engine_log_path", engine_log_path)
    adapters: list[Path] = []

    class Recording(bench.VllmServer):
        def __init__(self, model, engine_args, *args, **kwargs):
            (module,) = engine_args["lora_modules"]
            adapters.append(Path(module.removeprefix("tiny-a=")))
            assert (adapters[-1] / "adapter_config.json").is_file()  # built before the engine starts
            super().__init__(model, engine_args, *args, **kwargs)

    monkeypatch.setattr(bench, "VllmServer", Recording)
    if outcome == "failed to start":
        monkeypatch.setenv("SERVETUNE_FAKE_FAIL_STARTUP", "1")
    workload = tmp_path / "lora.yaml"
    workload.write_text(LORA_WORKLOAD)
    out_file = tmp_path / "res" / "bench.json"
    json_args = ["--json", str(out_file)] if outcome == "--json" else []
    code, _, err = run_cli(
        capsys, "--model", str(tiny_model), "--python", str(fake_python), "--workload", str(workload),
        "--concurrency", "1", "--num-requests", "2", "--warmup-requests", "0", "--startup-timeout", "60", *json_args,
    )  # fmt: skip
    (adapter,), (log,) = adapters, logs
    if outcome == "--json":
        assert code == 0, err
        assert adapter == (out_file.parent / "models" / "tiny-lora").resolve() and adapter.is_dir()
        assert BenchResult.model_validate_json(out_file.read_text()).engine_args["lora_modules"] == [
            f"tiny-a={adapter}"
        ]
        return
    assert not adapter.exists()
    if outcome == "finished":
        assert code == 0, err
        assert not log.parent.exists()  # nothing of the run is left
    else:
        assert code != 0
        assert [p.name for p in log.parent.iterdir()] == [log.name]  # vLLM's log, kept to read; the adapter is gone
        shutil.rmtree(log.parent)


@pytest.mark.parametrize("crowded", [False, True])
def test_bench_records_the_cores_its_engine_claimed_or_why_it_claimed_none(
    tmp_path, capsys, monkeypatch, tiny_model, fake_python, crowded
):
    """As a trial records them (engine/cores.py): a level measured on cores other engines hold is not comparable
    with one measured on cores of its own, and the JSON (and the console) say which it was."""
    locks = tmp_path / "locks"
    locks.mkdir()
    monkeypatch.setenv(LOCK_DIR_ENV, str(locks))  # inherited by nothing else: this test's own accounting
    monkeypatch.delenv(BIND, raising=False)
    allowed = sorted(os.sched_getaffinity(0))
    held = claim(len(allowed), allowed, locks)[1] if crowded else []  # other engines on the host hold every core
    out_file = tmp_path / "b.json"
    try:
        code, _, err = run_cli(
            capsys, "--model", str(tiny_model), "--python", str(fake_python), "--workload", "cpu-tiny",
            "--concurrency", "1", "--num-requests", "2", "--json", str(out_file),
        )  # fmt: skip
    finally:
        for handle in held:
            handle.close()
    assert code == 0, err
    result = BenchResult.model_validate_json(out_file.read_text())
    if crowded:
        assert result.cpu_binding is None and result.cpu_unclaimed is not None
        assert (
            result.cpu_unclaimed.startswith(f"no 1 of the {len(allowed)} cores free")
            and str(locks) in result.cpu_unclaimed
        )
        assert f"warning: no cores of its own: {result.cpu_unclaimed}" in err, err
    else:
        assert result.cpu_binding == str(physical_first(allowed)[0]) and result.cpu_unclaimed is None
        assert "no cores of its own" not in err
    assert processes_mentioning(fake_python) == []
