import itertools

import numpy as np

from servetune.config.workload import Workload
from servetune.load.requests import PromptFactory, iter_requests


def workload(**extra):
    base = {
        "name": "t",
        "input_tokens": {"dist": "uniform", "min": 20, "max": 300},
        "output_tokens": {"dist": "fixed", "value": 8},
    }
    return Workload.model_validate({**base, **extra})


def test_prompts_hit_exact_token_counts(tiny_tokenizer):
    factory = PromptFactory(tiny_tokenizer)
    rng = np.random.default_rng(0)
    for n in (1, 2, 17, 256, 1000):
        text = factory.text(n, rng)
        assert len(tiny_tokenizer.encode(text, add_special_tokens=False)) == n


def test_stream_is_deterministic_and_streams_differ(tiny_tokenizer):
    factory = PromptFactory(tiny_tokenizer)
    w = workload()
    a = list(itertools.islice(iter_requests(w, factory, stream=1), 20))
    b = list(itertools.islice(iter_requests(w, factory, stream=1), 20))
    c = list(itertools.islice(iter_requests(w, factory, stream=2), 20))
    assert a == b
    assert [r.prompt for r in a] != [r.prompt for r in c]
    for r in a:
        assert len(tiny_tokenizer.encode(r.prompt, add_special_tokens=False)) == r.input_tokens


def test_shared_prefix_is_shared_by_the_given_fraction(tiny_tokenizer):
    factory = PromptFactory(tiny_tokenizer)
    w = workload(shared_prefix={"tokens": 64, "fraction": 0.5})
    reqs = list(itertools.islice(iter_requests(w, factory, stream=1), 400))
    other = list(itertools.islice(iter_requests(w, factory, stream=7), 5))
    prefix = max((r.prompt[:64] for r in reqs), key=lambda p: sum(q.prompt.startswith(p) for q in reqs))
    sharing = [r for r in reqs if r.prompt.startswith(prefix)]
    assert abs(len(sharing) / len(reqs) - 0.5) < 0.08
    assert all(r.input_tokens > 64 for r in sharing)
    assert any(r.prompt.startswith(prefix) for r in other)  # the same prefix in every stream


def test_shared_prefixes_in_groups_follow_their_popularity(tiny_tokenizer):
    factory = PromptFactory(tiny_tokenizer)
    prefixes = None
    for popularity, share_of_first in ((0.0, (0.15, 0.35)), (2.0, (0.55, 0.8))):
        w = workload(shared_prefix={"tokens": 64, "fraction": 1.0, "groups": 4, "popularity": popularity})
        reqs = list(itertools.islice(iter_requests(w, factory, stream=1), 400))
        heads = [tiny_tokenizer.decode(tiny_tokenizer.encode(r.prompt, add_special_tokens=False)[:64]) for r in reqs]
        counts = sorted(((heads.count(h), h) for h in set(heads)), reverse=True)
        assert len(counts) == 4, [c for c, _ in counts]  # four distinct prefixes, each used
        assert share_of_first[0] < counts[0][0] / len(reqs) < share_of_first[1], [c for c, _ in counts]
        found = {h for _, h in counts}
        assert prefixes is None or found == prefixes  # the same prefixes whatever their popularity
        prefixes = found
        other = list(itertools.islice(iter_requests(w, factory, stream=9), 20))
        assert all(any(r.prompt.startswith(p) for p in prefixes) for r in other)  # shared by every stream


def test_a_group_count_out_of_range_is_refused():
    import pytest
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="groups"):
        workload(shared_prefix={"tokens": 64, "groups": 0})


def lookup_hits(ids: list[int], n: int = 3) -> float:
    """The share of positions whose preceding n tokens occurred earlier in the same prompt: where vLLM's
    n-gram proposer finds a draft (prompt_lookup_min = n)."""
    seen, hits = set(), 0
    for i in range(n, len(ids)):
        gram = tuple(ids[i - n : i])
        hits += gram in seen
        seen.add(tuple(ids[i - n : i]))
    return hits / max(len(ids) - n, 1)


def test_corpus_prompts_are_passages_of_the_shipped_text_with_exact_counts(tiny_tokenizer):
    from servetune.config.workload import corpus_path

    factory = PromptFactory(tiny_tokenizer)
    corpus = corpus_path().read_text(encoding="utf-8")
    w = workload(text="corpus", shared_prefix={"tokens": 32, "fraction": 0.5})
    reqs = list(itertools.islice(iter_requests(w, factory, stream=1), 60))
    assert reqs == list(itertools.islice(iter_requests(w, factory, stream=1), 60))  # deterministic
    for r in reqs:
        assert len(tiny_tokenizer.encode(r.prompt, add_special_tokens=False)) == r.input_tokens
    # a passage of the corpus, behind the shared prefix where it has one (its ASCII parts: a byte cut in a
    # multi-byte character decodes to a replacement character)
    plain = [r.prompt[r.reused_tokens :] for r in reqs]
    pieces = [piece for text in plain for piece in text.split("\ufffd") if len(piece) > 40]
    assert pieces and all(piece in corpus + corpus for piece in pieces)
    assert 0.3 < sum(r.reused_tokens > 0 for r in reqs) / len(reqs) < 0.7  # the shared prefix as the workload says


def test_a_passage_longer_than_the_text_wraps_around(tiny_tokenizer, tmp_path):
    (tmp_path / "short.txt").write_text("the cat sat on the mat. ")
    w = Workload.model_validate(
        {"name": "t", "text": "short.txt", "input_tokens": {"dist": "fixed", "value": 200},
         "output_tokens": {"dist": "fixed", "value": 8}},
        context={"base_dir": tmp_path},
    )  # fmt: skip
    [r] = itertools.islice(iter_requests(w, PromptFactory(tiny_tokenizer)), 1)
    assert len(tiny_tokenizer.encode(r.prompt, add_special_tokens=False)) == 200
    assert "the cat sat on the mat. the cat sat on the mat." in r.prompt


def test_corpus_text_repeats_as_text_does_and_random_words_do_not(tiny_tokenizer):
    factory = PromptFactory(tiny_tokenizer)
    long = {"input_tokens": {"dist": "fixed", "value": 1500}}
    corpus = [r.prompt for r in itertools.islice(iter_requests(workload(text="corpus", **long), factory), 5)]
    random = [r.prompt for r in itertools.islice(iter_requests(workload(**long), factory), 5)]
    encode = tiny_tokenizer.encode
    corpus_hits = np.mean([lookup_hits(encode(p, add_special_tokens=False)) for p in corpus])
    random_hits = np.mean([lookup_hits(encode(p, add_special_tokens=False)) for p in random])
    assert corpus_hits > 5 * random_hits


def test_each_request_carries_its_classs_sampling_over_the_workloads_and_the_client_sends_it(tiny_tokenizer):
    from servetune.load.client import StreamingClient

    w = Workload.model_validate(
        {
            "name": "t", "api": "completions", "sampling": {"top_p": 0.9, "stop": ["\n\n"]},
            "mix": [
                {"name": "strict", "weight": 1, "input_tokens": {"dist": "fixed", "value": 16},
                 "output_tokens": {"dist": "fixed", "value": 8}},
                {"name": "creative", "weight": 1, "input_tokens": {"dist": "fixed", "value": 16},
                 "output_tokens": {"dist": "uniform", "min": 4, "max": 64},
                 "sampling": {"temperature": 0.8, "top_k": 40, "n": 2, "logprobs": 3, "presence_penalty": 0.5,
                              "ignore_eos": False}},
            ],
        }
    )  # fmt: skip
    reqs = list(itertools.islice(iter_requests(w, PromptFactory(tiny_tokenizer)), 40))
    by_class = {r.request_class: dict(r.sampling) for r in reqs}
    assert by_class["strict"] == {"top_p": 0.9, "stop": ["\n\n"]}
    assert by_class["creative"] == {
        "temperature": 0.8, "top_p": 0.9, "top_k": 40, "n": 2, "logprobs": 3, "presence_penalty": 0.5,
        "stop": ["\n\n"], "ignore_eos": False,
    }  # fmt: skip
    client = StreamingClient("http://x", "m", ignore_eos=w.ignore_eos, temperature=w.temperature)
    creative = next(r for r in reqs if r.request_class == "creative")
    body = client.payload(creative)
    assert body["ignore_eos"] is False and body["temperature"] == 0.8 and body["max_tokens"] == creative.output_tokens
    strict = client.payload(next(r for r in reqs if r.request_class == "strict"))
    assert strict["ignore_eos"] is True and strict["temperature"] == 0.0 and "top_k" not in strict
    assert len({r.output_tokens for r in reqs if r.request_class == "creative"}) > 1  # max_tokens drawn per request


def test_chat_asks_logprobs_as_the_chat_api_does():
    w = workload(api="chat", sampling={"logprobs": 2})
    assert w.sampling_of(w.classes[0]) == {"logprobs": True, "top_logprobs": 2}
