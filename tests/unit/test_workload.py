import itertools
import json

import numpy as np
import pytest

from servetune.config.workload import WORKLOADS_DIR, load_workload
from servetune.errors import UserError
from servetune.load.requests import PromptFactory, iter_requests


def write(tmp_path, text, name="w.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


#: A workload file's first lines: its name and fixed lengths (a test adds what it checks).
HEAD = "name: t\ninput_tokens: {dist: fixed, value: 8}\noutput_tokens: {dist: fixed, value: 1}\n"


def assert_refused_in_one_line(path, needle: str) -> None:
    """Loading the workload at ``path`` fails with one line that starts with the file and holds ``needle``."""
    with pytest.raises(UserError) as info:
        load_workload(path)
    message = str(info.value)
    assert message.startswith(str(path)) and needle in message and "\n" not in message


def test_every_shipped_workload_loads():
    names = sorted(p.stem for p in WORKLOADS_DIR.glob("*.yaml"))
    assert {"chat", "rag", "summary", "batch", "cpu-tiny"} <= set(names)
    for name in names:
        assert load_workload(name).name == name


@pytest.mark.parametrize(
    "dist",
    [
        "{dist: fixed, value: 7}",
        "{dist: uniform, min: 5, max: 9}",
        "{dist: normal, mean: 50, std: 30, min: 10, max: 60}",
        "{dist: lognormal, median: 100, sigma: 1.5, min: 20, max: 400}",
    ],
)
def test_distributions_stay_in_bounds_and_are_seeded(tmp_path, dist):
    w = load_workload(write(tmp_path, f"name: t\ninput_tokens: {dist}\noutput_tokens: {{dist: fixed, value: 1}}\n"))
    d = w.input_tokens
    a = d.sample(np.random.default_rng(3), 2000)
    b = d.sample(np.random.default_rng(3), 2000)
    assert (a == b).all()
    lo, hi = (7, 7) if d.dist == "fixed" else (d.min, d.max)
    assert a.min() >= lo and a.max() <= hi


def test_lognormal_median(tmp_path):
    w = load_workload(
        write(
            tmp_path,
            "name: t\ninput_tokens: {dist: lognormal, median: 300, sigma: 0.5, max: 100000}\noutput_tokens: {dist: fixed, value: 1}\n",
        )
    )
    assert np.median(w.input_tokens.sample(np.random.default_rng(0), 20000)) == pytest.approx(300, rel=0.03)


def test_gamma_and_mix_weights(tmp_path, tiny_tokenizer):
    text = """
name: m
mix:
  - {name: short, weight: 3, input_tokens: {dist: fixed, value: 10}, output_tokens: {dist: fixed, value: 2}}
  - {name: long, weight: 1, input_tokens: {dist: fixed, value: 200}, output_tokens: {dist: fixed, value: 3}}
arrival: {process: gamma, burstiness: 0.5}
"""
    w = load_workload(write(tmp_path, text))
    reqs = list(itertools.islice(iter_requests(w, PromptFactory(tiny_tokenizer)), 400))
    share = sum(r.request_class == "long" for r in reqs) / len(reqs)
    assert share == pytest.approx(0.25, abs=0.06)
    assert {r.input_tokens for r in reqs if r.request_class == "long"} == {200}


@pytest.mark.parametrize(
    "text, needle",
    [
        (
            "name: t\ninput_tokens: {dist: fixed, value: 3}\noutput_tokens: {dist: fixed, value: 1}\nbogus: 1\n",
            "bogus: unknown key",
        ),
        (
            "name: t\ninput_tokens: {dist: lognormal, median: 3, sigma: -1, max: 9}\noutput_tokens: {dist: fixed, value: 1}\n",
            "input_tokens.sigma",
        ),
        (
            "name: t\ninput_tokens: {dist: uniform, min: 9, max: 3}\noutput_tokens: {dist: fixed, value: 1}\n",
            "min (9) is larger than max (3)",
        ),
        ("name: t\ninput_tokens: {dist: zipf, value: 3}\noutput_tokens: {dist: fixed, value: 1}\n", "input_tokens"),
        ("name: t\ninput_tokens: {dist: fixed, value: 3}\n", "go together"),
        ("input_tokens: {dist: fixed, value: 3}\noutput_tokens: {dist: fixed, value: 1}\n", "name: Field required"),
        ("name: t\n  bad: [yaml\n", "not valid YAML"),
    ],
)
def test_invalid_workload_names_file_and_field(tmp_path, text, needle):
    path = write(tmp_path, text)
    assert_refused_in_one_line(path, needle)


def test_unknown_workload_name_lists_shipped_ones():
    with pytest.raises(UserError, match="cpu-tiny"):
        load_workload("no-such-workload")


def test_empirical_lengths_and_prompts(tmp_path, tiny_tokenizer):
    (tmp_path / "lens.jsonl").write_text("\n".join(json.dumps({"n": n}) for n in (5, 6, 7)) + "\n")
    (tmp_path / "prompts.jsonl").write_text(
        json.dumps({"prompt": "hello there"}) + "\n" + json.dumps({"prompt": "bye"}) + "\n"
    )
    w = load_workload(
        write(
            tmp_path,
            "name: e\ninput_tokens: {dist: empirical, file: prompts.jsonl}\noutput_tokens: {dist: empirical, file: lens.jsonl, field: n}\n",
        )
    )
    reqs = list(itertools.islice(iter_requests(w, PromptFactory(tiny_tokenizer)), 50))
    assert {r.prompt for r in reqs} == {"hello there", "bye"}
    assert {r.input_tokens for r in reqs} == {11, 3}
    assert {r.output_tokens for r in reqs} <= {5, 6, 7}


def test_empirical_missing_field_names_the_line(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(UserError, match="line 1 has no field 'prompt'"):
        load_workload(
            write(
                tmp_path,
                "name: e\ninput_tokens: {dist: empirical, file: p.jsonl}\noutput_tokens: {dist: fixed, value: 1}\n",
            )
        )


@pytest.mark.parametrize(
    "text, needle",
    [("text: missing.txt\n", "text: cannot read"), ("text: empty.txt\n", "has no text")],
)
def test_a_text_source_that_cannot_be_read_is_one_line_naming_file_and_field(tmp_path, text, needle):
    (tmp_path / "empty.txt").write_text("  \n")
    path = write(tmp_path, HEAD + text)
    assert_refused_in_one_line(path, needle)


def test_random_words_stay_the_default_and_the_corpus_ships():
    from servetune.config.workload import Workload, corpus_path

    assert Workload.model_fields["text"].default == "random" and load_workload("rag").source_text is None
    assert load_workload("chat").source_text == corpus_path().read_text(encoding="utf-8")  # init's chat searches n-gram
    assert corpus_path().is_file() and (corpus_path().parent / "README.md").is_file()


@pytest.mark.parametrize(
    "text, needle",
    [
        ("temperature: 0.5\nsampling: {temperature: 0.7}\n", "sampling.temperature: temperature is given twice"),
        ("sampling: {top_p: 1.5}\n", "sampling.top_p"),
        ("sampling: {best_of: 2}\n", "sampling.best_of"),
    ],
)
def test_bad_sampling_is_one_line_naming_file_and_field(tmp_path, text, needle):
    path = write(tmp_path, HEAD + text)
    assert_refused_in_one_line(path, needle)
