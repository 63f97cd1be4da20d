# Two commands do the whole set-up on a fresh machine:
#   make demo   create .venv, install, run the demo
#   make test   create .venv, install, run the test suite
#
# TORCH pins the torch wheel installed before the project. The default is a release whose
# CPU build is fast to install; `make TORCH=torch` takes whatever pip picks (CUDA on Linux).

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH)"
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) examples/two_nodes.py

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/channel.py

clean:
	rm -rf $(VENV) build *.egg-info
