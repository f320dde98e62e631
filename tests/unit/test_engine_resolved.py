"""What vLLM resolved at start-up, read from its /server_info (a response of vLLM 0.32's CPU build, trimmed)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from servetune.engine.resolved import RESOLVED_FIELDS, fetch_resolved, resolved_engine_args

SERVER_INFO = json.loads((Path(__file__).parents[1] / "data" / "vllm-server-info.json").read_text())


def test_the_core_engine_arguments_come_from_their_sections_of_vllms_config():
    resolved = resolved_engine_args(SERVER_INFO["vllm_config"])
    # the launch set dtype float32, max_model_len 1024 and enforce_eager; vLLM chose the rest
    assert resolved["dtype"] == "float32" and resolved["max_model_len"] == 1024 and resolved["enforce_eager"] is True
    assert resolved["max_num_seqs"] == 128 and resolved["max_num_batched_tokens"] == 2048
    assert resolved["block_size"] == 128 and resolved["kv_cache_dtype"] == "auto"
    assert resolved["enable_chunked_prefill"] is True and resolved["enable_prefix_caching"] is True
    assert resolved["tensor_parallel_size"] == 1 and resolved["data_parallel_size"] == 1
    assert "quantization" not in resolved  # None: nothing to pin
    assert set(resolved) <= set(RESOLVED_FIELDS)


def test_a_missing_section_or_a_server_without_the_endpoint_gives_nothing():
    assert resolved_engine_args({"model_config": "not a mapping"}) == {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # http.server's name
            body = json.dumps(SERVER_INFO).encode() if self.path.startswith("/server_info") else b""
            self.send_response(200 if body else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        assert fetch_resolved(url)["max_num_seqs"] == 128
        server.RequestHandlerClass = type(
            "NoDevMode", (Handler,), {"do_GET": lambda self: (self.send_response(404), self.end_headers())}
        )
        assert fetch_resolved(url) == {}
    finally:
        server.shutdown()
        server.server_close()
