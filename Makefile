# Two commands on a fresh machine: `make run` (the main job) and `make test`.
# Each creates .venv and installs what it needs the first time.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# With a GPU, pip's default torch (a CUDA build). Without, the pinned CPU build:
# an open range would pull a multi-GB CUDA build onto a machine that can't use it.
HAS_GPU := $(shell nvidia-smi -L >/dev/null 2>&1 && echo 1)
TORCH ?= $(if $(HAS_GPU),torch>=2.1,torch==2.13.0)

.PHONY: run test install bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[test,plot]'
	touch $@

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvdrain replay examples/pd_idle.jsonl

test: $(STAMP)
	$(PY) -m pytest

# NANO_VLLM=DIR (a checkout of GeeeekExplorer/nano-vllm) runs its scheduler beside ours.
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/scheduler_step.py $(if $(NANO_VLLM),--nano-vllm $(NANO_VLLM))

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .hypothesis
