# Fresh machine: `make run` trains the default recipe, `make test` runs the tests. Both install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= recipes/tiny.yaml
RUN_ARGS ?= --overwrite
PYTEST_ARGS ?=

.PHONY: install run test test-slow style quality bench clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	# torch==2.13.0 first, so nothing below pulls a multi-GB CUDA build by accident
	$(PY) -m pip install torch==2.13.0
	$(PY) -m pip install -r requirements.txt
	$(PY) -m pip install --no-deps -e .
	touch $(STAMP)

run: install
	$(PY) scripts/run_recipe.py $(RECIPE) $(RUN_ARGS)

test: install
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: install
	$(PY) -m pytest -q -m slow $(PYTEST_ARGS)

bench: install
	$(PY) scripts/benchmark.py --rounds 10 --chunk 5

style: install
	$(VENV)/bin/ruff format src scripts tests
	$(VENV)/bin/ruff check --fix src scripts tests

quality: install
	$(VENV)/bin/ruff check src scripts tests
	$(VENV)/bin/ruff format --check src scripts tests

clean:
	rm -rf runs .cache .pytest_cache
