# The two commands of the README: `make serve` and `make test` (the layer contracts of
# ARCHITECTURE.md, checked by lint-imports, then the whole suite).
# Both create .venv when missing and install what they need. torch is pinned to the
# local CPU build (2.13.0); an unpinned torch would pull a multi-GB CUDA build.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.deepinfer-installed

.PHONY: serve test install bench clean-venv

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c 'import torch' 2>/dev/null || $(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	@touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(VENV)/bin/deepinfer serve $(ARGS)

test: $(STAMP)
	$(VENV)/bin/lint-imports
	$(PY) -m pytest -q tests $(ARGS)

bench: $(STAMP)
	$(VENV)/bin/deepinfer bench $(ARGS)

clean-venv:
	rm -rf $(VENV)
