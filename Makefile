# The two commands: `make demo` (set up, run the main job on a built-in sample dataset)
# and `make test` (set up, lint, type-check, run the whole test suite).
# `make check` is the quick loop while working: lint, type-check, and the tests that need no server, daemon, root or
# network (-m "not slow": tests/conftest.py marks the others from what they use), in under 3 minutes.
# The venv is built from Debian's /usr/bin/python3 when present: an interpreter every user can run.
PY ?= $(shell test -x /usr/bin/python3 && echo /usr/bin/python3 || command -v python3)
VENV ?= .venv
BIN := $(VENV)/bin
# torch is pinned: 2.13.0 is a CPU wheel on this project's machines; an open range pulls a multi-GB CUDA build.
TORCH ?= torch==2.13.0

.PHONY: setup demo-setup demo test check lint bench bench-libraries gpu-wheels clean

setup: $(VENV)/.installed

# everything the tests need: DALI, the S3 test server, ruff, mypy (about 2 GB)
$(VENV)/.installed: pyproject.toml setup.py stagingloader/engine/fastcopy.c stagingloader/sources/fastscan.c \
		stagingloader/cache/fastcolumns.c
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test,dali]' '$(TORCH)'
	@$(BIN)/python -c 'import stagingloader.engine.fastcopy, stagingloader.sources.fastscan, stagingloader.cache.fastcolumns' \
		2>/dev/null || echo \
	"note: the compiled helpers were not built (no C compiler or Python headers: apt-get install gcc python3-dev);" \
	"small files copy, and folders are read, in Python"
	touch $@ $(VENV)/.demo-installed

demo-setup: $(VENV)/.demo-installed

# the demo needs only the light set: the core, torch (CPU) and Pillow
$(VENV)/.demo-installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[demo]' '$(TORCH)'
	touch $@

demo: demo-setup
	$(BIN)/stagingloader demo
	@echo "the command is $(VENV)/bin/stagingloader (or: source $(VENV)/bin/activate)"

lint: setup
	$(BIN)/ruff check stagingloader tests benchmarks examples
	$(BIN)/mypy

# strict skips are on in pyproject.toml: only tests marked gpu may skip (in make check too)
test: lint
	bash tests/support/install_slurm.sh  # Debian's Slurm, munge and fuse3, for the tests that start real daemons and mounts
	$(BIN)/python -m pytest -q

check: lint
	$(BIN)/python -m pytest -q -m "not slow"

bench: setup
	$(BIN)/python benchmarks/bench_stage.py
	$(BIN)/python benchmarks/bench_loader.py

bench-libraries:  # the loader against mosaicml-streaming and litdata, in a venv of their own
	$(PY) -m venv .venv-peers
	.venv-peers/bin/pip install -q -r benchmarks/peers-requirements.txt
	.venv-peers/bin/python benchmarks/bench_libraries.py

gpu-wheels:  # what the GPU machine may lack (it has no network): carry .gpu-wheels there; gpu_check.sh installs them
	for v in 3.10 3.11 3.12 3.13; do $(BIN)/pip download -q --only-binary=:all: --python-version $$v \
	  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
	  -d .gpu-wheels xxhash fsspec tqdm pytest pytest-timeout exceptiongroup tomli; done

clean:
	rm -rf $(VENV) stagingloader-demo
