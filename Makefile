# Two commands do all set-up on a fresh machine:
#   make demo   - the main job on the embedded default
#   make test   - the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
# pytest workers (pytest-xdist): 2 keeps both cores of a 2-core machine busy while a test waits
# on a launch, a timeout or a sleeping rank (one worker leaves one core idle half the time)
TEST_JOBS ?= 2
PYTEST := OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_JOBS)

.PHONY: demo test venv simulate clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e ".[all]"
	touch $@

venv: $(BIN)/.installed

# The second leg: megatron-core 0.19.2 (cp312 wheels only; its wheel ships Megatron-LM's
# megatron/training) on a Python 3.12 found here: pyenv's 3.12.1, else python3.12 on PATH.
# torch 2.13.0 for 3.12 comes from PyPI (the CUDA build: large, runs on CPU too).
PY312 ?= $(firstword $(wildcard $(shell pyenv prefix 3.12.1 2>/dev/null)/bin/python3.12) \
                     $(shell command -v python3.12 2>/dev/null))
VENV312 := .venv312
BIN312 := $(VENV312)/bin
# the 3.12 leg: every test marked megatron (tests/conftest.py marks each test whose file imports
# or runs Megatron): the launcher running Megatron-LM's training loop, the example with
# DP/TP/SP/PP/VPP, the distributed optimizer, torch_dist checkpoints, MoE with EP, and the
# reliability, data and monitoring tests that reach Megatron
$(BIN312)/.installed: pyproject.toml
	test -x $(BIN312)/python || $(PY312) -m venv $(VENV312)
	$(BIN312)/pip install -q --upgrade pip
	$(BIN312)/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN312)/pip install -q -e ".[all]"
	touch $@

.PHONY: venv312 test312
# REQUIRE_312=1 (CI sets it): no Python 3.12 is an error, not a skipped leg
ifeq ($(strip $(PY312)),)
venv312:
	@echo "no Python 3.12 found (pyenv prefix 3.12.1, python3.12): megatron-core 0.19 leg skipped"
	@test -z "$(REQUIRE_312)" || { echo "REQUIRE_312 is set: failing" >&2; exit 1; }
test312: venv312
else
venv312: $(BIN312)/.installed
test312: venv312
	OMP_NUM_THREADS=1 $(BIN312)/python -m pytest -q -n $(TEST_JOBS) -m megatron tests
endif

# The demo runs where the README's Megatron-LM recipe runs too: .venv312 (Python 3.12,
# megatron-core 0.19.2 with Megatron-LM's megatron/training) when a Python 3.12 is found, else
# .venv (megatron-core 0.16.1: the DeepSpeed demo and the Megatron-core example, not the recipe).
# PORT=N sets the rendezvous port (default: a free one).
PORT ?=
DEMO_ARGS := $(if $(strip $(PORT)),--master_port $(PORT))
ifeq ($(strip $(PY312)),)
demo: venv
	@echo "demo: no Python 3.12 found (pyenv prefix 3.12.1, python3.12): running in .venv;" \
	      "the README's Megatron-LM recipe needs megatron-core 0.19 (Python 3.12): make venv312"
	$(BIN)/python tools/demo.py $(DEMO_ARGS)
else
demo: venv312
	@echo "demo: environment $(VENV312) (Python 3.12, megatron-core 0.19.2); the README's" \
	      "Megatron-LM recipe runs there too: . $(BIN312)/activate"
	$(BIN312)/python tools/demo.py $(DEMO_ARGS)
endif

simulate: venv
	$(BIN)/python tools/simulate.py --gpus 32 --gpus-per-node 8 --model llama-7b --hardware h200 --dist short --policy all

# both legs: the suite on Python 3.10/3.11 (megatron-core 0.16.1), then the Megatron tests on
# Python 3.12 (megatron-core 0.19.2)
test: venv
	$(PYTEST) tests
	$(MAKE) --no-print-directory test312

# the edit loop: single-process tests only (no rank launches); its time: docs/BENCHMARKS.md
.PHONY: test-fast
test-fast: venv
	$(PYTEST) -m "not slow" tests

clean:
	rm -rf $(VENV) $(VENV312) build *.egg-info
