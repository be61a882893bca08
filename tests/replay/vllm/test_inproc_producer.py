"""vLLM's in-process engine as P (`--vllm-producer inproc`): driver, launch, verdict, teardown."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from replay.vllm.inproc_producer import completion_answer, completion_request
from replay.vllm.launch import INPROC_PRODUCER, VllmDeployment, VllmFault, check_venv
from replay.vllm.options import VllmOptions
from tests.paths import ROOT
from tests.proc_utils import running
from tests.replay.vllm.test_launch import (
    REAL_VENV,
    kvdrain,
    make_fake_venv,
    recorded_pids,
    started_pids,
    wait_for,
)

TRACE = Path(__file__).resolve().parent / "pd_then_idle.jsonl"  # 4 requests, 90 s idle, 1 more
FAST = ("--speedup", "20", "--drain-deadline", "1.5", "--tail", "2")  # the gap: 4.5 s


@pytest.fixture(autouse=True)
def run_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "runs"
    root.mkdir()
    monkeypatch.setenv("KVDRAIN_RUN_ROOT", str(root))
    return root


@pytest.fixture
def fake_venv(tmp_path: Path) -> Path:
    return make_fake_venv(tmp_path / "venv")


@pytest.fixture
def pidfile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "pids"
    monkeypatch.setenv("FAKE_VLLM_PIDFILE", str(path))
    return path


def inproc_replay(venv: Path, tmp_path: Path, mode: str, *args: str, timeout: float = 120):
    report = tmp_path / "report.json"
    result = kvdrain(
        "replay",
        str(TRACE),
        "--engine",
        "vllm",
        "--vllm-venv",
        str(venv),
        "--vllm-producer",
        "inproc",
        "--no-live",
        "--report",
        str(report),
        *args,
        env={"FAKE_LLM_MODE": mode},
        timeout=timeout,
    )
    return result, (json.loads(report.read_text()) if report.exists() else None)


def test_a_p_leg_becomes_generate_arguments_with_its_kv_transfer_params():
    prompt, params = completion_request(
        {"prompt": [3, 4], "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
    )
    assert prompt == {"prompt_token_ids": [3, 4]}
    assert params == {
        "max_tokens": 1,
        "extra_args": {"kv_transfer_params": {"do_remote_decode": True}},
    }
    assert completion_request({"prompt": "w1 w2"})[0] == "w1 w2"
    for refused in ({"prompt": "w1", "stream": True}, {"prompt": [1, "x"]}, {"prompt": None}):
        with pytest.raises(ValueError):
            completion_request(refused)


def test_the_answer_carries_ps_kv_transfer_params_as_vllm_serve_does():
    class Out:
        request_id, prompt_token_ids, kv_transfer_params = "7", [1, 2, 3], {"remote_block_ids": [1]}
        outputs = [
            type(
                "C",
                (),
                {"text": " w1", "token_ids": [1], "finish_reason": "length", "stop_reason": None},
            )
        ]

    answer = completion_answer(Out, "kvdrain/tiny")
    assert answer["kv_transfer_params"] == {"remote_block_ids": [1]}
    assert answer["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    assert answer["choices"][0]["finish_reason"] == "length" and answer["model"] == "kvdrain/tiny"


def test_p_runs_as_the_driver_by_the_venvs_python_and_d_as_vllm_serve(fake_venv, tmp_path):
    options = VllmOptions(venv=fake_venv, topology="pd", producer="inproc", args=("--x", "1"))
    p, d = VllmDeployment(options, check_venv(fake_venv), tmp_path / "run").specs
    assert p.argv[:2] == [str(fake_venv / "bin" / "python"), str(INPROC_PRODUCER)]
    assert p.argv[-2:] == ["--x", "1"] and "--served-model-name" in p.argv
    kv = json.loads(p.argv[p.argv.index("--kv-transfer-config") + 1])
    assert kv["kv_role"] == "kv_producer" and kv["kv_connector"] == "NixlConnector"
    assert p.env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0" and "PYTHONPATH" not in p.env
    assert d.argv[:2] == [str(fake_venv / "bin" / "vllm"), "serve"] and d.producer == "serve"
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in d.env
    assert p.program != d.program == "vllm serve"


def test_the_inproc_producer_needs_a_pd_topology_and_the_vllm_engine(fake_venv):
    with pytest.raises(ValueError, match="needs a P/D topology"):
        VllmOptions(topology="single", producer="inproc")
    single = ("--engine", "vllm", "--vllm-venv", str(fake_venv), "--topology", "single")
    result = kvdrain("replay", str(TRACE), *single, "--vllm-producer", "inproc", "--no-live")
    assert result.returncode == 2 and "--vllm-producer inproc: needs a P/D" in result.stderr
    result = kvdrain("replay", str(TRACE), "--vllm-producer", "inproc", "--no-live")
    assert result.returncode == 2 and "--vllm-producer: only with --engine vllm" in result.stderr


def test_the_driver_serves_the_p_leg_and_its_schedulers_usage(fake_venv, pidfile, tmp_path):
    """Against the fake LLM class: P's answer holds the params D needs, and /metrics reads
    the scheduler, so the blocks a finished P request keeps show after generate() returned."""
    port = free_port()
    proc = subprocess.Popen(
        [str(fake_venv / "bin" / "python"), str(INPROC_PRODUCER), "m", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert wait_for(lambda: get(port, "/health") == "", 30)
        body = {"prompt": list(range(300)), "max_tokens": 1}
        body["kv_transfer_params"] = {"do_remote_decode": True}
        answer = post(port, "/v1/completions", body)
        assert answer["kv_transfer_params"]["remote_engine_id"] == "fake-inproc"
        metrics = get(port, "/metrics")
        assert 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.000732' in metrics  # 3
        assert 'kvdrain:delayed_free_requests{engine="0",model_name="m"} 1' in metrics
        assert 'kvdrain:engine_steps_total{engine="0",model_name="m"} 1' in metrics
        assert 'vllm:nixl_num_kv_expired_reqs_total{engine="0"} 0.0' in metrics
        assert 'num_gpu_blocks="4096"' in metrics
        assert json.loads(get(port, "/version")) == {"version": "0.32.0+fake"}
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert wait_for(lambda: not any(running(p) for p in started_pids(pidfile)), 10)


def test_a_producer_that_holds_its_blocks_while_idle_is_a_leak_and_nothing_is_left(
    fake_venv, pidfile, tmp_path
):
    result, report = inproc_replay(fake_venv, tmp_path, "holds", *FAST)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "each P in-process (LLM class)" in out and "the in-process producer" in out
    leaks = [v for v in report["violations"] if v["engine"] == "P"]
    assert leaks and not [v for v in report["violations"] if v["engine"] == "D"], out
    assert report["deployment"]["producer"] == "inproc"
    assert report["deployment"]["instances"][0]["program"].startswith("the in-process producer")
    pids = started_pids(pidfile)
    assert len(pids) == 4 and not any(running(p) for p in pids)  # P and D, each with a child


def test_a_producer_that_frees_its_blocks_is_judged_drained(fake_venv, pidfile, tmp_path):
    result, report = inproc_replay(fake_venv, tmp_path, "frees", *FAST)
    out = result.stdout + result.stderr
    assert result.returncode in (0, 3), out  # 3: a busy machine shrank the gap
    assert report["violations"] == [] and report["faults"] == [], out
    assert not any(running(p) for p in started_pids(pidfile))


def test_a_producer_that_fails_to_start_is_a_fault_naming_its_log(fake_venv, pidfile, tmp_path):
    result, _ = inproc_replay(fake_venv, tmp_path, "dies", *FAST)
    out = result.stdout + result.stderr
    assert result.returncode == 4, out
    assert "the in-process producer (vLLM's LLM class) exited with status 1" in out
    assert "P.log" in out and "fake in-process engine failed to start" in out
    assert not any(running(p) for p in started_pids(pidfile))


def test_a_producer_that_never_starts_is_stopped_by_the_start_limit(
    fake_venv, pidfile, tmp_path, monkeypatch
):
    monkeypatch.setenv("FAKE_LLM_MODE", "hangs")
    options = VllmOptions(venv=fake_venv, topology="pd", producer="inproc", start_limit_s=3)
    with VllmDeployment(options, check_venv(fake_venv), tmp_path / "run") as d:
        d.start()
        with pytest.raises(VllmFault, match="the in-process producer .* not ready within 3"):
            d.wait_ready()
    pids = started_pids(pidfile)
    assert pids and wait_for(lambda: not any(running(p) for p in pids), 5)


def test_a_producer_a_sigkilled_kvdrain_left_is_stopped_by_the_next_start(
    fake_venv, pidfile, run_root
):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "FAKE_LLM_MODE": "hangs"}
    argv = [sys.executable, "-m", "cli", "replay", str(TRACE), "--engine", "vllm"]
    argv += ["--vllm-venv", str(fake_venv), "--vllm-producer", "inproc", "--no-live"]
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
    left: list[int] = []
    try:
        assert wait_for(
            lambda: (
                len(started_pids(pidfile)) == 4
                and set(started_pids(pidfile)) < recorded_pids(run_root)
            ),
            60,
        )  # the driver and D, each with its child, and the proxy
        left = sorted(recorded_pids(run_root))
    finally:
        proc.kill()  # no teardown runs
        proc.wait(timeout=10)
    try:
        result = kvdrain(*argv[3:], env={"FAKE_LLM_MODE": "dies"})
        assert result.returncode == 4, result.stdout + result.stderr
        assert "a killed run left running: P (pid" in result.stdout
        assert wait_for(lambda: not any(running(p) for p in left), 5)
    finally:
        for pid in left:  # a failed check: these are this test's own processes
            if running(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_vllms_in_process_engine_as_p_holds_its_blocks_through_the_idle_window(tmp_path):
    """vLLM #46502, open in 0.34: after generate() returns nothing steps the in-process
    engine, so P keeps the blocks D has read through the 90 s window (`vllm serve` as P
    frees them within a second)."""
    if not (REAL_VENV / "bin" / "python").exists():
        pytest.skip(f"no real vLLM: {REAL_VENV} is missing (`make vllm` creates it)")
    result, report = inproc_replay(REAL_VENV, tmp_path, "holds", "--tail", "10", timeout=880)
    out = result.stdout[-4000:] + result.stderr[-4000:]
    assert result.returncode == 1, out
    gap = [v for v in report["violations"] if v["engine"] == "P" and "idle window" in v["detail"]]
    assert len(gap) == 1, out
    assert not [v for v in report["violations"] if v["engine"] == "D"], out
    assert report["faults"] == [], out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(port: int, path: str) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.read().decode()
    except OSError:
        return None


def post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as r:
        return json.loads(r.read())
