"""What P pays while it holds delayed frees, per liveness policy. Runs in: a bench process.

Usage: .venv/bin/python bench/liveness.py [--runs N]   (method and columns: bench/README.md)
Every policy (legacy, poll, event), --runs times interleaved. A: the P/D topology; B: P alone,
this process as D's connector worker; then the zmq floor, the least a Python engine on zmq pays
per free. Aims: event's P CPU <= 5% of poll's in A and per free <= 1.25x the floor in B; event's
free p99 <= poll's p50; legacy holds, its D under 1,000 steps/s while loads wait.
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing
import os
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch
import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from common import CLK_TCK, OtherLoad  # noqa: E402  (bench/common.py)

from connector.messages import CONNECTOR_CODEC, KVReport, ReadDone, RecvSpec  # noqa: E402
from connector.transfer import Puller  # noqa: E402
from engine.config import EngineConfig, KVTransferConfig  # noqa: E402
from engine.core.outputs import RequestOutput  # noqa: E402
from engine.proc.client import MPClient, make_run_dir  # noqa: E402
from engine.proc.messages import CODEC, StatsSnapshot  # noqa: E402
from engine.runner.kv_cache import KVCache  # noqa: E402
from replay.deploy.topology import engine_configs, start_topology  # noqa: E402

POLICIES = ("legacy", "poll", "event")
NUM_REQUESTS = 32
SEND_GAP_S = 0.02  # part B
BLOCK_SIZE = 16
PROMPT_LEN = 64  # 4 blocks per request
MAX_TOKENS = 4
PULL_DELAY_S = 1.0
WINDOW_S = 3.0
NUM_CACHE_BLOCKS = 256


@dataclass(slots=True, kw_only=True)
class Result:
    policy: str
    cpu_s: dict[str, float]  # "P", "worker", maybe "D": schedstat, all threads
    ticks_s: dict[str, float]  # the same from /proc/<pid>/stat (10 ms resolution)
    io_s: dict[str, float]  # of cpu_s, libzmq's I/O threads' part
    wakeups_per_s: float  # over the window
    held_s: float  # window open -> the snapshot of the last free (the window if never)
    held_wakeups_per_s: float  # over held_s
    num_freed: int
    num_done: int  # A: user requests D finished; B: reads done
    blocks_held: int
    latencies_ms: list[float] | None = None  # B only
    d_wait_steps_per_s: float | None = None  # A only: D's steps/s while its loads wait


def cpu_seconds(pid: int) -> tuple[float, float, float]:
    """(schedstat run time of all threads, stat utime+stime, run time of libzmq's I/O
    threads alone) of one process, in seconds."""
    run_ns = io_ns = 0
    for task in glob.glob(f"/proc/{pid}/task/*"):
        try:
            with open(f"{task}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"{task}/comm") as f:
                is_io = f.read().startswith("ZMQbg/IO")
        except (OSError, ValueError, IndexError):
            continue  # a thread that exited between glob and open
        run_ns += ns
        io_ns += ns if is_io else 0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # the name may hold spaces
    return run_ns / 1e9, (int(fields[11]) + int(fields[12])) / CLK_TCK, io_ns / 1e9


def prompt(i: int) -> list[int]:
    return [i] + [(7 * i + j) % 500 for j in range(PROMPT_LEN - 1)]  # no shared prefixes


@dataclass(slots=True)
class Observer:
    """The frontend's view: outputs (handed to on_output) and every stats snapshot."""

    poll_outputs: Callable[[float], list[RequestOutput]]
    take_stats: Callable[[], list[StatsSnapshot]]
    request_stats: Callable[[], None]  # asks P
    on_output: Callable[[RequestOutput], None]
    request_stats_d: Callable[[], None] | None = None  # asks D (A only)
    history: dict[str, list[StatsSnapshot]] = field(default_factory=lambda: {"P": [], "D": []})

    def poll(self, timeout_s: float) -> None:
        for output in self.poll_outputs(timeout_s):
            self.on_output(output)
        for snap in self.take_stats():
            self.history[snap.engine_id].append(snap)

    def poll_until(self, deadline: float, tick: Callable[[], float] | None = None) -> None:
        """Poll until deadline; tick() does due work and says when it is next due."""
        while (left := deadline - time.monotonic()) > 0:
            due = tick() if tick is not None else deadline
            self.poll(max(0.0, min(left, 0.1, due - time.monotonic())))

    def stats_of(self, engine: str = "P", timeout_s: float = 5.0) -> StatsSnapshot:
        """A snapshot of P (or D) taken after this call (by its clock, ours too); bounded."""
        history = self.history[engine]
        asked = time.monotonic()
        (self.request_stats if engine == "P" else self.request_stats_d)()
        while not history or history[-1].monotonic < asked:
            if time.monotonic() > asked + timeout_s:
                raise TimeoutError(f"no stats from engine {engine} in {timeout_s} s")
            self.poll(0.02)
        return history[-1]

    def wait_for_d(
        self, predicate: Callable[[StatsSnapshot], bool], timeout_s: float = 10.0
    ) -> StatsSnapshot:
        """D's first requested snapshot that satisfies predicate; bounded."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            snap = self.stats_of("D")
            if predicate(snap):
                return snap
            self.poll(0.02)
        raise TimeoutError(f"engine D never got there in {timeout_s} s")


def num_freed(snap: StatsSnapshot) -> int:
    return snap.counts.get("num_sent", 0) + snap.counts.get("num_expired", 0)


def free_times(history: list[StatsSnapshot], n: int) -> list[float]:
    """times[k]: monotonic of P's first snapshot in which more than k requests were freed."""
    times: list[float] = []
    for snap in history:
        while len(times) < min(num_freed(snap), n):
            times.append(snap.monotonic)
    return times


def measure_window(
    obs: Observer, policy: str, pids: dict[str, int], tick: Callable[[], float] | None = None
) -> Result:
    """Traffic has stopped: WINDOW_S of polling, bracketed by snapshots and CPU readings."""
    snap0 = obs.stats_of()
    pids = dict(pids, worker=snap0.counts["connector_worker_pid"])
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    obs.poll_until(time.monotonic() + WINDOW_S, tick)
    cpu1 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    snap1 = obs.stats_of()
    last = next(
        (s for s in obs.history["P"] if s.seq > snap0.seq and num_freed(s) >= NUM_REQUESTS), snap1
    )

    def rate(a: StatsSnapshot, b: StatsSnapshot) -> float:
        return (b.num_wakeups - a.num_wakeups) / (b.monotonic - a.monotonic)

    return Result(
        policy=policy,
        cpu_s={n: cpu1[n][0] - cpu0[n][0] for n in pids},
        ticks_s={n: cpu1[n][1] - cpu0[n][1] for n in pids},
        io_s={n: cpu1[n][2] - cpu0[n][2] for n in pids},
        wakeups_per_s=rate(snap0, snap1),
        held_s=last.monotonic - snap0.monotonic,
        held_wakeups_per_s=rate(snap0, last),
        num_freed=num_freed(snap1),
        num_done=0,
        blocks_held=snap1.counts["num_used_blocks"],
    )


def measure_topology(policy: str) -> Result:
    kv = KVTransferConfig(pull_delay_ms=1000 * PULL_DELAY_S)
    router = start_topology(
        EngineConfig(num_blocks=NUM_CACHE_BLOCKS, block_size=BLOCK_SIZE, liveness=policy), kv, "pd"
    )
    try:
        done: set[str] = set()
        obs = Observer(
            router.poll,
            router.take_stats,
            router.clients["P"].request_stats,
            lambda o: done.add(o.req_id) if o.finished else None,
            router.clients["D"].request_stats,
        )
        for i in range(NUM_REQUESTS):
            router.add_request(f"r{i}", prompt(i), MAX_TOKENS)
        waiting = obs.wait_for_d(lambda s: s.counts["num_waiting_for_remote_kvs"] == NUM_REQUESTS)
        pids = {name: router.clients[name].process.pid for name in ("P", "D")}
        result = measure_window(obs, policy, pids)
        result.num_done = len(done)
        result.d_wait_steps_per_s = d_steps_per_s_while_waiting(obs.history["D"], waiting)
        return result
    finally:
        router.shutdown()


def d_steps_per_s_while_waiting(history: list[StatsSnapshot], first: StatsSnapshot) -> float:
    """D's steps per second from `first` (all loads waiting) to its first snapshot after
    a load landed (D publishes one whenever its counts change)."""
    landed = next(
        s
        for s in history
        if s.seq > first.seq and s.counts["num_waiting_for_remote_kvs"] < NUM_REQUESTS
    )
    return (landed.num_steps - first.num_steps) / (landed.monotonic - first.monotonic)


@dataclass(slots=True)
class Reader:
    """D's connector worker's _pull, in this process: pull over shm, then ReadDone."""

    local: KVCache
    puller: Puller
    due: list[tuple[float, dict]] = field(default_factory=list)  # (read at, P's params)
    sent_at: list[float] = field(default_factory=list)  # when each ReadDone was sent

    def on_output(self, output: RequestOutput) -> None:
        if output.finished and output.kv_transfer_params:
            self.due.append((time.monotonic() + PULL_DELAY_S, output.kv_transfer_params))

    def tick(self) -> float:
        """Reads what is due; returns when the next read is due."""
        while self.due and self.due[0][0] <= time.monotonic():
            _, params = self.due.pop(0)
            block_ids = params["remote_block_ids"]
            local_ids = list(range(1, len(block_ids) + 1))
            self.puller.pull(
                self.local,
                RecvSpec(
                    params["remote_request_id"],
                    local_ids,
                    block_ids,
                    params["remote_engine_id"],
                    params["remote_request_id"],
                    params["remote_addr"],
                ),
            )
            self.sent_at.append(time.monotonic())
            self.puller.link(params["remote_addr"]).send(ReadDone(params["remote_request_id"]))
        return self.due[0][0] if self.due else time.monotonic() + 1.0


def measure_reads(policy: str) -> Result:
    run_dir = make_run_dir()
    config = engine_configs(
        EngineConfig(num_blocks=NUM_CACHE_BLOCKS, block_size=BLOCK_SIZE, liveness=policy),
        KVTransferConfig(),
        "pd",
        run_dir,
    )[0]
    reader = Reader(
        KVCache.allocate(config.model, 8, BLOCK_SIZE, "cpu"), Puller(zmq.Context.instance(), "shm")
    )
    client = None
    try:
        client = MPClient(config, run_dir)
        obs = Observer(
            client.get_outputs, client.take_stats, client.request_stats, reader.on_output
        )
        start = time.monotonic()
        for i in range(NUM_REQUESTS):
            obs.poll_until(start + i * SEND_GAP_S, reader.tick)
            client.add_request(f"r{i}", prompt(i), 1, {"do_remote_decode": True})
        result = measure_window(obs, policy, {"P": client.process.pid}, reader.tick)
        freed = free_times(obs.history["P"], NUM_REQUESTS)
        result.latencies_ms = [1000 * (f - s) for s, f in zip(reader.sent_at, freed)]
        result.num_done = len(reader.sent_at)
        return result
    finally:
        reader.puller.close()
        reader.local.close()
        if client is not None:
            client.shutdown()
        shutil.rmtree(run_dir, ignore_errors=True)


def run_floor_echo(addr_in: str, addr_out: str) -> None:
    """The least a Python process on zmq does per report: wake on a PAIR, receive and
    decode a KVReport, send one StatsSnapshot (PUSH); no engine at all."""
    ctx = zmq.Context.instance()
    reports, snapshots = ctx.socket(zmq.PAIR), ctx.socket(zmq.PUSH)
    reports.connect(addr_in)
    snapshots.connect(addr_out)
    poller = zmq.Poller()
    poller.register(reports, zmq.POLLIN)
    counts = {f"num_count_{i}": i for i in range(24)}  # about as many as P's snapshot
    seq = 0
    while True:
        poller.poll()
        while reports.poll(0):
            data = reports.recv()
            if data == b"stop":
                return
            CONNECTOR_CODEC.decode(data)
            seq += 1
            snapshots.send(
                CODEC.encode(StatsSnapshot("P", seq, time.monotonic(), "blocked", seq, seq, counts))
            )


def measure_floor() -> tuple[float, float]:
    """CPU per report of run_floor_echo, NUM_REQUESTS reports SEND_GAP_S apart: all
    threads, and libzmq's I/O thread's part."""
    run_dir = make_run_dir()
    ctx = zmq.Context.instance()
    reports, snapshots = ctx.socket(zmq.PAIR), ctx.socket(zmq.PULL)
    reports.bind(f"ipc://{run_dir}/floor-in")
    snapshots.bind(f"ipc://{run_dir}/floor-out")
    proc = multiprocessing.get_context("spawn").Process(
        target=run_floor_echo, args=(f"ipc://{run_dir}/floor-in", f"ipc://{run_dir}/floor-out")
    )
    proc.start()
    try:
        report = KVReport(["r0"], [], [], {"num_sent": 1, "report_ns": time.monotonic_ns()})
        reports.send(CONNECTOR_CODEC.encode(report))
        if not snapshots.poll(30_000):
            raise TimeoutError("the floor process did not answer in 30 s")
        snapshots.recv()
        cpu0 = cpu_seconds(proc.pid)
        for _ in range(NUM_REQUESTS):
            reports.send(CONNECTOR_CODEC.encode(report))
            time.sleep(SEND_GAP_S)
            while snapshots.poll(0):
                snapshots.recv()
        cpu1 = cpu_seconds(proc.pid)
        return (cpu1[0] - cpu0[0]) / NUM_REQUESTS, (cpu1[2] - cpu0[2]) / NUM_REQUESTS
    finally:
        reports.send(b"stop")
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        reports.close(0)
        snapshots.close(0)
        shutil.rmtree(run_dir, ignore_errors=True)


def print_floor(runs: dict[str, list[Result]], floors: list[tuple[float, float]]) -> None:
    """Event's P CPU per report beside the zmq floor, and the ratio the floor allows;
    then the part of event's P that is libzmq's I/O thread (a report in, a snapshot
    out), as a share of poll's P CPU: no change to the engine's Python code goes under it."""
    floor = statistics.median(total for total, _ in floors)
    floor_main = statistics.median(total - io for total, io in floors)
    median = median_run(runs["event"])  # both from one run: a split of its CPU
    event, event_io = (x / max(1, median.num_freed) for x in (median.cpu_s["P"], median.io_s["P"]))
    poll = statistics.median(r.cpu_s["P"] for r in runs["poll"])
    print(
        f"zmq floor (a bare Python process: wake, receive and decode a report, send a snapshot): "
        f"{1e6 * floor:.0f} us per report over {len(floors)} runs; event's P: "
        f"{1e6 * event:.0f} us per free; {NUM_REQUESTS} x floor / poll's P cpu = "
        f"{NUM_REQUESTS * floor / poll:.3f} "
        "(the least event/poll could be here with one report per free)"
    )
    print(
        f"of event's P, libzmq's I/O thread: {1e6 * event_io:.0f} us per free; "
        f"{NUM_REQUESTS} x that / poll's P cpu = {NUM_REQUESTS * event_io / poll:.3f} "
        f"(the I/O thread alone, before any Python); left for the main thread within the aim "
        f"(1.25 x floor): {1e6 * (1.25 * floor - event_io):.0f} us per free, where the floor's "
        f"other threads (the main one, mostly) take {1e6 * floor_main:.0f} us"
    )
    print(f"event's P per free / zmq floor: {event / floor:.2f}x (aim <= 1.25)")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def median_run(runs: list[Result]) -> Result:
    """The run with the median P CPU, its free latencies replaced by every run's."""
    ordered = sorted(runs, key=lambda r: r.cpu_s["P"])
    median = ordered[(len(ordered) - 1) // 2]
    if median.latencies_ms is not None:
        pooled = [x for r in runs for x in (r.latencies_ms or [])]
        median = replace(median, latencies_ms=pooled)
    return median


def measure_runs(
    measure: Callable[[str], Result], num_runs: int, each_round: Callable[[], None] | None = None
) -> dict[str, list[Result]]:
    """Every policy num_runs times, interleaved (a burst of load hits all alike);
    each_round (another measurement) runs in every round too."""
    runs: dict[str, list[Result]] = {p: [] for p in POLICIES}
    for _ in range(num_runs):
        for policy in POLICIES:
            runs[policy].append(measure(policy))
        if each_round is not None:
            each_round()
    return runs


def print_runs(title: str, runs: dict[str, list[Result]], done_name: str, aim: str) -> None:
    """The median runs' table, then event/poll per run beside poll's wake-ups/s: poll's CPU
    scales with its wake-ups, and on a busy machine it sleeps longer than 1 ms, wakes less
    and its share shrinks. Free latencies pool every run's frees."""
    print_table(title, [median_run(r) for r in runs.values()], done_name)
    per_run = [e.cpu_s["P"] / p.cpu_s["P"] for e, p in zip(runs["event"], runs["poll"])]
    print(
        f"event/poll P cpu per run: {', '.join(f'{x:.3f}' for x in per_run)} "
        f"(median {statistics.median(per_run):.3f}, max {max(per_run):.3f}; {aim}); "
        f"poll wake-ups/s per run: {', '.join(f'{r.wakeups_per_s:.0f}' for r in runs['poll'])}"
    )
    event, poll = median_run(runs["event"]), median_run(runs["poll"])
    if event.latencies_ms and poll.latencies_ms:
        print(
            f"free latency over {len(runs['event'])} runs: "
            f"event p50 {percentile(event.latencies_ms, 50):.3f} "
            f"p99 {percentile(event.latencies_ms, 99):.3f} ms, "
            f"poll p50 {percentile(poll.latencies_ms, 50):.3f} "
            f"p99 {percentile(poll.latencies_ms, 99):.3f} ms; event p99 / poll p50 "
            f"{percentile(event.latencies_ms, 99) / percentile(poll.latencies_ms, 50):.2f} "
            "(aim <= 1)"
        )


def print_table(title: str, results: list[Result], done_name: str) -> None:
    print(f"\n{title}")
    has_d = "D" in results[0].cpu_s
    print(
        f"{'policy':<8} {'P cpu ms':>9} {'worker ms':>10}"
        + (f" {'D cpu ms':>9} {'D wait st/s':>11}" if has_d else "")
        + f" {'wakeups/s':>10} {'held s':>7} {'held wk/s':>10}"
        f" {'free p50 ms':>12} {'free p99 ms':>12}"
        f" {'freed':>6} {done_name:>7} {'P blocks held':>14}"
    )
    for r in results:
        cpu = {name: f"{1000 * s:.1f}" for name, s in r.cpu_s.items()}
        print(
            f"{r.policy:<8} {cpu['P']:>9} {cpu['worker']:>10}"
            + (f" {cpu['D']:>9} {r.d_wait_steps_per_s:>11.0f}" if has_d else "")
            + f" {r.wakeups_per_s:>10.1f} {r.held_s:>7.2f} {r.held_wakeups_per_s:>10.1f}"
            f" {_latency(r, 50):>12} {_latency(r, 99):>12} {r.num_freed:>3}/{NUM_REQUESTS:<2}"
            f" {r.num_done:>4}/{NUM_REQUESTS:<2} {r.blocks_held:>14}"
        )
    print_ratios({r.policy: r for r in results})
    print(
        "cross-check, utime+stime from /proc/<pid>/stat, 10 ms ticks (P / worker ms): "
        + ", ".join(
            f"{r.policy} {1000 * r.ticks_s['P']:.0f} / {1000 * r.ticks_s['worker']:.0f}"
            for r in results
        )
    )


def print_ratios(by: dict[str, Result]) -> None:
    poll, event = by["poll"], by["event"]
    p_and_worker = [r.cpu_s["P"] + r.cpu_s["worker"] for r in (event, poll)]
    ratios = [
        f"P cpu {event.cpu_s['P'] / poll.cpu_s['P']:.3f}",
        f"P+worker cpu {p_and_worker[0] / p_and_worker[1]:.3f}",
        f"wake-ups {event.wakeups_per_s / poll.wakeups_per_s:.4f}",
    ]
    if event.latencies_ms and poll.latencies_ms:
        ratios += [
            f"free p{q} {percentile(event.latencies_ms, q) / percentile(poll.latencies_ms, q):.2f}"
            for q in (50, 99)
        ]
    print("event/poll: " + ", ".join(ratios))


def _latency(r: Result, q: float) -> str:
    if r.latencies_ms is None:
        return "-"
    return f"{percentile(r.latencies_ms, q):.3f}" if r.latencies_ms else "never"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs", type=int, default=3, help="runs per policy and scenario (interleaved)"
    )
    num_runs = max(1, parser.parse_args().runs)
    load = OtherLoad()
    print(
        f"mock runner, shm transport; {NUM_REQUESTS} requests of "
        f"{PROMPT_LEN // BLOCK_SIZE} blocks; each read {PULL_DELAY_S:g} s after P finished it; "
        f"then {WINDOW_S:g} s of no traffic, measured on P; {num_runs} runs per policy, "
        "the median run shown"
    )
    print_runs(
        "A. P/D topology, 32 requests in one burst, D pulls with pull_delay_ms=1000 "
        "(free latency: see B)",
        measure_runs(measure_topology, num_runs),
        "D done",
        "aim <= 0.05",
    )
    # B's reads run torch ops in this process. With more than one thread, OpenMP's idle
    # threads spin after each op and, on two cores, keep P's worker and engine core off
    # the CPU just when they should handle the ReadDone that was sent: that would be
    # measured as P's latency. The reads are 16 KiB: one thread is plenty.
    torch.set_num_threads(1)
    floors: list[tuple[float, float]] = []  # the zmq floor, measured in B's rounds (interleaved)
    runs_b = measure_runs(measure_reads, num_runs, lambda: floors.append(measure_floor()))
    print_runs(
        f"B. P alone, this process reads as D's worker would; requests "
        f"{1000 * SEND_GAP_S:g} ms apart, one read, report and free each; "
        "free latency = P's free snapshot - ReadDone sent",
        runs_b,
        "read",
        "no aim: the zmq floor bounds it, see below",
    )
    print_floor(runs_b, floors)
    print(load.report())


if __name__ == "__main__":
    main()
