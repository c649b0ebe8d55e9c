# Two entry points for a newcomer: `make demo` and `make test`. Both create .venv and install
# what they need; on a machine without an NVIDIA GPU the CPU build of torch is pinned.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean

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
	$(PY) -m pytest

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
