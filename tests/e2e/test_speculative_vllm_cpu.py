"""Speculative decoding on the real vLLM CPU build with the tiny model: vLLM's own counters reach a level.

vLLM 0.32's CPU build runs n-gram speculation (checked by hand: ``--speculative-config
'{"method": "ngram", ...}'`` starts, drafts and accepts). The tiny model's random weights do not follow
their prompt, and greedy decoding soon repeats a short cycle of its own, which n-gram lookup then drafts
and the model accepts, whatever the prompt said: so this proves the measurement (drafts, acceptance,
per position, as vLLM counted them), not how much a corpus prompt gains over random words (a real
model's question; tests/unit/test_requests.py shows the corpus repeats as text does).
"""

import json
import subprocess
import sys

import pytest

from servetune.metrics import (
    SPEC_ACCEPTANCE_RATE,
    SPEC_ACCEPTED_TOKENS,
    SPEC_DRAFT_TOKENS,
    SPEC_DRAFTS,
    SPEC_MEAN_ACCEPTED_LENGTH,
    spec_accepted_at,
)
from servetune.results import BenchResult
from tests.processes import processes_mentioning

pytestmark = pytest.mark.e2e

pytest.importorskip("vllm", reason="the e2e tests need vLLM (the CPU build: pip install servetune[cpu])")

DRAFTED = 3


def test_ngram_speculation_on_a_corpus_workload_is_measured_from_vllms_counters(tiny_model, tmp_path):
    workload = tmp_path / "corpus.yaml"
    workload.write_text(
        "name: corpus\ntext: corpus\ninput_tokens: {dist: fixed, value: 256}\noutput_tokens: {dist: fixed, value: 48}\n"
    )
    spec = {"method": "ngram", "num_speculative_tokens": DRAFTED, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "servetune", "bench", "--model", str(tiny_model), "--env", "VLLM_CPU_KVCACHE_SPACE=1",
         "--engine-arg", "enforce_eager=true", "--engine-arg", f"speculative_config={json.dumps(spec)}",
         "--workload", str(workload), "--concurrency", "4", "--num-requests", "16", "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    result = BenchResult.model_validate_json(out.read_text())
    assert "--speculative-config" in result.command
    [level] = result.levels
    server = level.server_metrics
    assert level.summary.completed == 16 and level.summary.total_output_tokens == 16 * 48
    drafts, drafted, accepted = server[SPEC_DRAFTS], server[SPEC_DRAFT_TOKENS], server[SPEC_ACCEPTED_TOKENS]
    assert drafts > 0 and drafted == DRAFTED * drafts  # n-gram drafts num_speculative_tokens each time
    assert 0 < accepted <= drafted
    assert server[SPEC_ACCEPTANCE_RATE] == pytest.approx(accepted / drafted)
    assert 1 < server[SPEC_MEAN_ACCEPTED_LENGTH] <= 1 + DRAFTED
    by_position = [server[spec_accepted_at(i)] for i in range(DRAFTED)]
    assert sum(by_position) == accepted
    assert by_position == sorted(by_position, reverse=True)  # a later draft token is accepted only after the earlier
    # every generated token is a step's bonus token or an accepted draft: fewer steps than tokens
    assert server["generation_tokens"] >= accepted
    assert processes_mentioning(tiny_model) == []
