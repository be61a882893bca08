"""Parity harness: kvdrain's pure core beside vLLM's real v1 Scheduler and AsyncScheduler (`make parity`, `make parity-all`)."""

import os

# Before anything imports vLLM: offline, and quiet (its load-failure warnings are expected).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
