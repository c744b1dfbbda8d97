# The README's two commands: `make run` and `make test`. Each builds .venv first when needed: `make run` installs
# the package with its runtime dependencies only, `make test` adds the test extra (pytest, xdist, the mlx
# oracles, the OpenAI client). One stamp file each: `make run` then `make test` installs the extra once; `make
# test` then `make run` installs nothing more (the test install holds the runtime one).
# `make test` leaves out the tests marked `slow` (they guard no user path: benchmarks' runs, worlds, layouts and
# configs beyond the one a path needs); `make test-all` runs every test, as `make test-gpu` does.
# `make test-gpu`: the suite on the GPU(s), from the source tree with the Python at hand (GPU_PY; no venv is
# built: a GPU machine may have no package index). conftest.py defaults to CPU, so JAX_PLATFORMS=cuda is set here;
# tests needing more devices than exist, or packages that are missing (mlx, the tokenizer package), skip with the
# reason (-rfEs lists them with the failures). Two passes: GPU_WORKERS processes share the GPU (memory taken as needed, not
# preallocated; the tests compile on the host's cores) for every test but those marked `gpu_memory`, which then
# run alone in one process (each holds ~22 GB: beside other workers' memory pools they ran out of memory).
PY ?= python3
GPU_PY ?= python3
VENV := .venv
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run lint test test-all test-gpu clean

$(VENV)/bin/python:
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip

$(RUN_STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e .
	touch $@

$(TEST_STAMP): pyproject.toml | $(VENV)/bin/python
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $@ $(RUN_STAMP)  # the runtime install is part of this one

run: $(RUN_STAMP)
	$(VENV)/bin/python -m dsv41_jax.generate --prompt "KING HENRY. My lords," --max-new-tokens 40

# Two workers, one test file each at a time (module fixtures stay in one process): the suite is compile-bound and
# single-threaded per test, so on CI's 2 cores this halves the wall time (measured 8.3 min vs ~17 min).
TEST_WORKERS ?= 2
PYTEST_CPU = $(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile

lint: $(TEST_STAMP)
	$(VENV)/bin/python -m ruff check .

test: lint
	$(PYTEST_CPU) -m "not slow"

test-all: $(TEST_STAMP)
	$(PYTEST_CPU)

GPU_WORKERS ?= 8
GPU_PYTEST = JAX_PLATFORMS=cuda XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} \
	$(GPU_PY) -m pytest -rfEs

test-gpu:
	$(GPU_PYTEST) -n $(GPU_WORKERS) --dist loadfile -m "not gpu_memory"; shared=$$?; \
	$(GPU_PYTEST) -p no:xdist -m gpu_memory && exit $$shared

clean:
	rm -rf $(VENV)
