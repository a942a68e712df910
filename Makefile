# The two commands: `make demo` (set up, run the main job on a built-in sample dataset)
# and `make test` (set up, lint, type-check, run the whole test suite).
# The venv is built from Debian's /usr/bin/python3 when present: an interpreter every user can run.
PY ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned: 2.13.0 is a CPU wheel on this project's machines; an open range pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo test lint bench bench-peers clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,dali]' '$(TORCH)'
	touch $@

demo: setup
	$(BIN)/stagingloader demo

lint: setup
	$(BIN)/ruff check stagingloader tests benchmarks examples
	$(BIN)/mypy

test: lint
	bash tests/support/install_slurm.sh  # Debian's Slurm and munge, for the tests that start real daemons
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/bench_stage.py
	$(BIN)/python benchmarks/bench_loader.py

bench-peers:  # the loader against mosaicml-streaming and litdata, in a venv of their own
	$(PY) -m venv .venv-peers
	.venv-peers/bin/pip install -q -r benchmarks/peers-requirements.txt
	.venv-peers/bin/python benchmarks/bench_peers.py

clean:
	rm -rf $(VENV) stagingloader-demo
