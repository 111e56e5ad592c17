# Two commands do everything, set-up included:  make html  and  make test.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
CHAPTERS ?= $(sort $(wildcard tutorials/[0-9][0-9]-*.py))
SPHINXOPTS ?=
SPHINX := $(PY) -m sphinx -c . -W --keep-going $(SPHINXOPTS)

export PYTHONPATH := $(CURDIR)/tutorials
export MPLBACKEND := agg

.PHONY: help html notebooks test lint bench results-table clean distclean
help:
	@echo "make html           build the gallery into build/html, executing every chapter"
	@echo "make test           run every check: ruff, pytest, nbval on every notebook, the gallery build"
	@echo "make notebooks      write every chapter as a notebook into build/notebooks"
	@echo "make bench          on a GPU: run every chapter at full size and record results/"
	@echo "                    (CHAPTERS=tutorials/02-*.py ONLY=softmax-long-rows: just those)"
	@echo "make results-table  rewrite the README's results table from results/"
	@echo "make clean          remove what the builds wrote; distclean also removes $(VENV)"

# Set-up: one stamp per requirements file, so each target installs only what it needs.
$(VENV)/.runtime: requirements.txt tools/setup_env.py
	$(PYTHON) tools/setup_env.py $(VENV) requirements.txt
	touch $@
$(VENV)/.docs: $(VENV)/.runtime docs/requirements.txt
	$(PYTHON) tools/setup_env.py $(VENV) docs/requirements.txt
	touch $@
$(VENV)/.tests: $(VENV)/.docs tests/requirements.txt
	$(PYTHON) tools/setup_env.py $(VENV) tests/requirements.txt
	touch $@

html: $(VENV)/.docs
	$(SPHINX) -b html docs build/html
	@echo "Gallery: build/html/index.html"

notebooks: $(VENV)/.docs
	$(PY) tools/make_notebooks.py build/notebooks

lint: $(VENV)/.tests
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

test: lint notebooks
	$(PY) -m pytest tests
	$(PY) -m pytest --nbval-lax --nbval-current-env build/notebooks
	$(SPHINX) -b html docs build/html

bench: $(VENV)/.runtime
	@$(PY) -c "import torch; assert torch.cuda.is_available(), 'make bench needs a GPU'"
	set -e; for chapter in $(CHAPTERS); do \
		echo "== $$chapter"; KIT_RECORD=1 KIT_ONLY="$(ONLY)" KIT_COMMAND="make bench" \
		$(PY) $$chapter; done
	$(MAKE) results-table

results-table: $(VENV)/.runtime
	$(PY) tools/results_table.py README.md

clean:
	rm -rf build docs/tutorials docs/sg_execution_times.rst
distclean: clean
	rm -rf $(VENV)
