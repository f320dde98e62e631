"""What a bench needs to run one of its own functions inside vLLM's worker (``LLM.collective_rpc``): vLLM pickles
the function by reference, so the worker must import the bench file under its module name. Shared by
``lora_vllm.py``, ``draft_vllm.py`` and ``mtp_vllm.py``; not a bench itself."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path
from types import ModuleType


def importable_in_workers(module: str) -> ModuleType:
    """``bench/MODULE.py`` imported under its module name, with ``bench/`` on the path this process's vLLM workers
    inherit (``PYTHONPATH``), vLLM's pickling of functions allowed, and 1 GiB of CPU KV cache unless set."""
    here = str(Path(__file__).resolve().parent)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if here not in sys.path:
        sys.path.insert(0, here)
    return importlib.import_module(module)
