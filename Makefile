# Two entry points for a newcomer: `make demo` and `make test`. Both create .venv and install
# what they need; on a machine without an NVIDIA GPU the CPU build of torch is pinned.
# `make test` runs every test; `make test-fast` leaves out tests/slow (the tests marked `slow`),
# `make test-slow` runs only those. PYTEST_ARGS passes options to pytest.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PYTEST_ARGS ?=
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-slow install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "no NVIDIA GPU: installing the CPU build of torch"; \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e ".[test]"
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/redknot demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -m slow $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
