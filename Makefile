# make install   create .venv and install the suite (torch first: TORCH_SPEC picks the build)
# make bench     run a matrix (MATRIX=smoke by default) and write results/<matrix>/
# make list      print a matrix's plan      make report   regenerate its leaderboard
# make test      CPU tests                  make lint     ruff + mypy
MATRIX ?= smoke
TORCH_SPEC ?= torch==2.13.0
VENV ?= .venv
PY ?= $(shell test -x $(VENV)/bin/python && echo $(VENV)/bin/python || echo python3)
ARGS ?=

.PHONY: install bench list report test test-gpu lint

install:
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	$(VENV)/bin/python -c "import torch" 2>/dev/null || $(VENV)/bin/python -m pip install -q "$(TORCH_SPEC)"
	$(VENV)/bin/python -m pip install -q -e ".[dev,plots,bnb]"

bench:
	$(PY) -m bench run $(MATRIX) $(ARGS)

list:
	$(PY) -m bench list $(MATRIX)

report:
	$(PY) -m bench report $(MATRIX)

test:
	$(PY) -m pytest -q

test-gpu:
	$(PY) -m pytest -q -m gpu

lint:
	$(PY) -m ruff check bench tests
	$(PY) -m mypy bench
