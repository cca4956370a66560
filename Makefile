# Fresh machine: `make run` trains the default recipe, `make test` runs the tests. Both install what they need.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
RECIPE ?= recipes/tiny.yaml
RUN_ARGS ?=
# Which torch build `make install` puts in the venv (torch==2.13.0 either way; docs/CLUSTER.md):
#   TORCH=cpu   (default) the CPU build from torch's own CPU index: laptops, CI, CPU nodes (one 192 MB wheel)
#   TORCH=cuda  the package index's default Linux build, for GPU nodes (CUDA 13: 527 MB + 2.2 GB of nvidia wheels)
#   TORCH=pip   whatever your pip configuration serves (a mirror, a local wheel directory, a torch already in the venv)
TORCH ?= cpu
TORCH_FROM_cpu := --index-url https://download.pytorch.org/whl/cpu
TORCH_FROM_cuda :=
TORCH_FROM_pip :=
PYTEST_ARGS ?=

.PHONY: install run test test-slow style quality bench clean

install: $(STAMP)

$(STAMP): requirements.txt pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(if $(filter $(TORCH),cpu cuda pip),,$(error TORCH=$(TORCH): choose cpu, cuda or pip))
	# torch first, from the chosen index: the requirements below then find it installed and pull no other build
	$(PY) -m pip install torch==2.13.0 $(TORCH_FROM_$(TORCH))
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
