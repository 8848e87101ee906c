# Two commands do all set-up on a fresh machine:
#   make demo   - the main job on the embedded default
#   make test   - the test suite
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: demo test venv simulate clean

$(BIN)/.installed: setup.py
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(BIN)/pip install -q -e ".[all]"
	touch $@

venv: $(BIN)/.installed

demo: venv
	$(BIN)/python tools/demo.py

simulate: venv
	$(BIN)/python tools/simulate.py --gpus 32 --gpus-per-node 8 --model llama-7b --hardware h200 --dist short --policy all

test: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q tests

# the edit loop: single-process tests only (no rank launches), under 3 minutes
.PHONY: test-fast
test-fast: venv
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -m "not slow" tests

clean:
	rm -rf $(VENV) build *.egg-info
