"""Structured output on real vLLM: the bodies servetune sends, answered by the tiny model (CPU build).

Builds the tiny model, starts one vLLM engine per ``--backends`` value (``structured_outputs_config.backend``
as a search space would set it, checked against vLLM's own parser), and sends each kind of constraint (choice,
regex, JSON schema; ``--apis`` completions and chat) through servetune's client, ``--requests`` of each. Prints,
per backend, API and kind: the HTTP answers, the share that parsed as asked (the client's ``structured_valid``),
and one answer's text. Run it under the heavy lock: it starts real engines.

    flock /tmp/servetune-heavy.lock .venv/bin/python bench/structured_vllm.py [--backends auto xgrammar guidance]
        [--engine-arg structured_outputs_config.disable_any_whitespace=true]

The tiny model's random weights fill a JSON object with whitespace until ``max_tokens`` unless the backend is
told to allow none (``disable_any_whitespace``, xgrammar and guidance only): its JSON answers are then cut off,
and count as not valid, as a real model's would.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import urllib.request
from pathlib import Path

from servetune.config.workload import Workload
from servetune.engine.args import load_argspecs, parse_key_values, parse_value, validate_engine_args
from servetune.engine.server import VllmServer
from servetune.load.client import StreamingClient
from servetune.load.requests import RequestSpec
from servetune.metrics import RequestRecord
from servetune.models.tiny import build_tiny_model

KINDS = {
    "choice": {"choice": ["yes", "no", "maybe"]},
    "regex": {"regex": "[0-9]{3}-[a-z]{2,5}"},
    "json_schema": {
        "json_schema": {
            "type": "object",
            "properties": {"tool": {"type": "string", "enum": ["search", "answer"]}, "n": {"type": "integer"}},
            "required": ["tool", "n"],
            "additionalProperties": False,
        }
    },
}


def workload(api: str) -> Workload:
    lengths = {"input_tokens": {"dist": "fixed", "value": 8}, "output_tokens": {"dist": "fixed", "value": 48}}
    mix = [{"name": kind, **lengths, "structured": value} for kind, value in KINDS.items()]
    return Workload.model_validate({"name": "structured", "api": api, "mix": mix})


async def send(url: str, model: str, api: str, count: int) -> dict[str, list[RequestRecord]]:
    w = workload(api)
    out: dict[str, list[RequestRecord]] = {}
    async with StreamingClient(url, model, api=api, ignore_eos=w.ignore_eos, timeout_s=120) as client:
        for cls in w.classes:
            sampling, structured = tuple(w.sampling_of(cls).items()), w.structured_of(cls)
            for i in range(count):
                spec = RequestSpec(i, f"Answer {i}:", 8, 48, cls.name, sampling=sampling, structured=structured)
                record = RequestRecord(index=i, sent=0.0, input_tokens=8, max_tokens=48, request_class=cls.name)
                out.setdefault(cls.name, []).append(await client.send(spec, record, 0.0))
    return out


def one_text(url: str, model: str, api: str, kind: str) -> str:
    """One answer's text, asked without streaming (the streamed records keep no text)."""
    w = workload(api)
    cls = next(c for c in w.classes if c.name == kind)
    body = {"model": model, "max_tokens": 48, "temperature": 0.0, **w.sampling_of(cls)}
    body |= {"messages": [{"role": "user", "content": "Answer:"}]} if api == "chat" else {"prompt": "Answer:"}
    path = "chat/completions" if api == "chat" else "completions"
    request = urllib.request.Request(
        f"{url}/v1/{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        choice = json.loads(response.read())["choices"][0]
    return choice["message"]["content"] if api == "chat" else choice["text"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["auto"])
    parser.add_argument("--apis", nargs="+", default=["completions", "chat"])
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--engine-arg", action="append", help="KEY=VALUE, another engine argument of every engine")
    args = parser.parse_args()
    extra = {k: parse_value(v) for k, v in parse_key_values(args.engine_arg, "--engine-arg").items()}
    specs = load_argspecs()
    with tempfile.TemporaryDirectory(prefix="structured-") as tmp:
        model = build_tiny_model(Path(tmp) / "tiny")
        for backend in args.backends:
            engine_args = validate_engine_args(
                {"enforce_eager": True, "max_model_len": 512, "dtype": "float32",
                 "structured_outputs_config.backend": backend, **extra},
                specs,
            )  # fmt: skip
            log = Path(tmp) / f"engine-{backend}.log"
            server = VllmServer(
                model, engine_args, {"VLLM_CPU_KVCACHE_SPACE": "1"}, log_path=log, startup_timeout_s=600, argspecs=specs
            )
            try:
                with server:
                    print(
                        f"backend {backend}: engine up in {server.startup_s:.0f} s ({' '.join(server.command()[3:])})"
                    )
                    for api in args.apis:
                        records = asyncio.run(send(server.url, str(model), api, args.requests))
                        for kind, recs in records.items():
                            ok = [r for r in recs if r.ok]
                            valid = [r.structured_valid for r in ok]
                            errors = {r.error for r in recs if not r.ok}
                            text = one_text(server.url, str(model), api, kind) if ok else ""
                            print(
                                f"  {api:11} {kind:11} answered {len(ok)}/{len(recs)}  structured_valid "
                                f"{sum(bool(v) for v in valid)}/{len(valid)}  text {text!r}"
                                + (f"  errors {errors}" if errors else "")
                            )
            except Exception as exc:  # a backend that does not run here: say how it fails, go on
                tail = log.read_text()[-1500:] if log.exists() else ""
                print(f"backend {backend}: failed: {type(exc).__name__}: {str(exc)[:300]}\n{tail}")


if __name__ == "__main__":
    main()
