"""The shipped scenario workloads sample as the tuning checklist's section 9 says for their scenario, and the load
client sends what each workload says: every request body of a class carries the class's temperature, top_p and top_k."""

import itertools

import pytest

from servetune.config.workload import load_workload
from servetune.load.client import StreamingClient
from servetune.load.requests import PromptFactory, iter_requests

# Checklist section 9 (seeds/tuning-checklist.zh.txt): temperature per row; top_p usually 0.8-1.0; top_k 0 or 20-100.
TEMPERATURE = {"extraction": (0.0, 0.2), "rag": (0.0, 0.4), "chat": (0.6, 0.9), "creative": (0.8, 1.2)}
# The row each shipped workload takes (docs/concepts/workloads.md says why).
ROW = {"chat": "chat", "rag": "rag", "summary": "rag", "code": "extraction", "agent": "extraction", "batch": "creative"}


def _within_checklist(row: str, body: dict) -> None:
    low, high = TEMPERATURE[row]
    assert low <= body["temperature"] <= high, (row, body["temperature"])
    assert 0.8 <= body["top_p"] <= 1.0, body["top_p"]
    assert body["top_k"] == 0 or 20 <= body["top_k"] <= 100, body["top_k"]


@pytest.mark.parametrize("name", sorted(ROW))
def test_a_shipped_workload_sends_the_sampling_of_its_checklist_row(name, tiny_tokenizer):
    workload = load_workload(name)
    client = StreamingClient(
        "http://127.0.0.1:1", "m", api=workload.api, ignore_eos=workload.ignore_eos, temperature=workload.temperature
    )
    wanted = {c.name: workload.sampling_of(c) for c in workload.classes}
    for asked in wanted.values():  # each class says all three, not the server's defaults
        assert {"temperature", "top_p", "top_k"} <= set(asked), (name, asked)
    seen = set()
    for spec in itertools.islice(iter_requests(workload, PromptFactory(tiny_tokenizer)), 40):
        body = client.payload(spec)
        for field in ("temperature", "top_p", "top_k"):
            assert body[field] == wanted[spec.request_class][field], (name, spec.request_class, field)
        _within_checklist(ROW[name], body)
        seen.add(spec.request_class)
    assert seen == set(wanted)  # every class was drawn and checked


def test_the_agents_tool_calls_sample_greedily_under_the_workloads_top_p_and_top_k(tiny_tokenizer):
    workload = load_workload("agent")
    classes = {c.name: workload.sampling_of(c) for c in workload.classes}
    assert classes["tool_call"]["temperature"] == 0.0 and classes["plan"]["temperature"] > 0
    assert classes["tool_call"]["top_p"] == classes["plan"]["top_p"] == workload.sampling.top_p
    assert classes["tool_call"]["ignore_eos"] is False and "response_format" in classes["tool_call"]
