# `make demo` and `make test` set everything up on a fresh machine: a .venv with torch==2.13.0
# installed first (a plain `torch` requirement would pull a multi-GB CUDA build), then the project.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo inspect test test-all bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

COST := .cache/cost_small_cpu.json

$(COST): $(STAMP)
	mkdir -p .cache
	$(VENV)/bin/bytescale-compile profile examples.models.llama:small --lengths 256,512,1K,2K,4K --repeats 2 \
		--ranks-per-device 4 --out $(COST)

demo: $(STAMP) $(COST)
	$(VENV)/bin/torchrun --nproc_per_node=4 examples/train.py --strategy all --steps 3 --global-tokens 16K \
		--cost-model $(COST)

inspect: $(STAMP)
	$(VENV)/bin/bytescale-compile inspect examples.models.llama:small --seq-len 2048

test: $(STAMP)
	$(PY) -m pytest -q

test-all: $(STAMP)
	BYTESCALE_SLOW=1 $(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/loss_memory.py
	$(PY) benchmarks/compile_overhead.py
	$(PY) benchmarks/ring_attention.py
	$(PY) benchmarks/planner.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .cache
