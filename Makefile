# Two commands do the whole set-up on a fresh machine:
#   make demo   create .venv, install, run the demo
#   make test   create .venv, install, run the test suite
#
# TORCH is the torch requirement installed before the project, pinned so that every machine
# tests the same release. Override it for another build, for instance
#   make TORCH=torch demo                                                  (newest release)
#   make TORCH="torch --index-url https://download.pytorch.org/whl/cpu" test   (CPU-only wheel)

PYTHON ?= python3
TORCH ?= torch==2.13.0
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench install clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH)
	$(PY) -m pip install --quiet -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gossipd demo --nodes 3 --seconds 60

test: $(STAMP)
	$(PY) -m pytest -q

# Every benchmark (quick settings where a script has them; the straggler comparison needs its
# three repetitions): about 18 minutes on 2 cores (bench/wan.py's real-socket check needs root
# for ip netns, and says so and skips it without). Each prints a table and, last, one JSON
# line; the comparison benchmarks also write bench/results/<name>.json and .png.
bench: $(STAMP)
	$(PY) bench/channel.py
	$(PY) bench/membership.py --quick
	$(PY) bench/averaging.py --quick
	$(PY) bench/exchange.py --quick
	$(PY) bench/overhead.py --quick
	$(PY) bench/scale.py --quick
	$(PY) bench/nat.py --quick
	$(PY) bench/wan.py --quick
	$(PY) bench/efficiency.py --quick
	$(PY) bench/processes.py --quick
	$(PY) bench/straggler.py

clean:
	rm -rf $(VENV) build *.egg-info
