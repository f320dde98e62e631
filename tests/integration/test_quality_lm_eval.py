"""Real lm-eval (a subprocess, its local-completions model, a custom task over a local JSONL file)
against a small OpenAI-style server on 127.0.0.1 that answers every other item right: the score is
read from lm-eval's results JSON, the items become quality.jsonl rows. Real vLLM runs it in
tests/e2e/test_study_vllm_cpu.py."""

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from servetune.quality.lm_eval import LmEvalPlan, run_lm_eval
from tests.unit.test_quality_lm_eval import task_folder

pytest.importorskip("lm_eval", reason="lm-eval is an optional extra: pip install servetune[lm-eval]")


class Completions(BaseHTTPRequestHandler):
    """``/v1/completions`` without streaming: ``N+1=`` is answered ``N+1`` for even N, ``0`` otherwise."""

    seen: ClassVar[list[dict]] = []  # every request, across the handler instances

    def do_POST(self):  # http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append({"path": self.path, **body})
        prompts = body["prompt"] if isinstance(body["prompt"], list) else [body["prompt"]]
        choices = []
        for index, prompt in enumerate(prompts):
            n = int(re.search(r"(\d+)\+1=$", prompt).group(1))
            choices.append({"index": index, "text": str(n + 1) if n % 2 == 0 else "0", "finish_reason": "stop"})
        data = json.dumps({"id": "x", "object": "text_completion", "model": body["model"], "choices": choices}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Completions)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_lm_eval_scores_a_custom_task_on_the_server(tmp_path, server):
    from servetune.models.tiny import build_tiny_model

    folder = task_folder(tmp_path, "mine")
    (folder / "items.jsonl").write_text(
        "".join(json.dumps({"question": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(4))
    )
    plan = LmEvalPlan(tasks=["mine"], include_path=str(folder), limit=4, num_fewshot=0, timeout_s=300)
    Completions.seen = []
    outcome = run_lm_eval(
        plan, server, "served", str(build_tiny_model(tmp_path / "tiny")), tmp_path / "out", max_length=512
    )
    assert outcome.errors == [], (tmp_path / "out" / "lm_eval.log").read_text()[-3000:]
    written = json.loads(next((tmp_path / "out").rglob("results_*.json")).read_text())
    assert outcome.scores == {"lm_eval/mine": 0.5} == {"lm_eval/mine": written["results"]["mine"]["exact_match,none"]}
    assert sorted((row["id"], row["passed"]) for row in outcome.rows) == [
        ("mine-0", True),
        ("mine-1", False),
        ("mine-2", True),
        ("mine-3", False),
    ]
    assert {row["prompt"] for row in outcome.rows} == {f"{i}+1=" for i in range(4)}
    assert {(r["path"], r["model"]) for r in Completions.seen} == {("/v1/completions", "served")}
