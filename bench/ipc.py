"""Frontend <-> engine core throughput over ZMQ + msgpack vs in-process. Runs in: a bench process.

Usage: .venv/bin/python bench/ipc.py
The mock runner has no model cost, so this is the price of the process boundary (encode, send,
receive, decode, both ways). Rows: InprocClient (the reference), MPClient (one engine core
process) and the P/D topology through the router. Method and columns: bench/README.md.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import OtherLoad  # noqa: E402  (bench/common.py)

from engine.config import EngineConfig, KVTransferConfig  # noqa: E402
from engine.core.outputs import RequestOutput  # noqa: E402
from engine.proc.client import InprocClient, MPClient  # noqa: E402
from replay.deploy.topology import start_topology  # noqa: E402

NUM_REQUESTS = 2000
BURST = 200
PROMPT_LEN = 32
MAX_TOKENS = 16
REPEATS = 5
WARMUP = 20  # requests through each system before timing (imports, handshakes)
TIMEOUT_S = 60.0
CONFIG = EngineConfig(
    engine_id="E", num_blocks=4096, block_size=16, max_num_seqs=256, max_num_batched_tokens=8192
)
VOCAB = CONFIG.model.vocab_size


def prompt(i: int) -> list[int]:
    """Request number i's prompt; its first block differs from every other request's."""
    return [i // VOCAB, i % VOCAB] + [(3 * i + j) % VOCAB for j in range(PROMPT_LEN - 2)]


def expected(i: int) -> list[int]:
    last = prompt(i)[-1]
    return [(last + 1 + k) % VOCAB for k in range(MAX_TOKENS)]


def run_burst(
    add: Callable[[str, list[int], int], None], poll: Callable[[], list[RequestOutput]], ids: range
) -> int:
    """Send one burst at once, collect it to its last token; returns the number of output
    tokens, each checked against the mock runner's rule (a wrong or missing one raises)."""
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    for i in ids:
        add(f"r{i}", prompt(i), MAX_TOKENS)
    left, deadline = set(ids), time.monotonic() + TIMEOUT_S
    while left:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(left)} requests unfinished after {TIMEOUT_S} s")
        for output in poll():
            i = int(output.req_id.removeprefix("r"))
            tokens[i].extend(output.new_token_ids)
            if output.finished:
                left.discard(i)
    bad = [i for i in ids if tokens[i] != expected(i)]
    if bad:
        raise AssertionError(
            f"wrong tokens for {len(bad)} requests, e.g. r{bad[0]}: {tokens[bad[0]]}"
        )
    return sum(len(t) for t in tokens.values())


def run_all(add, poll) -> tuple[float, int]:
    """Warm up, then time NUM_REQUESTS in bursts REPEATS times; (median seconds, output tokens)."""
    run_burst(add, poll, range(WARMUP))
    times = []
    for repeat in range(REPEATS):
        start, num_tokens = time.perf_counter(), 0
        offset = WARMUP + repeat * NUM_REQUESTS  # fresh prompts: no prefix-cache hits
        for first in range(offset, offset + NUM_REQUESTS, BURST):
            num_tokens += run_burst(
                add, poll, range(first, min(first + BURST, offset + NUM_REQUESTS))
            )
        times.append(time.perf_counter() - start)
    return statistics.median(times), num_tokens


def measure_inproc() -> tuple[float, int]:
    client = InprocClient(CONFIG)
    try:
        return run_all(client.add_request, client.get_outputs)
    finally:
        client.shutdown()


def measure_mp() -> tuple[float, int]:
    client = MPClient(CONFIG)
    try:
        return run_all(client.add_request, lambda: client.get_outputs(0.1))
    finally:
        client.shutdown()


def measure_pd() -> tuple[float, int]:
    router = start_topology(CONFIG, KVTransferConfig(), "pd")
    try:
        return run_all(router.add_request, lambda: router.poll(0.1))
    finally:
        router.shutdown()


def main() -> None:
    load = OtherLoad()
    print(
        f"mock runner; {NUM_REQUESTS} requests, {PROMPT_LEN}-token prompts, "
        f"max_tokens {MAX_TOKENS}, bursts of {BURST}; median of {REPEATS} runs; "
        f"ratio = row / InprocClient"
    )
    print(f"{'system':<34} {'seconds':>8} {'req/s':>9} {'out tok/s':>10} {'ratio':>6}")
    rows = (
        ("InprocClient (reference)", measure_inproc),
        ("MPClient, 1 engine core process", measure_mp),
        ("P/D topology via router (2 engines)", measure_pd),
    )
    reference = None
    for name, measure in rows:
        seconds, num_tokens = measure()
        rps = NUM_REQUESTS / seconds
        reference = reference or rps
        print(
            f"{name:<34} {seconds:>8.2f} {rps:>9.0f} {num_tokens / seconds:>10.0f} "
            f"{rps / reference:>6.2f}"
        )
    print(load.report())


if __name__ == "__main__":
    main()
