"""The kvdrain command line: every verb's happy path and its usage errors."""

from __future__ import annotations

import json
import os
import queue
import re
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from cli import EXAMPLE, cli
from tests.paths import ROOT

FAST = ["--runner", "mock", "--num-blocks", "256", "--no-live"]


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def test_help_of_every_command_has_an_example():
    for command in ("inspect", "replay", "serve", "top"):
        result = invoke(command, "--help")
        assert result.exit_code == 0 and "Example" in result.output


def test_inspect_bundled_example():
    result = invoke("inspect", str(EXAMPLE), "--idle-threshold", "2")
    assert result.exit_code == 0
    assert "kvdrain" in result.output and "32" in result.output


def test_usage_errors_exit_2():
    assert invoke("replay", "no-such-file.jsonl").exit_code == 2
    result = invoke("replay", str(EXAMPLE), "--liveness", "sometimes")
    assert result.exit_code == 2 and "sometimes" in result.output
    result = invoke("replay", str(EXAMPLE), "--speedup", "0")
    assert result.exit_code == 2 and "speedup" in result.output
    assert invoke("replay", str(EXAMPLE), "--block-size", "0").exit_code == 2
    assert invoke("top").exit_code == 2  # --connect is required


def test_bad_trace_is_exit_2_with_file_and_line(tmp_path: Path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text(
        '{"t": 0, "id": "a", "prompt_len": 4, "max_tokens": 2}\n'
        '{"t": 1, "id": "b", "prompt_len": 4, "max_tokens": "x"}\n'
    )
    result = invoke("replay", str(trace), "--clock", "virtual", *FAST)
    assert result.exit_code == 2
    assert "bad.jsonl:2: max_tokens" in result.output


@pytest.mark.parametrize("liveness,code", [("legacy", 1), ("poll", 0), ("event", 0)])
def test_virtual_replay_verdicts(liveness: str, code: int, tmp_path: Path):
    report = tmp_path / "report.json"
    requests = tmp_path / "requests.jsonl"
    result = invoke(
        "replay",
        str(EXAMPLE),
        "--clock",
        "virtual",
        "--liveness",
        liveness,
        "--report",
        str(report),
        "--requests",
        str(requests),
        *FAST,
    )
    assert result.exit_code == code, result.output
    data = json.loads(report.read_text())
    assert data["exit_code"] == code and data["trace"]["sha256"]
    assert len(requests.read_text().splitlines()) == 32
    assert ("VIOLATION:" in result.output) == (code == 1)


def test_plot_is_written(tmp_path: Path):
    plot = tmp_path / "usage.png"
    result = invoke("replay", str(EXAMPLE), "--clock", "virtual", "--plot", str(plot), *FAST)
    assert result.exit_code == 0 and plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.parametrize("liveness,code", [("legacy", 1), ("event", 0)])
def test_wall_clock_replay_matches_the_virtual_verdict(liveness: str, code: int, tmp_path: Path):
    # D reads 200 ms late, so P has surely parked (legacy) before its reports exist; with
    # instant reads a slow P can still collect some of them in its last step.
    report, virtual_report = tmp_path / "report.json", tmp_path / "virtual.json"
    common = ["--liveness", liveness, "--speedup", "2", "--pull-delay-ms", "200", *FAST]
    result = invoke("replay", str(EXAMPLE), "--clock", "wall", "--report", str(report), *common)
    assert result.exit_code == code, result.output
    virtual = invoke(
        "replay", str(EXAMPLE), "--clock", "virtual", "--report", str(virtual_report), *common
    )
    assert virtual.exit_code == code
    verdicts = [
        [w["verdict"] for w in json.loads(r.read_text())["windows"] if w["engine"] == "P"]
        for r in (report, virtual_report)
    ]
    assert verdicts[0] == verdicts[1]
    windows = json.loads(report.read_text())["windows"]
    p_windows = [
        (w["start"], w["verdict"], w["num_used_at_start"]) for w in windows if w["engine"] == "P"
    ]
    assert {v for _, v, _ in p_windows} == {"leak" if code else "drained"}, p_windows


class Lines:
    """A command in a child process; its printed lines arrive on a queue (bounded waits)."""

    def __init__(self, cmd: list[str]) -> None:
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, ""):
            self.seen.append(line)
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match:
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if match := re.search(pattern, line):
                return match
        raise AssertionError(f"{self.proc.args[3]} never printed {pattern!r}; got {self.seen}")


STOP_TIMEOUT_S = 30  # > 2 engines x (5 + 5) s, the router's bounded shutdown


def _children(pid: int) -> list[str]:
    """The command lines and states of a process's children (for a failure's message)."""
    out = subprocess.run(
        ["ps", "-o", "pid=,stat=,etime=,args=", "--ppid", str(pid)], capture_output=True, text=True
    )
    return [line.strip()[:160] for line in out.stdout.splitlines()]


class Serve(Lines):
    """`kvdrain serve` in a child process."""

    def __init__(self, *args: str) -> None:
        super().__init__(
            [
                sys.executable,
                "-m",
                "cli",
                "serve",
                "--runner",
                "mock",
                "--num-blocks",
                "256",
                "--no-live",
                *args,
            ]
        )
        self.address = self.wait_for(r"listening on (\S+)", 60).group(1)

    def stop(self) -> int:
        """Ctrl-C, then a bounded wait; kill only if it hangs. The wait covers the serve's
        own worst case (each engine's Shutdown: 5 s to drain, 5 s more, then a kill)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            children = _children(self.proc.pid)
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(
                f"serve did not stop on Ctrl-C in {STOP_TIMEOUT_S} s; its children "
                f"then: {children}; it printed: {self.seen[-15:]}"
            ) from None


@pytest.mark.slow
def test_record_with_serve_then_replay_the_recording(tmp_path: Path):
    recording = tmp_path / "recorded.jsonl"
    serve = Serve("--liveness", "event", "--record", str(recording))
    try:
        result = invoke(
            "replay", str(EXAMPLE), "--target", serve.address, "--speedup", "2", "--no-live"
        )
        assert result.exit_code == 0, result.output
    finally:
        assert serve.stop() == 0
    serve.wait_for(r"stopped after 32 requests", 10)
    lines = [json.loads(line) for line in recording.read_text().splitlines()]
    assert lines[0]["kvdrain_trace"] == 1
    assert sum("id" in line for line in lines) == 32
    snapshots = [line for line in lines if "kv" in line]
    assert snapshots and all(s["kv"]["P"]["used"] == 0 for s in snapshots)
    # Replaying the recording reproduces the recorded idle-time counts.
    report = tmp_path / "report.json"
    result = invoke("replay", str(recording), "--report", str(report), *FAST)
    assert result.exit_code == 0, result.output
    assert not [v for v in json.loads(report.read_text())["violations"] if v["kind"] == "snapshot"]


@pytest.mark.slow
def test_top_shows_counts_changing_while_a_replay_drives_serve(tmp_path: Path):
    serve = Serve("--liveness", "legacy")
    top = None
    try:
        top = Lines(
            [sys.executable, "-m", "cli", "top", "--connect", serve.address, "--seconds", "10"]
        )
        top.wait_for(r"P used \d+/", 30)  # attached before the traffic starts
        result = invoke(
            "replay",
            str(EXAMPLE),
            "--target",
            serve.address,
            "--speedup",
            "4",
            "--max-requests",
            "16",
            "--no-live",
        )
        assert top.proc.wait(30) == 0
    finally:
        if top is not None and top.proc.poll() is None:
            top.proc.kill()
        serve.stop()
    assert result.exit_code == 1  # legacy leaks on P
    used = [int(m) for m in re.findall(r"P used (\d+)/", "".join(top.seen))]
    assert len(set(used)) > 1 and max(used) > 0, top.seen


@pytest.mark.slow
def test_live_view_on_a_real_terminal():
    """Run the main job under a pseudo-terminal and read the screen it drew."""
    import pty

    cmd = [
        sys.executable,
        "-m",
        "cli",
        "replay",
        str(EXAMPLE),
        "--runner",
        "mock",
        "--speedup",
        "4",
        "--liveness",
        "legacy",
    ]
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.environ.update(COLUMNS="120", LINES="40", TERM="xterm-256color")
        os.execv(sys.executable, cmd)
    chunks, deadline = [], time.monotonic() + 90
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1.0)
            if not ready:
                continue
            try:
                data = os.read(fd, 65536)
            except OSError:
                break  # the child closed the terminal
            if not data:
                break
            chunks.append(data)
    finally:
        _, status = os.waitpid(pid, 0)
    screen = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", b"".join(chunks).decode(errors="replace"))
    assert os.waitstatus_to_exitcode(status) == 1
    for text in ("engine P", "engine D", "idle windows", "leak", "drained", "VIOLATION:"):
        assert text in screen, text


def _options(command: str) -> list:
    return [p for p in cli.commands[command].params if isinstance(p, click.Option)]


def test_every_option_of_every_verb_is_described_under_a_section_of_its_help():
    for name in cli.commands:
        for option in _options(name):
            assert option.help, f"{name} {option.opts[0]} has no help"
    text = invoke("replay", "--help").output
    for title in ("Engine:", "Shaping:", "Verification:", "Target", "Outputs:", "Security:"):
        assert f"\n{title}" in text, title
    for flag in (
        "--device",
        "--block-size",
        "--max-num-seqs",
        "--max-num-batched-tokens",
        "--max-model-len",
        "--speedup",
        "--max-requests",
    ):
        option = next(o for o in _options("replay") if flag in o.opts)
        assert len(option.help) > 20, flag


def test_help_says_what_holds_where_it_stands():
    """serve's --model is a preset only; a client's --curve-keys is not what a serve needs."""
    model = next(o for o in _options("serve") if o.name == "model")
    assert "--target" not in model.help
    for verb in ("serve", "replay", "top"):
        keys = next(o for o in _options(verb) if o.name == "curve_keys")
        assert ("required to serve beyond loopback" in keys.help) == (verb == "serve"), verb


def test_no_verb_takes_more_than_a_dozen_or_so_parameters():
    import inspect

    for name, command in cli.commands.items():
        assert len(inspect.signature(command.callback).parameters) <= 12, name


def test_explain_prints_the_glossary_at_once_without_a_trace(monkeypatch):
    import replay.commands.replay as commands

    def never(*args, **kwargs):
        raise AssertionError("the replay ran")

    monkeypatch.setattr(commands, "replay_main", never)
    for args in (["explain"], ["replay", "--explain"], ["replay", str(EXAMPLE), "--explain"]):
        result = invoke(*args)
        assert result.exit_code == 0 and result.output.startswith("Verdicts (exit status):"), args


@pytest.mark.parametrize(
    "option",
    [
        o
        for o in cli.commands["replay"].params
        if "group_title" in vars(o) and o.group_title == "Engine"
    ],
    ids=lambda o: o.opts[0],
)
def test_every_engine_option_set_with_target_is_refused(option):
    """The list of what only a server's engines honour is the engine group itself."""
    if option.is_flag:
        value = []
    elif isinstance(option.type, click.Choice):
        value = [option.type.choices[-1]]
    elif isinstance(option.type, click.Path):
        value = [str(EXAMPLE)]
    elif isinstance(option.type, click.FloatRange):
        value = ["0.5"]
    elif option.name == "topology":
        value = ["2p2d"]
    else:
        value = ["2"]
    if option.name in ("model", "calibration_path", "cost_profile"):
        pytest.skip(
            "--model names the served model over HTTP; --calibration forecasts a target's "
            "expected windows too"
        )
    if option.name in ("vllm_release", "kv_lease_s"):
        pytest.skip("--vllm-release and --kv-lease-s say what a target's deployment runs")
    result = invoke("replay", str(EXAMPLE), "--target", "tcp://127.0.0.1:9", option.opts[0], *value)
    assert result.exit_code == 2 and "does not apply with --target" in result.output, result.output


def test_serve_help_names_every_route_of_its_http_front():
    from replay.serve.http_front import HttpFront
    from tests.replay.serve.test_http_front_fidelity import MODEL, FakeRouter, answers

    paths = {
        r.resource.canonical for r in HttpFront(FakeRouter(answers), MODEL).app().router.routes()
    }
    help_text = " ".join(invoke("serve", "--help").output.split())
    assert "/v1/chat/completions" in paths and all(path in help_text for path in paths), paths


@pytest.mark.skipif(
    shutil.which("make") is None or shutil.which("awk") is None, reason="needs make and awk"
)
def test_make_demo_prints_both_runs_within_100_columns(tmp_path):
    """Side by side, the two runs' lines were 158 columns wide, cut mid-word."""
    result = subprocess.run(
        [
            "make",
            "-s",
            "demo",
            "STAMP=",
            f"KVDRAIN={sys.executable} -m cli",
            f"DEMO_DIR={tmp_path}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if str(tmp_path) not in line]
    assert max(len(line) for line in lines) <= 100, lines
    assert (
        lines[0] == "--liveness legacy (virtual clock):"
        and "--liveness event (virtual clock):" in lines
    )
    assert (
        "  VIOLATION: 4 violations (exit 1)" in lines
        and sum(x.startswith("    leak ") for x in lines) == 4
    )
    assert any(x.startswith("  VERIFIED: every engine drained") for x in lines)
    assert (tmp_path / "demo-legacy.png").stat().st_size and (
        tmp_path / "demo-event.png"
    ).stat().st_size


def test_python_m_cli_names_itself_kvdrain_in_usage_lines():
    result = subprocess.run(
        [sys.executable, "-m", "cli", "inspect", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0 and result.stdout.startswith("Usage: kvdrain inspect "), (
        result.stdout
    )


@pytest.mark.parametrize("command", ["replay", "inspect"])
def test_an_idle_threshold_of_0_is_refused_by_replay_and_inspect_alike(command):
    result = invoke(command, str(EXAMPLE), "--idle-threshold", "0")
    assert (
        result.exit_code == 2 and "--idle-threshold" in result.output and "x>0" in result.output
    ), result.output


@pytest.mark.parametrize("command", ["replay", "serve"])
def test_a_router_with_a_single_engine_is_a_usage_error_naming_both_options(command):
    args = [str(EXAMPLE)] if command == "replay" else []
    result = invoke(command, *args, "--topology", "single", "--router", "prefix")
    assert (
        result.exit_code == 2
        and "--router" in result.output
        and "--topology single" in result.output
    ), result.output
