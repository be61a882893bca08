"""A stand-in for `vllm serve` that speaks the protocol the launcher and the HTTP replay use. Runs in: a test's child process.

`fake_vllm.py serve MODEL --port N [...]` (other vLLM flags are accepted and ignored).
FAKE_VLLM_MODE picks its behaviour: `works` (default) serves /health, /v1/models,
/v1/completions (streamed or not; a request with kv_transfer_params.do_remote_decode
answers with the params D needs, as a NixlConnector P does) and /metrics
(vllm:kv_cache_usage_perc as a fraction, num_requests_running/waiting,
cache_config_info); `dies` exits 1 at start, its log ending in escape sequences; `hangs` never answers /health; `crashes`
exits at its third completion; `slow-metrics` answers every fourth /metrics after 2.5 s. Like vLLM,
it starts a child (its "engine core"), and it appends "PID CHILD_PID" to
FAKE_VLLM_PIDFILE, so a test can check both are gone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

from aiohttp import web

NUM_GPU_BLOCKS = 4096
DIES_WITH = "\x1b[2J\x1b]0;fake title\x07\u202eboom"  # clear screen, set title, bidi override


class Fake:
    def __init__(self, served: str) -> None:
        self.served = served
        self.running = 0
        self.num_done = 0
        self.num_scrapes = 0

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.served,
                        "object": "model",
                        "owned_by": "vllm",
                        "max_model_len": 4096,
                    }
                ],
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        self.num_scrapes += 1
        if os.environ.get("FAKE_VLLM_MODE") == "slow-metrics" and self.num_scrapes % 4 == 0:
            await asyncio.sleep(2.5)  # as a busy CPU vLLM's /metrics can be
        lines = [
            f'vllm:kv_cache_usage_perc{{engine="0"}} {self.running * 8 / NUM_GPU_BLOCKS}',
            f'vllm:num_requests_running{{engine="0"}} {self.running}',
            'vllm:num_requests_waiting{engine="0"} 0',
            f'vllm:cache_config_info{{block_size="128",num_gpu_blocks="{NUM_GPU_BLOCKS}"}} 1.0',
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        params = body.get("kv_transfer_params") or {}
        prompt = body["prompt"]
        num_prompt = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        max_tokens = 1 if params.get("do_remote_decode") else int(body.get("max_tokens") or 16)
        self.running += 1
        try:
            await asyncio.sleep(0.2)  # long enough for a 0.1 s scrape to see it
        finally:
            self.running -= 1
        self.num_done += 1
        if os.environ.get("FAKE_VLLM_MODE") == "crashes" and self.num_done == 3:
            print("fake engine core died mid-run", flush=True)
            os._exit(1)  # its child stays behind, as an engine core would
        usage = {
            "prompt_tokens": num_prompt,
            "completion_tokens": max_tokens,
            "total_tokens": num_prompt + max_tokens,
        }
        base = {
            "id": f"cmpl-{time.monotonic_ns()}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served,
        }
        if not body.get("stream"):
            out = {
                **base,
                "choices": [{"index": 0, "text": " w1" * max_tokens, "finish_reason": "length"}],
                "usage": usage,
            }
            if params.get("do_remote_decode"):
                out["kv_transfer_params"] = {
                    "do_remote_prefill": True,
                    "do_remote_decode": False,
                    "remote_block_ids": [1],
                    "remote_engine_id": "fake-p",
                    "remote_host": "127.0.0.1",
                    "remote_port": 1,
                }
            return web.json_response(out)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i in range(max_tokens):
            last = i == max_tokens - 1
            chunk = {
                **base,
                "choices": [
                    {"index": 0, "text": " w1", "finish_reason": "length" if last else None}
                ],
            }
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        if (body.get("stream_options") or {}).get("include_usage"):
            await response.write(
                b"data: " + json.dumps({**base, "choices": [], "usage": usage}).encode() + b"\n\n"
            )
        await response.write(b"data: [DONE]\n\n")
        return response


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("model")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--served-model-name", default=None)
    args, _ = parser.parse_known_args()
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    pidfile = os.environ.get("FAKE_VLLM_PIDFILE")
    if pidfile:
        with open(pidfile, "a") as f:
            f.write(f"{os.getpid()} {child.pid}\n")
    mode = os.environ.get("FAKE_VLLM_MODE", "works")
    print(f"fake vllm {mode}: Starting to load model {args.model}", flush=True)
    if mode == "dies":
        print("[rank0]: RuntimeError: fake engine core failed to start [/]", flush=True)
        print(DIES_WITH, flush=True)
        sys.exit(1)
    if mode == "hangs":
        time.sleep(3600)
    fake = Fake(args.served_model_name or args.model)
    app = web.Application()
    app.add_routes(
        [
            web.get("/health", fake.health),
            web.get("/v1/models", fake.models),
            web.get("/metrics", fake.metrics),
            web.post("/v1/completions", fake.completions),
        ]
    )
    web.run_app(app, host=args.host, port=args.port, print=None)


if __name__ == "__main__":
    main()
