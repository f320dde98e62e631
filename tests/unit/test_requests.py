import itertools

import numpy as np

from servetune.config.workload import Workload
from servetune.load.requests import PromptFactory, iter_requests


def workload(**extra):
    base = {"name": "t", "input_tokens": {"dist": "uniform", "min": 20, "max": 300}, "output_tokens": {"dist": "fixed", "value": 8}}
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
