"""vLLM's LLM class as the P of a P/D pair, over HTTP. Runs in: the in-process producer.

Run by a vLLM venv's python (the standard library and vLLM only) with `vllm serve`'s
arguments: `LLM(...)` with VLLM_ENABLE_V1_MULTIPROCESSING=0 answers the proxy's P legs by
generate(), and /metrics reads its scheduler directly, in vLLM's names plus
`kvdrain:delayed_free_requests` and `kvdrain:engine_steps_total` (docs/inproc-producer.md).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

READY = "inproc producer ready "  # then its URL, in the log
MAX_BATCH = 64  # requests one generate() takes
POLL_S = 0.2  # how often the idle engine thread looks at the stop flag
REQUEST_TIMEOUT_S = 600.0  # a request's answer, at most
MAX_BODY_BYTES = 64 << 20
COMPLETIONS = "/v1/completions"
NIXL_COUNTERS = "vllm:nixl_num_"  # the frontend's own counters this /metrics passes on


class Pending:
    """One request between its HTTP handler and the engine thread."""

    def __init__(self, prompt: object, params: object) -> None:
        self.prompt = prompt
        self.params = params
        self.done = threading.Event()
        self.output: object = None
        self.error: str | None = None

    def finish(self, output: object = None, error: str | None = None) -> None:
        self.output, self.error = output, error
        self.done.set()


class Producer:
    """The LLM, its request queue and what its /metrics reads."""

    def __init__(self, llm: object, served: str, version: str) -> None:
        self.llm = llm
        self.served = served
        self.version = version
        self.requests: queue.Queue[Pending] = queue.Queue()
        self.stopping = threading.Event()
        self.num_steps = 0
        self.core = llm.llm_engine.engine_core.engine_core  # InprocClient's EngineCore
        step_fn = self.core.step_fn

        def counted_step():
            self.num_steps += 1
            return step_fn()

        self.core.step_fn = counted_step  # counts the steps InprocClient takes, changes none

    def run(self) -> None:
        """Each batch of waiting requests through one generate(), until stopped."""
        while not self.stopping.is_set():
            try:
                batch = [self.requests.get(timeout=POLL_S)]
            except queue.Empty:
                continue
            while len(batch) < MAX_BATCH and not self.requests.empty():
                batch.append(self.requests.get_nowait())
            self.generate(batch)

    def generate(self, batch: list[Pending]) -> None:
        try:
            outputs = self.llm.generate(
                [p.prompt for p in batch], [p.params for p in batch], use_tqdm=False
            )
        except Exception as e:  # the engine's error is each request's answer
            for p in batch:
                p.finish(error=f"{type(e).__name__}: {e}")
            return
        for p, output in zip(batch, outputs, strict=True):
            p.finish(output)

    def metrics(self) -> str:
        scheduler = self.core.scheduler
        running, waiting = request_counts(scheduler)
        held = max(len(scheduler.requests) - running - waiting, 0)
        cache = self.llm.llm_engine.vllm_config.cache_config
        labels = f'engine="0",model_name="{self.served}"'
        lines = [
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{labels}}} {scheduler.kv_cache_manager.usage!r}",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{labels}}} {running}",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{labels}}} {waiting}",
            "# TYPE vllm:cache_config_info gauge",
            f'vllm:cache_config_info{{block_size="{cache.block_size}",engine="0",'
            f'num_gpu_blocks="{cache.num_gpu_blocks}"}} 1.0',
            "# TYPE kvdrain:delayed_free_requests gauge",
            f"kvdrain:delayed_free_requests{{{labels}}} {held}",
            "# TYPE kvdrain:engine_steps_total counter",
            f"kvdrain:engine_steps_total{{{labels}}} {self.num_steps}",
        ]
        return "\n".join([*lines, *registry_counters(NIXL_COUNTERS)]) + "\n"


def request_counts(scheduler: object) -> tuple[int, int]:
    """(running, waiting) as vLLM's gauges count them (waiting includes KV-holding ones)."""
    counts = getattr(scheduler, "get_request_counts", None)
    if counts is not None:
        return counts()
    return len(scheduler.running), len(scheduler.waiting)


def registry_counters(prefix: str) -> list[str]:
    """The lines of the counters in prometheus_client's default registry whose names start
    with prefix (vLLM's frontend records there when log stats are on)."""
    from prometheus_client import REGISTRY, generate_latest

    kept = []
    for line in generate_latest(REGISTRY).decode().splitlines():
        name = line.split()[2] if line.startswith("# ") else line.split("{")[0].split(" ")[0]
        if name.startswith(prefix) and name.endswith("_total"):
            kept.append(line)
    return kept


def completion_request(body: dict) -> tuple[object, dict]:
    """(prompt for generate(), SamplingParams' arguments) of an OpenAI completion body;
    ValueError for what this producer does not serve."""
    if body.get("stream"):
        raise ValueError("the in-process producer answers P legs only: not streamed")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        prompt = {"prompt_token_ids": prompt}
    elif not isinstance(prompt, str):
        raise ValueError("prompt: a string or a list of token ids")
    params = {"max_tokens": int(body.get("max_tokens") or 16)}
    for key in ("temperature", "top_p", "seed", "ignore_eos"):
        if body.get(key) is not None:
            params[key] = body[key]
    if body.get("kv_transfer_params") is not None:
        params["extra_args"] = {"kv_transfer_params": body["kv_transfer_params"]}
    return prompt, params


def completion_answer(output: object, served: str) -> dict:
    """vLLM's completion answer for one RequestOutput, with its kv_transfer_params."""
    completion = output.outputs[0]
    num_prompt = len(output.prompt_token_ids or [])
    num_generated = len(completion.token_ids)
    return {
        "id": f"cmpl-{output.request_id}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": served,
        "choices": [
            {
                "index": 0,
                "text": completion.text,
                "logprobs": None,
                "finish_reason": completion.finish_reason,
                "stop_reason": completion.stop_reason,
            }
        ],
        "usage": {
            "prompt_tokens": num_prompt,
            "completion_tokens": num_generated,
            "total_tokens": num_prompt + num_generated,
        },
        "kv_transfer_params": output.kv_transfer_params,
    }


class Handler(BaseHTTPRequestHandler):
    """/health, /version, /v1/models, /metrics and POST /v1/completions."""

    protocol_version = "HTTP/1.1"
    producer: Producer  # set on the subclass main() makes

    def log_message(self, format: str, *args: object) -> None:
        pass  # a line per scrape would bury the engine's log

    def do_GET(self) -> None:
        p = self.producer
        if self.path == "/health":
            self.send(200, "")
        elif self.path == "/metrics":
            self.send(200, p.metrics(), "text/plain; version=0.0.4")
        elif self.path == "/version":
            self.send_json(200, {"version": p.version})
        elif self.path == "/v1/models":
            model = {"id": p.served, "object": "model", "owned_by": "vllm"}
            self.send_json(200, {"object": "list", "data": [model]})
        else:
            self.send_error_json(404, f"no such path: {self.path}")

    def do_POST(self) -> None:
        if self.path != COMPLETIONS:
            self.send_error_json(404, f"the in-process producer serves {COMPLETIONS} only")
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if not 0 < length <= MAX_BODY_BYTES:
                raise ValueError(f"a body of 1 to {MAX_BODY_BYTES} bytes")
            prompt, params = completion_request(json.loads(self.rfile.read(length)))
            from vllm import SamplingParams

            pending = Pending(prompt, SamplingParams(**params))
        except (ValueError, TypeError) as e:
            self.send_error_json(400, str(e))
            return
        self.producer.requests.put(pending)
        if not pending.done.wait(REQUEST_TIMEOUT_S):
            self.send_error_json(504, f"no answer within {REQUEST_TIMEOUT_S:g} s")
        elif pending.error is not None:
            self.send_error_json(500, pending.error)
        else:
            self.send_json(200, completion_answer(pending.output, self.producer.served))

    def send_json(self, status: int, body: dict) -> None:
        self.send(status, json.dumps(body), "application/json")

    def send_error_json(self, status: int, message: str) -> None:
        self.send_json(status, {"error": {"message": message, "code": status}})

    def send(self, status: int, text: str, content_type: str = "text/plain") -> None:
        data = text.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def parse_args(argv: list[str]):
    """`vllm serve`'s arguments: the model, --host, --port, and vLLM's EngineArgs."""
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # releases before the utils package was split
        from vllm.utils import FlexibleArgumentParser
    from vllm.engine.arg_utils import EngineArgs

    parser = FlexibleArgumentParser(prog="inproc_producer")
    parser.add_argument("model_tag")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    EngineArgs.add_cli_args(parser)
    return parser.parse_args(argv)


def build_llm(args) -> object:
    """LLM(...) from the parsed arguments: the in-process engine, with vLLM's defaults for
    whatever `vllm serve` would default too."""
    from vllm import LLM

    kwargs = {k: v for k, v in vars(args).items() if k not in ("model_tag", "host", "port")}
    kwargs["model"] = args.model_tag
    return LLM(**kwargs)


def main(argv: list[str]) -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # kvdrain's own
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    args = parse_args(argv)
    llm = build_llm(args)
    import vllm

    served = (args.served_model_name or [args.model_tag])[0]
    producer = Producer(llm, served, vllm.__version__)
    handler = type("BoundHandler", (Handler,), {"producer": producer})
    server = ThreadingHTTPServer((args.host, args.port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="http", daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: producer.stopping.set())
    print(f"{READY}http://{args.host}:{server.server_address[1]}", flush=True)
    try:
        producer.run()
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:  # argparse's
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # vLLM's and NIXL's threads would hold a plain exit
