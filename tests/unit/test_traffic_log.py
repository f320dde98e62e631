"""Request logs: reading them, the traffic they measure, and ``servetune workload from-log``."""

import json
from pathlib import Path

import numpy as np
import pytest

from servetune.cli import main
from servetune.cli.workload import trace_path
from servetune.config.workload import WORKLOADS_DIR, load_workload
from servetune.errors import UserError
from servetune.load.runner import workload_levels
from servetune.shipped import trials_dir
from servetune.traffic.fit import fit_arrival, poisson_tolerance, profile, shared_prefix
from servetune.traffic.log import parse_record, read_log
from servetune.traffic.synthetic import synthetic_log


def write_log(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def parsed(records):
    return [parse_record(r, i) for i, r in enumerate(records, 1)]


def test_common_spellings_are_read():
    r = parse_record(
        {"created": 1767225600123, "usage": {"prompt_tokens": 12, "completion_tokens": 5}, "conversation_id": 7}, 1
    )
    assert (r.time_s, r.input_tokens, r.output_tokens, r.session) == (
        1767225600.123,
        12,
        5,
        "7",
    )  # milliseconds read as such
    r = parse_record(
        {
            "timestamp": "2026-01-01T00:00:01Z",
            "messages": [{"role": "user", "content": "hi"}],
            "completion": "yo",
            "latency_ms": 250,
        },
        2,
    )
    assert (r.time_s, r.prompt, r.output, r.duration_s) == (1767225601.0, "hi", "yo", 0.25)


@pytest.mark.parametrize(
    "line, needle",
    [
        ('{"timestamp": 1, "input_tokens": 3', "not valid JSON"),
        ('{"timestamp": 1, "input_tokens": ' + "9" * 5000 + "}", "not valid JSON"),  # past Python's digit limit
        ("[1, 2]", "not a JSON object"),
        ('{"input_tokens": 3, "output_tokens": 1}', "no time"),
        (
            '{"timestamp": "yesterday", "input_tokens": 3, "output_tokens": 1}',
            "neither Unix seconds nor an ISO 8601 time",
        ),
        ('{"timestamp": 1, "output_tokens": 1}', "no input size"),
        ('{"timestamp": 1, "input_tokens": 3}', "no output size"),
        ('{"timestamp": 1, "input_tokens": -3, "output_tokens": 1}', "'input_tokens' must be a whole number"),
        ('{"timestamp": 1, "input_tokens": 2.5, "output_tokens": 1}', "'input_tokens' must be a whole number"),
    ],
)
def test_a_bad_line_names_the_file_and_line(tmp_path, line, needle):
    good = '{"timestamp": 0, "input_tokens": 3, "output_tokens": 1}'
    path = tmp_path / "log.jsonl"
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(UserError) as info:
        read_log(path)
    assert f"{path} line 3: " in str(info.value) and needle in str(info.value)


@pytest.mark.parametrize("cv", [0.5, 1.0, 2.0])
def test_measured_rate_and_burstiness_come_back(cv):
    traffic = profile(parsed(synthetic_log(4000, rate=3.0, cv=cv, sessions=False, seed=int(cv * 10))))
    arrival = traffic.arrival
    assert arrival.rate == pytest.approx(3.0, rel=0.1)
    assert arrival.cv == pytest.approx(cv, rel=0.12)
    assert arrival.process == ("poisson" if cv == 1.0 else "gamma")
    if cv != 1.0:
        assert arrival.burstiness == pytest.approx(1 / cv**2, rel=0.25)


def test_poisson_or_gamma_is_decided_by_the_sampling_error():
    rng = np.random.default_rng(0)
    assert fit_arrival(np.cumsum(rng.exponential(0.5, 2000))).process == "poisson"
    assert fit_arrival(np.cumsum(rng.gamma(4.0, 0.125, 2000))).process == "gamma"  # CV 0.5: smoother than Poisson
    assert poisson_tolerance(10) > poisson_tolerance(10_000) == 0.1
    with pytest.raises(ValueError, match="same time"):
        fit_arrival([5.0, 5.0, 5.0])


def test_conversations_turns_think_times_and_new_messages():
    records = synthetic_log(3000, rate=1.0, cv=1.0, max_turns=4, think_median_s=3.0, seed=3)
    traffic = profile(parsed(records))
    sessions = traffic.sessions
    assert sessions is not None and sessions.carries_history and not sessions.think_includes_response
    assert np.mean(sessions.turns) == pytest.approx(2.5, rel=0.1)  # 1..4 turns, uniform
    assert np.median(sessions.think_times_s) == pytest.approx(3.0, rel=0.1)  # the answers' durations taken out
    assert traffic.arrival.rate == pytest.approx(1.0, rel=0.15)  # conversations, not requests, arrive
    # Later turns' inputs carried the history; what the workload gets is each turn's new message (8..63).
    later = [i for i, r in enumerate(records) if "prompt" not in r]
    assert later and all(8 <= traffic.input_tokens[i] < 64 for i in later)


def test_shared_prefix_is_measured_from_the_texts():
    system = "You are a careful assistant. Keep answers short and cite sources. "
    prompts = [system + f"question {i} about {w}" for i, w in enumerate(["cats", "dogs", "tax"] * 20)]
    prompts += [f"free text number {i}, unrelated" for i in range(40)]
    text, members = shared_prefix(prompts)
    assert text.startswith(system) and members == 60
    assert shared_prefix([f"{i} short" for i in range(20)]) is None
    records = [
        {"timestamp": i, "prompt": p, "input_tokens": len(p) // 4, "output_tokens": 8} for i, p in enumerate(prompts)
    ]
    traffic = profile(parsed(records))
    assert traffic.prefix.fraction == pytest.approx(0.6)
    assert traffic.prefix.estimated and traffic.prefix.tokens == pytest.approx(len(text) / 4, rel=0.2)
    counted = profile(parsed(records), count=len)  # a tokenizer that counts characters
    assert not counted.prefix.estimated and counted.prefix.tokens == len(counted.prefix.text)


def test_texts_without_counts_need_a_tokenizer(tmp_path, capsys):
    log = write_log(
        tmp_path / "log.jsonl", [{"timestamp": i, "prompt": "hello there", "output": "hi"} for i in range(3)]
    )
    assert main(["workload", "from-log", str(log), "--out", str(tmp_path / "w.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{log} line 1" in err and "--tokenizer" in err
    assert not list(tmp_path.glob("w*"))


def test_from_log_writes_a_workload_that_loads(tmp_path, capsys):
    log = write_log(tmp_path / "traffic.jsonl", synthetic_log(600, rate=0.5, cv=2.0, seed=1))
    out = tmp_path / "made" / "mine.yaml"
    assert main(["workload", "from-log", str(log), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gamma" in printed and "conversations: " in printed and "shared prefix: " in printed
    w = load_workload(out)
    assert w.name == "mine" and w.sessions is not None and w.shared_prefix is not None
    assert w.arrival.process == "gamma" and 0 < w.arrival.burstiness < 1
    traffic = profile(read_log(log))
    assert w.arrival.levels[1] == pytest.approx(traffic.arrival.rate, rel=0.01)
    firsts = [
        (i, o)
        for i, o, first in zip(traffic.input_tokens, traffic.output_tokens, traffic.first_turn, strict=True)
        if first
    ]
    later = [
        (i, o)
        for i, o, first in zip(traffic.input_tokens, traffic.output_tokens, traffic.first_turn, strict=True)
        if not first
    ]
    assert len(firsts) == len(traffic.sessions.turns) and later
    assert (
        list(zip(w.input_tokens._values, w.output_tokens._values, strict=True)) == firsts
    )  # first turns: whole prompts
    assert (
        list(zip(w.sessions.input_tokens._values, w.sessions.output_tokens._values, strict=True)) == later
    )  # later: new messages
    assert (
        max(w.sessions.input_tokens._values) < 64 < max(w.input_tokens._values)
    )  # the synthetic log's messages are 8..63
    assert w.sessions.turns._values == traffic.sessions.turns


def test_from_log_trace_replays_the_log_at_speedups(tmp_path):
    log = write_log(tmp_path / "traffic.jsonl", synthetic_log(200, sessions=False, seed=2))
    out = tmp_path / "replay.yaml"
    assert main(["workload", "from-log", str(log), "--out", str(out), "--trace"]) == 0
    w = load_workload(out)
    assert w.arrival.process == "trace"
    levels = workload_levels(w, None, None)
    rate = profile(read_log(log)).arrival.rate
    assert [lv.value for lv in levels] == pytest.approx([rate, 2 * rate, 4 * rate])
    assert [lv.speedup for lv in levels] == pytest.approx([1, 2, 4])
    assert str(levels[1]).startswith("trace x2 (")
    # load.kind: rate takes the values as rates; concurrency ignores the times.
    assert [lv.speedup for lv in workload_levels(w, "rate", (rate / 2,))] == pytest.approx([0.5])
    assert workload_levels(w, "concurrency", (4,))[0].trace is None


def test_a_bad_log_writes_nothing_and_keeps_what_was_there(tmp_path, capsys):
    log = tmp_path / "log.jsonl"
    log.write_text(
        '{"timestamp": 0, "input_tokens": 3, "output_tokens": 1}\n{"timestamp": 1, "input_tokens": "many"}\n'
    )
    out = tmp_path / "w.yaml"
    out.write_text("name: kept\n")
    assert main(["workload", "from-log", str(log), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{log} line 2:" in err
    assert out.read_text() == "name: kept\n" and sorted(p.name for p in tmp_path.iterdir()) == ["log.jsonl", "w.yaml"]


@pytest.mark.parametrize("out, needle", [("w.txt", "a workload is a .yaml file"), ("d.yaml", "is a directory")])
def test_bad_out_is_one_line(tmp_path, capsys, out, needle):
    log = write_log(tmp_path / "log.jsonl", synthetic_log(10, sessions=False))
    (tmp_path / "d.yaml").mkdir()
    assert main(["workload", "from-log", str(log), "--out", str(tmp_path / out)]) == 2
    assert needle in capsys.readouterr().err


def test_an_unwritable_out_is_one_line_and_leaves_no_temporary_file(tmp_path, capsys):
    log = write_log(tmp_path / "log.jsonl", synthetic_log(10, sessions=False))
    (tmp_path / "file").write_text("")
    assert main(["workload", "from-log", str(log), "--out", str(tmp_path / "file" / "w.yaml")]) == 2
    assert "cannot write" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "log.jsonl"]


def test_the_shipped_log_and_workload_are_what_the_code_makes(tmp_path, capsys):
    """The shipped log is the synthetic generator's output, and its workload is from-log's."""
    shipped_log = trials_dir() / "logs" / "synthetic-chat.jsonl"
    assert shipped_log.read_text() == "".join(json.dumps(r) + "\n" for r in synthetic_log())
    out = tmp_path / "from-log.yaml"
    assert main(["workload", "from-log", str(shipped_log), "--out", str(out)]) == 0
    for name in ("from-log.yaml", "from-log.lengths.jsonl", "from-log.sessions.jsonl", "from-log.turns.jsonl"):
        made = (tmp_path / name).read_text().replace(str(shipped_log.name), "synthetic-chat.jsonl")
        assert made == (WORKLOADS_DIR / name).read_text(), name


def test_a_trace_is_named_relative_to_the_workload_when_they_share_a_parent(tmp_path):
    assert trace_path(tmp_path / "logs" / "a.jsonl", tmp_path / "workloads" / "w.yaml") == "../logs/a.jsonl"
    assert trace_path(Path("/srv/a.jsonl"), Path("/home/me/w.yaml")) == "/srv/a.jsonl"


def test_with_sessions_a_rate_counts_conversations(tmp_path):
    out = tmp_path / "w.yaml"
    assert (
        main(["workload", "from-log", str(write_log(tmp_path / "log.jsonl", synthetic_log(60))), "--out", str(out)])
        == 0
    )
    levels = workload_levels(load_workload(out), None, None)
    assert all(lv.conversations and str(lv).endswith("conversations/s") for lv in levels)
    assert all(not lv.conversations for lv in workload_levels(load_workload(out), "concurrency", (2,)))


def test_a_studys_levels_for_a_trace_are_speedups(tmp_path):
    """``servetune run``: the space's load.levels are a trace workload's speed-ups unless load.kind says otherwise."""
    from servetune.config.space import SearchSpace
    from servetune.trial.context import resolve_levels

    log = write_log(tmp_path / "log.jsonl", synthetic_log(100, sessions=False, seed=4))
    assert main(["workload", "from-log", str(log), "--out", str(tmp_path / "replay.yaml"), "--trace"]) == 0
    workload = load_workload(tmp_path / "replay.yaml")
    rate = profile(read_log(log)).arrival.rate
    base = {
        "name": "s",
        "model": "tiny",
        "device": "cpu",
        "workload": str(tmp_path / "replay.yaml"),
        "params": {"max_num_seqs": [2]},
    }
    space = SearchSpace.model_validate({**base, "load": {"levels": [0.5, 3]}})
    assert [lv.value for lv in resolve_levels(space, workload)] == pytest.approx([0.5 * rate, 3 * rate])
    space = SearchSpace.model_validate({**base, "load": {"kind": "rate", "levels": [0.5, 3]}})
    assert [lv.value for lv in resolve_levels(space, workload)] == [0.5, 3.0]
