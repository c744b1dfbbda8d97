# The README's two commands: `make run` and `make test`. Each builds .venv first when needed.
# `make test-gpu`: the suite on the GPU(s), from the source tree with the Python at hand (GPU_PY; no venv is
# built: a GPU machine may have no package index). conftest.py defaults to CPU, so JAX_PLATFORMS=cuda is set here;
# tests needing more devices than exist, or packages that are missing (mlx, the tokenizer package), skip with the
# reason (-rs lists them).
PY ?= python3
GPU_PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test test-gpu clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python -m dsv41_jax.generate --prompt "The capital of France is" --max-new-tokens 16

# Two workers, one test file each at a time (module fixtures stay in one process): the suite is compile-bound and
# single-threaded per test, so on CI's 2 cores this halves the wall time (measured 8.3 min vs ~17 min).
TEST_WORKERS ?= 2

test: $(STAMP)
	$(VENV)/bin/python -m pytest -n $(TEST_WORKERS) --dist loadfile

test-gpu:
	JAX_PLATFORMS=cuda PYTHONPATH=.$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m pytest -rs

clean:
	rm -rf $(VENV)
