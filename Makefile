# The README's two commands: `make run` and `make test`. Each builds .venv first when needed.
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -m pip install -q -e ".[test]"
	touch $(STAMP)

run: $(STAMP)
	$(VENV)/bin/python -m dsv41_jax.generate --prompt "The capital of France is" --max-new-tokens 16

test: $(STAMP)
	$(VENV)/bin/python -m pytest

clean:
	rm -rf $(VENV)
