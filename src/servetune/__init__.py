"""servetune: find the best way to serve an LLM with vLLM, by measuring it."""

__version__ = "0.2.0"
