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

.PHONY: demo test bench install clean gpu-check gpu-wheels deploy-check

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
# three repetitions): about 42 minutes on 2 cores, 21 of them bench/lowcomm.py --quick's
# 1M-parameter language model (the rest took 15 to 18 before it; bench/flood.py --quick's
# floods about 2). bench/wan.py's real-socket
# check needs root for ip netns, and says so and skips it without. Each prints a table and,
# last, one JSON line; the comparison benchmarks also write bench/results/<name>.json and .png.
bench: $(STAMP)
	$(PY) bench/channel.py
	$(PY) bench/membership.py --quick
	$(PY) bench/averaging.py --quick
	$(PY) bench/exchange.py --quick
	$(PY) bench/overhead.py --quick
	$(PY) bench/scale.py --quick
	$(PY) bench/nat.py --quick
	$(PY) bench/flood.py --quick
	$(PY) bench/wan.py --quick
	$(PY) bench/efficiency.py --quick
	$(PY) bench/lowcomm.py --quick
	$(PY) bench/processes.py --quick
	$(PY) bench/pipeline.py --quick
	$(PY) bench/straggler.py

# The checks that need a GPU (bench/gpu_check.py: the CUDA tests, the demo twice, the overhead
# and exchange benchmarks on the GPU, 5 minutes on one H200; and lowcomm's short form on the
# GPU, not yet run on one, given 6 minutes), with the machine's own
# python3 and its CUDA build of torch, no venv and no network. WHEELS: a folder of wheels for
# the rest (make gpu-wheels makes one); without a GPU it says so and exits 0.
#   make gpu-check WHEELS=/path/to/wheels
gpu-check:
	$(PYTHON) bench/gpu_check.py $(if $(WHEELS),--wheels $(WHEELS)) $(GPU_CHECK)

# On a machine with network access: download into WHEELS what gpu-check installs on a GPU
# machine (Linux x86-64) of Python PYVER, torch and its CUDA libraries excepted.
#   make gpu-wheels WHEELS=wheels PYVER=3.12
PYVER ?= 3.12
GPU_WHEELS := trio outcome sniffio sortedcontainers attrs idna cbor2 cryptography cffi \
	pycparser prometheus_client pytest pluggy iniconfig packaging pytest-trio pytest-timeout \
	hypothesis PyYAML numpy scipy scikit-learn joblib threadpoolctl
gpu-wheels:
	@test -n "$(WHEELS)" || { echo "make gpu-wheels WHEELS=dir [PYVER=3.12]"; exit 2; }
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version $(PYVER) \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 --platform any -d $(WHEELS) $(GPU_WHEELS)

# The deployment files run for real (deploy/check/__main__.py): the image built with podman
# from a base made with debootstrap, the compose swarm, the systemd unit in a booted system
# under systemd-nspawn, the StatefulSet's pods under podman kube play. Needs root; installs
# podman, debootstrap and systemd-container with apt where missing; about 20 minutes the first
# time, less once its cache (~/.cache/gossipd-deploy-check) holds the base system. Not part
# of make test. Says why and skips where it cannot run.
#   make deploy-check [DEPLOY_CHECK="--only compose"]
deploy-check: $(STAMP)
	$(PY) deploy/check $(DEPLOY_CHECK)

clean:
	rm -rf $(VENV) build *.egg-info
