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

# `make parity` (never part of `make test`): vLLM 0.32.0's real v1 Scheduler beside
# kvdrain's, step by step, in a separate venv (about 2 GB; see
# ../shared/reference/vllm-parity.md). kvdrain is imported from the repo root, not
# installed. PYTHONHASHSEED=0: vLLM iterates some sets, so fix their order.
PARITY_VENV := .venv-parity
PARITY_PY := $(PARITY_VENV)/bin/python
PARITY_STAMP := $(PARITY_VENV)/.installed
PARITY_REQS ?= ../shared/reference/vllm-parity-requirements.txt
PARITY_ARGS ?= --seeds 10 --workload all

.PHONY: run test install bench clean parity traces

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

$(PARITY_STAMP): $(PARITY_REQS)
	$(PYTHON) -m venv $(PARITY_VENV)
	$(PARITY_PY) -m pip install -q torch==2.13.0
	$(PARITY_PY) -m pip install -q --no-deps vllm==0.32.0
	$(PARITY_PY) -m pip install -q --no-deps -r $(PARITY_REQS)
	touch $@

parity: $(PARITY_STAMP)
	PYTHONHASHSEED=0 PYTHONPATH=$(CURDIR) HF_HUB_OFFLINE=1 \
		$(PARITY_PY) -m tests.parity.run $(PARITY_ARGS)

# The two public traces (README, "Public traces") at traces/: a link to ../shared/traces when
# it is beside the clone, else downloaded from their upstream repositories at pinned commits
# and checked against their sha256 (about 30 MB).
MOONCAKE_URL := https://raw.githubusercontent.com/kvcache-ai/Mooncake/3b5a5941/FAST25-release/traces/conversation_trace.jsonl
AZURE_URL := https://raw.githubusercontent.com/Azure/AzurePublicDataset/b469a113/data/AzureLLMInferenceTrace_code.csv
traces:
	@if [ -e traces ]; then echo "traces/ is there"; \
	elif [ -d ../shared/traces ]; then ln -s ../shared/traces traces && echo "traces -> ../shared/traces"; \
	else mkdir -p traces && curl -fsSL -o traces/conversation_trace.jsonl $(MOONCAKE_URL) \
		&& curl -fsSL -o traces/AzureLLMInferenceTrace_code.csv $(AZURE_URL) \
		&& (cd traces && printf '%s\n' \
		'b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df  conversation_trace.jsonl' \
		'54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6  AzureLLMInferenceTrace_code.csv' \
		| sha256sum -c); fi

clean:
	rm -rf $(VENV) $(PARITY_VENV) *.egg-info .pytest_cache .hypothesis
