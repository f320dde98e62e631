"""Where an engine's start-up went, read from the lines vLLM logs while it starts.

vLLM (0.32) times its own phases and logs them:

- ``Model loading took 14.99 GiB memory and 5.27 seconds`` (GPU) or ``Loading weights took
  0.03 seconds`` and ``Initializing model took 0.12 seconds`` (CPU): loading the weights;
- ``torch.compile took 21.30 s in total`` (once per compiled model): ``torch.compile``;
- ``Graph capturing finished in 12 secs``: CUDA-graph capture;
- ``init engine (profile, create kv cache, warmup model) took 45.1 s``: memory profiling, the KV
  cache and warm-up, compilation and graph capture included;
- ``Time spent downloading weights for M: 93.5 seconds`` (``model_executor/model_loader/weight_utils.py``, logged
  past 0.5 s): the weights came from the hub during the start. ``download_s`` keeps it apart from
  ``load_weights_s``: the GPU's "Model loading took" includes it and is recorded without it; the CPU's "Loading
  weights took" starts its clock after the download (``default_loader.py``);
- ``Directly load the compiled graph(s) ... from the cache``: the compile cache was hit
  (``VLLM_CACHE_ROOT``, ``~/.cache/vllm``, shared by the trials of a node that share a home).

:func:`startup_phases` turns them into seconds per phase; ``other_s`` is what the total start-up
(process start to a healthy server) leaves: Python imports, the API server, the tokenizer.
"""

from __future__ import annotations

import re

_LOAD_GPU = re.compile(r"Model loading took [\d.]+ \w+ memory and ([\d.]+) seconds")
_LOAD_WEIGHTS = re.compile(r"Loading weights took ([\d.]+) seconds")
_INIT_MODEL = re.compile(r"Initializing model took ([\d.]+) seconds")
_COMPILE = re.compile(r"torch\.compile took ([\d.]+) s in total")
_GRAPHS = re.compile(r"Graph capturing finished in ([\d.]+) secs")
_INIT_ENGINE = re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")
_DOWNLOAD = re.compile(r"Time spent downloading weights for \S+: ([\d.]+) seconds")
_CACHE_HIT = re.compile(r"Directly load the compiled graph\(s\)|Directly load AOT compilation")


def _first(pattern: re.Pattern[str], text: str) -> float | None:
    match = pattern.search(text)
    return float(match.group(1)) if match else None


def startup_phases(log: str, startup_s: float | None) -> dict[str, float]:
    """Seconds per start-up phase (only the phases vLLM logged), and ``compile_cache_hit`` (1 or 0)."""
    phases: dict[str, float] = {}
    download = _first(_DOWNLOAD, log)
    load = _first(_LOAD_GPU, log)
    if load is not None and download is not None:  # the GPU's clock ran through the download
        load = max(load - download, 0.0)
    if load is None:
        parts = [v for v in (_first(_LOAD_WEIGHTS, log), _first(_INIT_MODEL, log)) if v is not None]
        load = sum(parts) if parts else None
    if download is not None:
        phases["download_s"] = round(download, 3)
    compile_s = sum(float(m) for m in _COMPILE.findall(log)) or None
    graphs = _first(_GRAPHS, log)
    init_engine = _first(_INIT_ENGINE, log)
    if load is not None:
        phases["load_weights_s"] = round(load, 3)
    if compile_s is not None:
        phases["compile_s"] = round(compile_s, 3)
    if graphs is not None:
        phases["cuda_graphs_s"] = round(graphs, 3)
    if init_engine is not None:  # compilation and graph capture happen inside it
        phases["kv_profile_warmup_s"] = round(max(init_engine - (compile_s or 0.0) - (graphs or 0.0), 0.0), 3)
    if startup_s is not None and phases:
        phases["other_s"] = round(max(startup_s - sum(phases.values()), 0.0), 3)
    if phases:
        phases["compile_cache_hit"] = 1.0 if _CACHE_HIT.search(log) else 0.0
    return phases


# Where each phase starts, in vLLM 0.32's own words (the ends are the patterns above).
_LOADING = re.compile(r"Starting to load model")  # vllm/v1/worker/gpu_model_runner.py, cpu_model_runner.py
_DOWNLOADED = re.compile(r"Time spent downloading weights")  # vllm/model_executor/model_loader/weight_utils.py
_COMPILING = re.compile(r"for vLLM's torch\.compile|Dynamo bytecode transform time")  # vllm/compilation/backends.py
_CAPTURING = re.compile(r"Capturing CUDA graphs")  # vllm/v1/worker/gpu_model_runner.py (its progress bar)
_SERVING = re.compile(r"Starting vLLM server on|Available routes are")  # vllm/entrypoints/launchers/


def waiting_on(log: str) -> str:
    """The start-up phase an engine was still in, read from its log: the last phase vLLM logged as begun and not
    as finished, with the log's last line (what a start that ran out of time was waiting for)."""
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    last = f"; its last line: {lines[-1][-200:]}" if lines else ""
    if not lines:
        return "it logged nothing (the process had not started vLLM)"
    weights = _LOAD_GPU.search(log) or _LOAD_WEIGHTS.search(log)
    if _INIT_ENGINE.search(log):
        phase = (
            "the API server, after the engine was ready" if not _SERVING.search(log) else "the server to answer /health"
        )
    elif _CAPTURING.search(log) and not _GRAPHS.search(log):
        phase = "CUDA-graph capture"
    elif _COMPILING.search(log) and not _COMPILE.search(log):
        phase = "torch.compile"
    elif weights:
        phase = "the memory profile, the KV cache and warm-up (weights loaded)"
    elif _LOADING.search(log):
        downloaded = " (their download finished)" if _DOWNLOADED.search(log) else ""
        phase = f"the weights to download or load{downloaded}"
    else:
        phase = "vLLM's imports and engine start (no model loading begun)"
    return f"it was waiting for {phase}{last}"
