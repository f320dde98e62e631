"""An error event inside a stream (load/client.py ``stream_error``): vLLM 0.32 refuses a streaming completion past
``--max-num-queued-tokens`` after the response began, as an event carrying the 503 it meant."""

from __future__ import annotations

from servetune.load.client import stream_error
from servetune.metrics import RequestRecord
from servetune.verify.admitted import refused

#: The event vLLM 0.32 sent in the verify e2e (serving.py: create_streaming_error_response(MaxQueuedTokensError())).
BACKLOG = {
    "message": "The engine has reached its prefill token backlog limit. Please try again later or on a different "
    "instance.",
    "type": "Service Unavailable",
    "param": None,
    "code": 503,
}


def test_a_refusal_in_the_stream_is_the_503_it_meant_and_counts_as_refused():
    kind, text = stream_error(BACKLOG)
    assert kind == "http_5xx" and text.startswith("HTTP 503 (in the stream): The engine has reached")
    record = RequestRecord(index=0, sent=0.0, input_tokens=8, max_tokens=8, end=0.01, error_kind=kind, error=text)
    assert refused(record)


def test_an_event_without_a_status_stays_a_stream_error():
    assert stream_error({"message": "boom"}) == ("stream_error", "{'message': 'boom'}")
    assert stream_error("boom") == ("stream_error", "boom")
    assert stream_error({"message": "x", "code": "oops"})[0] == "stream_error"
    assert stream_error({"message": "bad", "code": 400})[0] == "http_4xx"
