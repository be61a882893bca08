"""vLLM's `LLM` class, faked for kvdrain's in-process producer. Runs in: a test's child process.

The attributes the driver reads are vLLM's: llm.llm_engine.engine_core.engine_core is the
EngineCore, with step_fn and a scheduler (requests, running, waiting, get_request_counts,
kv_cache_manager.usage); llm.llm_engine.vllm_config.cache_config. generate() adds the
requests, steps until none runs and returns; a P request (kv_transfer_params with
do_remote_decode) keeps its blocks after it finished, until a later step frees them (D
has read them at once here). FAKE_LLM_MODE: `holds` (default) steps only inside
generate(), as vLLM's in-process engine does, so P's blocks stay held while idle; `frees`
also steps every FREE_AFTER_S while blocks are held, as an engine that keeps stepping
does; `dies` raises at construction; `hangs` never finishes constructing. Like vLLM it
starts a child, and appends "PID CHILD_PID" to FAKE_VLLM_PIDFILE.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

__version__ = "0.32.0+fake"
NUM_GPU_BLOCKS = 4096
BLOCK_SIZE = 128
FREE_AFTER_S = 0.05


class SamplingParams:
    def __init__(self, max_tokens: int = 16, extra_args: dict | None = None, **_: object):
        self.max_tokens = max_tokens
        self.extra_args = extra_args or {}


class KVCacheManager:
    def __init__(self) -> None:
        self.num_used = 0

    @property
    def usage(self) -> float:
        return self.num_used / (NUM_GPU_BLOCKS - 1)


class Scheduler:
    def __init__(self) -> None:
        self.requests: dict[str, int] = {}  # request id: its blocks
        self.running: list[str] = []
        self.waiting: list[str] = []
        self.held: list[str] = []  # finished, blocks kept for D
        self.kv_cache_manager = KVCacheManager()

    def get_request_counts(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)


class EngineCore:
    def __init__(self) -> None:
        self.scheduler = Scheduler()
        self.lock = threading.Lock()
        self.step_fn = self.step

    def step(self) -> tuple[dict, bool]:
        """Frees what D has read, runs what waits, and finishes it (P's kept, held)."""
        s = self.scheduler
        with self.lock:
            for rid in s.held:
                s.kv_cache_manager.num_used -= s.requests.pop(rid)
            s.held = []
            s.running, s.waiting = s.waiting, []
            for rid in s.running:
                s.kv_cache_manager.num_used += s.requests[rid]
            s.held, s.running = s.running, []
        return {}, True


class Namespace:
    def __init__(self, **values: object) -> None:
        self.__dict__.update(values)


class LLM:
    def __init__(self, model: str, **kwargs: object) -> None:
        print("Initializing a V1 LLM engine (fake)", flush=True)
        start_child()
        print(f"Starting to load model {model}", flush=True)
        mode = os.environ.get("FAKE_LLM_MODE", "holds")
        if mode == "dies":
            raise RuntimeError("fake in-process engine failed to start")
        if mode == "hangs":
            time.sleep(3600)
        cache = Namespace(block_size=BLOCK_SIZE, num_gpu_blocks=NUM_GPU_BLOCKS)
        self.llm_engine = Namespace(
            engine_core=Namespace(engine_core=EngineCore()),
            vllm_config=Namespace(cache_config=cache),
        )
        self.num_requests = 0
        register_nixl_counter()
        if mode == "frees":
            threading.Thread(target=self._keep_stepping, daemon=True).start()

    @property
    def core(self) -> EngineCore:
        return self.llm_engine.engine_core.engine_core

    def generate(self, prompts: list, params: list, use_tqdm: bool = True) -> list:
        ids = []
        for prompt in prompts:
            self.num_requests += 1
            rid = str(self.num_requests)
            tokens = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.split()
            with self.core.lock:
                self.core.scheduler.requests[rid] = -(-len(tokens) // BLOCK_SIZE)
                self.core.scheduler.waiting.append(rid)
            ids.append((rid, len(tokens)))
        self.core.step_fn()
        return [output(rid, n, p) for (rid, n), p in zip(ids, params, strict=True)]

    def _keep_stepping(self) -> None:
        while True:
            time.sleep(FREE_AFTER_S)
            if self.core.scheduler.held:
                self.core.step_fn()


def output(rid: str, num_prompt: int, params: SamplingParams) -> Namespace:
    remote = (params.extra_args.get("kv_transfer_params") or {}).get("do_remote_decode")
    completion = Namespace(text=" w1", token_ids=[1], finish_reason="length", stop_reason=None)
    kv = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [[1]],
        "remote_engine_id": "fake-inproc",
        "remote_host": "127.0.0.1",
        "remote_port": 1,
    }
    return Namespace(
        request_id=rid,
        prompt_token_ids=list(range(num_prompt)),
        outputs=[completion],
        kv_transfer_params=kv if remote else None,
    )


def start_child() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    pidfile = os.environ.get("FAKE_VLLM_PIDFILE")
    if pidfile:
        with open(pidfile, "a") as f:
            f.write(f"{os.getpid()} {child.pid}\n")


def register_nixl_counter() -> None:
    """vLLM's frontend registers its NIXL counters in prometheus_client's default registry."""
    from prometheus_client import Counter

    counter = Counter(
        "vllm:nixl_num_kv_expired_reqs", "Requests whose KV lease expired.", ["engine"]
    )
    counter.labels(engine="0")
