"""Real `vllm serve` instances (and kvdrain's P/D proxy in front) launched, watched and torn down. Runs in: frontend process.

`replay --engine vllm` stands up the deployment that replay/commands/replay_vllm.py then
replays over HTTP:
- a virtualenv holding vLLM (`make vllm` makes .venv-vllm): its bin/vllm runs each
  instance, its bin/python says which vLLM it is (importlib.metadata, without importing
  vLLM);
- topology pd: P with the NixlConnector as kv_producer and D as kv_consumer, and
  `kvdrain proxy` in front (P gets max_tokens 1, D what P returned); single: one
  instance without a connector, replayed directly. Producer inproc runs each P as
  vLLM's LLM class in kvdrain's driver (inproc_producer.py, by the venv's python);
- every instance on its own free HTTP port and its own NIXL side-channel port (two on
  the default 5600: D's worker fails with "Address already in use" and its API server
  hangs), all of it on loopback (UCX over lo with sm,self,tcp), each bound to its own
  cores (VLLM_CPU_OMP_THREADS_BIND) or, on a GPU host, its own device;
- all instances start at once, each in its own session: vLLM spawns an engine core and
  a worker, so teardown signals the whole process group, SIGTERM then SIGKILL after
  STOP_TIMEOUT_S, and then any descendant that left the group; every path (a verdict,
  a signal, an instance that died, a start that failed) goes through close();
- an instance that exits or is not healthy within the start timeout is a VllmFault
  naming it, its log and the log's last lines. Logs stay in the run directory;
- a SIGKILL of kvdrain runs none of that, so the run directory also holds a record of
  every process started (replay/vllm/orphans.py), and each start first stops
  what a killed run's record names.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from engine.proc.lifetime import descendants
from engine.proc.run_dir import process_start_time
from replay.deploy.pd_flow import engine_roles
from replay.runtime.startup import StartupStarved, StartWatch
from replay.verify.text import printable
from replay.vllm.cpu import cpu_flags, sigill_hint, tiny_dtype
from replay.vllm.options import Producer, VllmOptions
from replay.vllm.orphans import Recorded, Swept, clear_record, sweep_orphans, write_record
from replay.vllm.tiny_model import NUM_WORDS, SERVED_NAME, write_tiny_model

STOP_TIMEOUT_S = 10.0  # SIGTERM to SIGKILL
GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default, per GPU
POLL_S = 0.25
RECORD_EVERY_S = 1.0  # how often start-up looks for new descendants to record
KV_CACHE_GIB = 1  # VLLM_CPU_KVCACHE_SPACE: 4,096 blocks of 128 for the tiny model
LOG_TAIL_LINES = 12
LOG_LINE_CHARS = 400  # a longer log line is shown cut
# A real vLLM's start-up, as its log shows it: the API server imports vLLM, then its engine
# core, then the worker, which loads the weights, sizes the KV cache and warms up.
PHASE_MARKS = (
    ("engine core", ("Initializing a V1 LLM engine",)),
    ("loading", ("Starting to load model", "Loading weights")),
)
PROXY_READY = "proxy ready "
TINY_SERVE_ARGS = (
    "--load-format",
    "dummy",
    "--max-model-len",
    "4096",
    "--max-num-seqs",
    "16",
    "--enforce-eager",
)
State = Literal["starting", "engine core", "loading", "ready", "exited"]
INPROC_PRODUCER = Path(__file__).resolve().parent / "inproc_producer.py"
PROGRAMS: dict[Producer, str] = {  # what runs an instance, as faults and the record name it
    "serve": "vllm serve",
    "inproc": "the in-process producer (vLLM's LLM class)",
}


class VllmVenvError(ValueError):
    """--vllm-venv does not hold vLLM (the CLI's exit 2)."""


class VllmFault(RuntimeError):
    """An instance (or the proxy) that died or never became healthy (the CLI's exit 4)."""

    def __init__(self, name: str, reason: str, log_path: Path, last_lines: list[str]) -> None:
        super().__init__(f"{name}: {reason}; log: {log_path}")
        self.name = name
        self.reason = reason
        self.log_path = log_path
        self.last_lines = last_lines


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmInstall:
    venv: Path
    vllm: Path  # bin/vllm
    python: Path  # bin/python
    version: str


def check_venv(venv: Path) -> VllmInstall:
    """The vLLM in venv, or VllmVenvError saying how to make one."""
    make = "run `make vllm` in kvdrain's checkout to create .venv-vllm, or give --vllm-venv DIR"
    venv = venv.absolute()  # the instances run in the run dir
    vllm, python = venv / "bin" / "vllm", venv / "bin" / "python"
    if not venv.is_dir():
        raise VllmVenvError(f"--vllm-venv {venv}: no such directory; {make}")
    if not (os.access(vllm, os.X_OK) and os.access(python, os.X_OK)):
        raise VllmVenvError(f"--vllm-venv {venv}: no bin/vllm and bin/python there; {make}")
    try:
        done = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(m.version('vllm'))"],
            capture_output=True,
            text=True,
            timeout=60,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise VllmVenvError(
            f"--vllm-venv {venv}: its python did not answer ({e}); {make}"
        ) from None
    if done.returncode != 0 or not done.stdout.strip():
        raise VllmVenvError(f"--vllm-venv {venv}: vLLM is not installed there; {make}")
    return VllmInstall(venv=venv, vllm=vllm, python=python, version=done.stdout.strip())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def core_sets(num_instances: int, cores: list[int]) -> list[list[int]]:
    """A distinct contiguous share of `cores` per instance (round robin when too few)."""
    if len(cores) < num_instances:
        return [[cores[i % len(cores)]] for i in range(num_instances)]
    share = len(cores) // num_instances
    return [cores[i * share : (i + 1) * share] for i in range(num_instances)]


def gpu_count() -> int:
    """GPUs nvidia-smi lists (0 without one)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        done = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return (
        sum(line.startswith("GPU ") for line in done.stdout.splitlines())
        if done.returncode == 0
        else 0
    )


def kv_transfer_config(kv_role: str | None, on_cpu: bool) -> str | None:
    """The NixlConnector in kv_role; on a CPU host its buffer in CPU memory, which vLLM
    0.12 and 0.13 (whose default is "cuda") need said."""
    if kv_role is None:
        return None
    config = {"kv_connector": "NixlConnector", "kv_role": kv_role}
    if on_cpu:
        config["kv_buffer_device"] = "cpu"
    return json.dumps(config)


@dataclass(slots=True, kw_only=True)
class InstanceSpec:
    """One instance: its name (P, D or E), command line, environment and log."""

    name: str
    kv_role: str | None  # kv_producer (a P), kv_consumer (a D), None (single: no connector)
    producer: Producer = "serve"  # inproc: a P run by the in-process driver
    port: int
    side_channel_port: int
    argv: list[str]
    env: dict[str, str]
    log_path: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def program(self) -> str:
        return PROGRAMS[self.producer]


def instance_env(
    base: dict[str, str],
    side_channel_port: int,
    cores: list[int],
    gpu: int | None,
    extra: tuple[tuple[str, str], ...],
) -> dict[str, str]:
    """base without PYTHONPATH (kvdrain's own packages must not shadow vLLM's imports),
    plus loopback NIXL/UCX, the instance's cores or device, then --vllm-env."""
    env = {k: v for k, v in base.items() if k != "PYTHONPATH"}
    env.update(
        {
            "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
            "VLLM_NIXL_SIDE_CHANNEL_PORT": str(side_channel_port),
            "UCX_NET_DEVICES": "lo",
            "UCX_TLS": "sm,self,tcp",
            "VLLM_NO_USAGE_STATS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = str(gpu)
    else:
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB),
                "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores)),
            }
        )
    env.update(dict(extra))
    return env


def gpu_share_args(num_instances: int, num_gpus: int, args: tuple[str, ...]) -> list[str]:
    """Instances that share a GPU split vLLM's default 0.9 of its memory (unless --vllm-arg
    sets it): two at 0.9 each, and the second runs out of memory at start."""
    if (
        num_gpus == 0
        or num_gpus >= num_instances
        or any(a.startswith("--gpu-memory-utilization") for a in args)
    ):
        return []
    per_gpu = -(-num_instances // num_gpus)
    return ["--gpu-memory-utilization", f"{GPU_MEMORY_UTILIZATION / per_gpu:.2f}"]


def plan_instances(
    options: VllmOptions,
    install: VllmInstall,
    model: str,
    run_dir: Path,
    base_env: dict[str, str],
    cores: list[int],
    num_gpus: int,
    flags: set[str] | None = None,
) -> list[InstanceSpec]:
    roles = engine_roles(options.topology)
    cpu_sets = core_sets(len(roles), cores)
    served = ["--served-model-name", SERVED_NAME] if options.model is None else []
    dtype = tiny_dtype(num_gpus, cpu_flags() if flags is None else flags)
    tiny = [*TINY_SERVE_ARGS, "--dtype", dtype] if options.model is None else []
    specs = []
    for i, (name, kv_role) in enumerate(roles):
        port, side = free_port(), free_port()
        kv = kv_transfer_config(kv_role, on_cpu=num_gpus == 0)
        producer = options.producer if kv_role == "kv_producer" else "serve"
        argv = [
            *program_argv(install, producer),
            model,
            *served,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *tiny,
            *(["--kv-transfer-config", kv] if kv else []),
            *gpu_share_args(len(roles), num_gpus, options.args),
            *options.args,
        ]
        env = instance_env(
            base_env, side, cpu_sets[i], i % num_gpus if num_gpus else None, options.env
        )
        if options.model is None:
            env["HF_HUB_OFFLINE"] = "1"  # a local model: nothing to download
        if producer == "inproc":
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the driver sets it too
        specs.append(
            InstanceSpec(
                name=name,
                kv_role=kv_role,
                producer=producer,
                port=port,
                side_channel_port=side,
                argv=argv,
                env=env,
                log_path=run_dir / f"{name}.log",
            )
        )
    return specs


def program_argv(install: VllmInstall, producer: Producer) -> list[str]:
    """What runs an instance, before its model and options: `vllm serve`, or the venv's
    python running the in-process driver (which takes `vllm serve`'s options)."""
    if producer == "inproc":
        return [str(install.python), str(INPROC_PRODUCER)]
    return [str(install.vllm), "serve"]


def last_lines(path: Path, n: int = LOG_TAIL_LINES) -> list[str]:
    """The log's last n lines that are not blank, as text to show: escape sequences written
    out (a vLLM log may end in clear-screen or set-title ones), each at most LOG_LINE_CHARS."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    lines = [line for line in text.splitlines() if line.strip()][-n:]
    return [printable(line, LOG_LINE_CHARS) for line in lines]


class ManagedProcess:
    """A child in its own session (so its group is its whole tree), logging to a file."""

    def __init__(
        self, name: str, argv: list[str], env: dict[str, str], log_path: Path, cwd: Path
    ) -> None:
        self.name = name
        self.log_path = log_path
        with open(log_path, "ab") as log:
            try:
                self.popen = subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except OSError as e:
                raise VllmFault(name, f"could not start {argv[0]}: {e}", log_path, []) from None
        self.start_time = process_start_time(self.popen.pid) or ""
        self.known: dict[
            int, str
        ] = {}  # descendants seen (pid: start time), in case one leaves the group

    @property
    def pid(self) -> int:
        return self.popen.pid

    def exit_code(self) -> int | None:
        return self.popen.poll()

    def note_descendants(self) -> None:
        if self.popen.poll() is None:
            for pid in descendants(self.pid):
                if pid not in self.known and (start := process_start_time(pid)) is not None:
                    self.known[pid] = start

    def recorded(self) -> list[Recorded]:
        """Itself (its session's leader) and its known descendants, for the run's record."""
        return [
            Recorded(name=self.name, pid=self.pid, start_time=self.start_time, leader=True),
            *(
                Recorded(name=f"{self.name} child", pid=pid, start_time=start)
                for pid, start in self.known.items()
            ),
        ]

    def signal_group(self, signum: int) -> None:
        for target in (self.pid, *self.known):
            try:
                os.killpg(target, signum) if target == self.pid else os.kill(target, signum)
            except (ProcessLookupError, PermissionError):
                pass

    def is_gone(self) -> bool:
        """The process is reaped and nothing of its group or its known descendants runs."""
        if self.popen.poll() is None:
            return False
        return not _group_alive(self.pid) and not any(_alive(p) for p in self.known)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode(errors="replace").rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return any(_pgid(int(e)) == pgid and _alive(int(e)) for e in os.listdir("/proc") if e.isdigit())


def _pgid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().decode(errors="replace").rpartition(")")[2].split()[2])
    except (OSError, ValueError, IndexError):
        return None


def stop_all(processes: list[ManagedProcess], timeout_s: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM every group, wait up to timeout_s for all, SIGKILL what is left, reap."""
    for p in processes:
        p.note_descendants()
        p.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(p.is_gone() for p in processes):
        time.sleep(0.05)
    for p in processes:
        if not p.is_gone():
            p.signal_group(signal.SIGKILL)
    deadline = time.monotonic() + timeout_s  # SIGKILL cannot be refused: this is short
    for p in processes:
        try:
            p.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    while time.monotonic() < deadline and not all(p.is_gone() for p in processes):
        time.sleep(0.05)


def probe_health(url: str, timeout_s: float = 1.0) -> bool:
    import urllib.error  # here: cli.py imports this module, and every engine process cli.py
    import urllib.request

    try:
        with urllib.request.urlopen(url + "/health", timeout=timeout_s) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError, ValueError):
        return False


@dataclass(slots=True, kw_only=True)
class InstanceStatus:
    """What the start-up view shows of one instance."""

    name: str
    state: State = "starting"
    since_s: float = 0.0  # seconds since the launch
    ready_s: float | None = None  # launch to healthy
    log_path: Path | None = None
    last_line: str = ""


@dataclass(slots=True, kw_only=True)
class Instance:
    spec: InstanceSpec
    process: ManagedProcess
    status: InstanceStatus = field(init=False)

    def __post_init__(self) -> None:
        self.status = InstanceStatus(name=self.spec.name, log_path=self.spec.log_path)

    def refresh(self, launched_at: float) -> None:
        """Update the status from the process, its /health and its log."""
        now = time.monotonic() - launched_at
        self.status.since_s = now
        tail = last_lines(self.spec.log_path, 1)
        self.status.last_line = tail[-1] if tail else ""
        if self.status.state in ("ready", "exited"):
            return
        if self.process.exit_code() is not None:
            self.status.state = "exited"
        elif probe_health(self.spec.url):
            self.status.state, self.status.ready_s = "ready", now
            self.process.note_descendants()
        else:
            self.status.state = _phase(self.spec.log_path, self.status.state)

    def fault(self) -> VllmFault | None:
        if self.status.state == "exited":
            reason = (
                f"{self.spec.program} exited with status {self.process.exit_code()} "
                "before it was healthy"
                f"{sigill_hint(self.spec.log_path)}"
            )
        else:
            return None
        return VllmFault(self.spec.name, reason, self.spec.log_path, last_lines(self.spec.log_path))


def _phase(path: Path, state: State) -> State:
    """The latest start-up phase the log shows (never an earlier one than state)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return state
    names = [name for name, _ in PHASE_MARKS]
    seen = [name for name, marks in PHASE_MARKS if any(mark in text for mark in marks)]
    latest = max(seen, key=names.index, default=None)
    if latest is None or (state in names and names.index(state) >= names.index(latest)):
        return state
    return latest


class VllmDeployment:
    """The instances and the proxy of one --engine vllm replay; a context manager whose
    exit tears everything down."""

    def __init__(
        self,
        options: VllmOptions,
        install: VllmInstall,
        run_dir: Path,
        base_env: dict[str, str] | None = None,
    ) -> None:
        self.options = options
        self.install = install
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        model = (
            options.model if options.model is not None else str(write_tiny_model(run_dir / "model"))
        )
        self.specs = plan_instances(
            options,
            install,
            model,
            run_dir,
            dict(base_env or os.environ),
            sorted(os.sched_getaffinity(0)),
            gpu_count(),
        )
        self.instances: list[Instance] = []
        self.proxy: ManagedProcess | None = None
        self.proxy_url: str | None = None
        self.proxy_log = run_dir / "proxy.log"
        self.launched_at = time.monotonic()
        self.swept: list[Swept] = []  # what killed runs had left, stopped by start()
        self._recorded: list[Recorded] = []

    @property
    def served_model(self) -> str | None:
        return SERVED_NAME if self.options.model is None else None

    @property
    def vocab_size(self) -> int | None:
        """The tiny model's words (the prompts' ids); None for a model given by the user."""
        return NUM_WORDS if self.options.model is None else None

    @property
    def log_paths(self) -> list[Path]:
        return [s.log_path for s in self.specs] + ([self.proxy_log] if len(self.specs) > 1 else [])

    def start(self, names: tuple[str, ...] | None = None) -> None:
        """Every instance (or those named: a benchmark's instance alone) and the proxy, at
        once, after stopping what killed runs left; each is recorded as soon as it runs."""
        self.swept = sweep_orphans()
        self.launched_at = time.monotonic()
        for spec in self.specs:
            if names is not None and spec.name not in names:
                continue
            process = ManagedProcess(spec.name, spec.argv, spec.env, spec.log_path, self.run_dir)
            self.instances.append(Instance(spec=spec, process=process))
            self.record()
        if len(self.specs) > 1 and len(self.instances) == len(self.specs):
            self.proxy = ManagedProcess(
                "proxy", self._proxy_argv(), self._proxy_env(), self.proxy_log, self.run_dir
            )
            self.record()

    def record(self, look: bool = False) -> None:
        """The run's record of its processes (look: with descendants not yet seen), when it changed."""
        if look:
            for p in self.processes():
                p.note_descendants()
        now = [r for p in self.processes() for r in p.recorded()]
        if now != self._recorded:
            write_record(self.run_dir, now)
            self._recorded = now

    def _proxy_argv(self) -> list[str]:
        argv = [sys.executable, "-m", "cli", "proxy"]
        for spec in self.specs:
            argv += ["--prefill" if spec.kv_role == "kv_producer" else "--decode", spec.url]
        return argv + ["--host", "127.0.0.1", "--port", "0"]

    def _proxy_env(self) -> dict[str, str]:
        root = str(Path(__file__).resolve().parents[2])  # where `-m cli` is found
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def wait_ready(
        self,
        on_tick: Callable[[list[InstanceStatus]], None] | None = None,
        on_note: Callable[[str], None] | None = None,
    ) -> None:
        """Until every instance is healthy and the proxy printed its address; VllmFault
        for the first that exits, stops or hangs (replay/runtime/startup.py), StartupStarved
        for one still starving at the start limit."""
        looked = time.monotonic()
        watch = StartWatch(self.options.start_limit_s, note=on_note)
        for instance in self.instances:
            spec = instance.spec
            watch.watch(spec.name, instance.process.pid, self.launched_at, spec.program)
        while True:
            for instance in self.instances:
                instance.refresh(self.launched_at)
                if instance.status.state != "ready":
                    self._judge_start(instance, watch)
            if time.monotonic() - looked >= RECORD_EVERY_S:
                self.record(look=True)
                looked = time.monotonic()
            if on_tick is not None:
                on_tick(self.statuses())
            for instance in self.instances:
                fault = instance.fault()
                if fault is not None:
                    raise fault
            self._check_proxy()
            if all(i.status.state == "ready" for i in self.instances) and (
                self.proxy is None or self.proxy_url is not None
            ):
                self.record(look=True)
                return
            time.sleep(POLL_S)

    def _judge_start(self, instance: Instance, watch: StartWatch) -> None:
        judgement = watch.check(instance.spec.name)
        if judgement is None or instance.fault() is not None:  # an exit says more
            return
        if not judgement.is_fault:
            raise StartupStarved(instance.spec.name, judgement.cause)
        log = instance.spec.log_path
        raise VllmFault(instance.spec.name, judgement.cause, log, last_lines(log))

    def _check_proxy(self) -> None:
        if self.proxy is None or self.proxy_url is not None:
            return
        for line in last_lines(self.proxy_log, 50):
            if line.startswith(PROXY_READY):
                self.proxy_url = line[len(PROXY_READY) :].strip()
                return
        code = self.proxy.exit_code()
        elapsed = time.monotonic() - self.launched_at
        if code is not None or elapsed > self.options.start_limit_s:
            reason = (
                f"exited with status {code}"
                if code is not None
                else f"printed no address within {elapsed:.0f} s"
            )
            raise VllmFault(
                "proxy", f"kvdrain proxy {reason}", self.proxy_log, last_lines(self.proxy_log)
            )

    def statuses(self) -> list[InstanceStatus]:
        return [i.status for i in self.instances]

    def dead(self) -> VllmFault | None:
        """An instance or the proxy that exited after start-up."""
        for p in [i.process for i in self.instances] + ([self.proxy] if self.proxy else []):
            code = p.exit_code()
            if code is not None:
                reason = f"exited with status {code} during the replay{sigill_hint(p.log_path)}"
                return VllmFault(p.name, reason, p.log_path, last_lines(p.log_path))
        return None

    @property
    def target_url(self) -> str:
        return self.proxy_url or self.specs[0].url

    def metrics(self) -> list[tuple[str, str]]:
        """(engine name, /metrics URL) of every instance."""
        return [(s.name, s.url + "/metrics") for s in self.specs]

    def instance_pids(self) -> list[int]:
        """Every vLLM instance's process and all below it (not the proxy)."""
        return [pid for i in self.instances for pid in (i.process.pid, *descendants(i.process.pid))]

    def processes(self) -> list[ManagedProcess]:
        return [i.process for i in self.instances] + ([self.proxy] if self.proxy else [])

    def close(self) -> None:
        """Stop everything; the record goes once nothing of it runs (else the next start's sweep)."""
        stop_all(self.processes())
        if all(p.is_gone() for p in self.processes()):
            clear_record(self.run_dir)

    def __enter__(self) -> VllmDeployment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
