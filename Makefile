# `make demo` and `make test` set everything up on a fresh machine: a .venv with torch==2.13.0
# installed first (a plain `torch` requirement would pull a multi-GB CUDA build), then the project.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo inspect lint test test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# make demo: a BPE tokenizer trained on 4 MB of the installed Python sources, those sources prepared
# with it, a CPU cost model of the demo LLaMA profiled as 4 ranks sharing the cores, then
# examples/configs/demo.toml trained on 4 CPU ranks with every strategy. Nothing is downloaded.
DEMO := .cache/demo
DEMO_SOURCES := $(DEMO)/sources.txt
DEMO_TOKENIZER := $(DEMO)/tokenizer/tokenizer.json
DEMO_DATA := $(DEMO)/data.json
DEMO_COST := $(DEMO)/cost_cpu.json

$(DEMO_SOURCES): $(STAMP)
	mkdir -p $(DEMO)
	$(PY) -c "from bytescale_compile.data import python_source_files as f; print(*f(4_000_000), sep='\n')" > $@

$(DEMO_TOKENIZER): $(DEMO_SOURCES)
	$(VENV)/bin/bytescale-compile tokenizer train --input $$(cat $(DEMO_SOURCES)) --vocab-size 4096 \
		--out $(DEMO)/tokenizer --overwrite

$(DEMO_DATA): $(DEMO_TOKENIZER)
	$(VENV)/bin/bytescale-compile data prepare --input $$(cat $(DEMO_SOURCES)) --tokenizer $(DEMO)/tokenizer \
		--out $(DEMO)/data --workers 2 --eval-fraction 0.05 --overwrite

$(DEMO_COST): $(STAMP)
	$(VENV)/bin/bytescale-compile profile examples.models.hf:llama_demo --lengths 256,1K,2K --repeats 1 \
		--ranks-per-device 4 --out $@

demo: $(DEMO_DATA) $(DEMO_COST)
	$(VENV)/bin/torchrun --nproc_per_node=4 -m bytescale_compile.train.compare --config examples/configs/demo.toml

inspect: $(STAMP)
	$(VENV)/bin/bytescale-compile inspect bytescale_compile.models.llama:small --seq-len 2048

# make lint: ruff (lint and format) and mypy, as CI runs them before the tests
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

# The unit tests are mostly single-threaded compilation: two pytest-xdist workers share the cores. The
# multi-process tests start their own ranks, so they run one at a time.
PYTEST_UNIT := $(PY) -m pytest -q -n 2 tests/unit
PYTEST_RANKS := $(PY) -m pytest -q tests/distributed tests/e2e

test: $(STAMP)
	$(PYTEST_UNIT) --durations=10
	$(PYTEST_RANKS) --durations=15

test-all: $(STAMP)
	BYTESCALE_SLOW=1 $(PYTEST_UNIT)
	BYTESCALE_SLOW=1 $(PYTEST_RANKS)

bench: $(STAMP)
	$(PY) benchmarks/loss_memory.py
	$(PY) benchmarks/compile_overhead.py
	$(PY) benchmarks/ring_attention.py
	$(PY) benchmarks/planner.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache
