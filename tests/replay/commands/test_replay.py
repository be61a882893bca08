"""`kvdrain replay`'s options to one ReplayConfig: a recording's header, read by the run's own pass."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

import replay.pipeline
import replay.trace.reader
from cli import cli

HEADER = {
    "kvdrain_trace": 1,
    "recorded_by": "kvdrain serve",
    "topology": "pd",
    "liveness": "event",
    "block_size": 16,
    "num_blocks": 512,
    "max_model_len": 4096,
}


def _recording(tmp_path: Path, header: dict) -> Path:
    lines = [
        header,
        {"t": 0.0, "id": "r1", "prompt_len": 64, "max_tokens": 4},
        {"t": 5.0, "id": "r2", "prompt_len": 64, "max_tokens": 4},
    ]
    path = tmp_path / "rec.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _replay(*args: str):
    return CliRunner().invoke(cli, ["replay", *args, "--clock", "virtual", "--no-live"])


def test_the_trace_is_opened_only_by_the_runs_passes_after_it_watches_it(tmp_path, monkeypatch):
    """A recording's header is read by the replay's checking pass, not by an open of its
    own before the run watches the file (a pipe copied, a file fingerprinted)."""
    events: list[str] = []
    open_trace, watch_trace = replay.trace.reader.open_trace, replay.pipeline.watch_trace

    def opened(path):
        events.append("open")
        return open_trace(path)

    def watched(path):
        events.append("watch")
        return watch_trace(path)

    monkeypatch.setattr(replay.trace.reader, "open_trace", opened)
    monkeypatch.setattr(replay.pipeline, "watch_trace", watched)
    report = tmp_path / "report.json"
    result = _replay(str(_recording(tmp_path, HEADER)), "--report", str(report))
    assert result.exit_code == 0, result.output
    assert events[0] == "watch" and events.count("watch") == 1, events
    assert json.loads(report.read_text())["settings"]["engine"]["num_blocks"] == 512


def test_a_recordings_max_model_len_checks_its_requests(tmp_path):
    """The header's max_model_len is adopted before the first request is checked: a
    prompt the recorded engines took is not refused by the default limit."""
    header = HEADER | {"max_model_len": 8192}
    path = tmp_path / "long.jsonl"
    lines = [header, {"t": 0.0, "id": "r1", "prompt_len": 6000, "max_tokens": 4}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    report = tmp_path / "report.json"
    result = _replay(str(path), "--report", str(report))
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text())["settings"]["engine"]["max_model_len"] == 8192


def test_an_option_that_conflicts_with_the_recording_is_a_usage_error(tmp_path):
    result = _replay(str(_recording(tmp_path, HEADER)), "--liveness", "legacy")
    assert result.exit_code == 2
    assert "--liveness legacy conflicts with the recording's liveness event" in result.output


def test_the_old_profile_flag_still_works_and_says_it_is_deprecated(tmp_path):
    old, new = tmp_path / "old.json", tmp_path / "new.json"
    example = str(Path(__file__).resolve().parents[3] / "examples" / "pd_idle.jsonl")
    for flag, report in (("--profile", old), ("--deployment", new)):
        result = _replay(example, flag, "llama3-70b-4xh100", "--report", str(report))
        assert result.exit_code == 0, result.output
        deprecated = [line for line in result.stderr.splitlines() if "deprecated" in line]
        assert deprecated == (
            ["kvdrain: --profile is deprecated, use --deployment (it means the same)"]
            if flag == "--profile"
            else []
        )
    engine = [json.loads(path.read_text())["settings"]["engine"] for path in (old, new)]
    assert engine[0] == engine[1] and engine[0]["max_model_len"] == 32768


def test_the_start_limit_goes_with_engine_vllm_and_is_named_as_typed(tmp_path):
    """--start-limit bounds a vLLM instance's start too (its help says so): with --engine
    vllm it reaches the launch (here a venv that is not there), and where it does not
    apply the error names the flag, not its parameter."""
    example = str(Path(__file__).resolve().parents[3] / "examples" / "pd_idle.jsonl")
    runner = CliRunner()
    vllm = runner.invoke(
        cli,
        ["replay", example, "--engine", "vllm", "--start-limit", "5"]
        + ["--vllm-venv", str(tmp_path / "no-venv"), "--no-live"],
    )
    assert vllm.exit_code == 2 and "not with --engine vllm" not in vllm.output, vllm.output
    target = runner.invoke(
        cli, ["replay", example, "--target", "tcp://127.0.0.1:9", "--start-limit", "5"]
    )
    assert target.exit_code == 2
    assert "--start-limit: does not apply with --target" in target.output, target.output


def test_the_lease_a_target_runs_is_given_with_kv_lease_s(monkeypatch):
    """--kv-lease-s says what a --target's deployment runs (the verdict's contract); the
    other engine options still do not apply there."""
    import replay.commands.replay as verb

    configs = []
    monkeypatch.setattr(verb, "replay_and_report", lambda config, *a, **k: configs.append(config))
    example = str(Path(__file__).resolve().parents[3] / "examples" / "pd_idle.jsonl")
    runner = CliRunner()
    args = ["replay", example, "--target", "http://127.0.0.1:9", "--no-live"]
    result = runner.invoke(cli, [*args, "--kv-lease-s", "6"])
    assert result.exit_code == 0, result.output
    assert configs[0].served_lease_s == (6.0, "--kv-lease-s")
    assert configs[0].served_release is None
    runner.invoke(cli, args)
    assert configs[1].served_lease_s is None


def test_the_vllm_release_picks_the_loop_unless_liveness_is_given(tmp_path):
    """--vllm-release X.Y: the release's loop (legacy up to 0.21, the pre-#43433 leak;
    event from 0.22), unless --liveness is given; the bundled example on the virtual clock."""
    example = str(Path(__file__).parents[3] / "examples" / "pd_idle.jsonl")
    report = tmp_path / "report.json"
    for args, exit_code, release, liveness in [
        ((), 0, "0.34.0", "event"),
        (("--vllm-release", "0.21"), 1, "0.21.0", "legacy"),
        (("--vllm-release", "0.22"), 0, "0.22.0", "event"),
        (("--vllm-release", "0.21", "--liveness", "poll"), 0, "0.21.0", "poll"),
        (("--vllm-release", "0.34", "--liveness", "legacy"), 1, "0.34.0", "legacy"),
    ]:
        result = _replay(example, "--runner", "mock", "--report", str(report), *args)
        assert result.exit_code == exit_code, (args, result.output)
        engine = json.loads(report.read_text())["settings"]["engine"]
        assert (engine["vllm_release"], engine["liveness"]) == (release, liveness), args


def test_a_release_the_miniature_does_not_model_or_a_lease_it_lacks_is_refused():
    for args, says in [
        (("--vllm-release", "0.9.1"), "the miniature models vLLM 0.10 to 0.34"),
        (("--vllm-release", "0.35"), "the miniature models vLLM 0.10 to 0.34"),
        (("--vllm-release", "v0.33"), "X.Y or X.Y.Z"),
        (("--vllm-release", "0.21", "--kv-lease-s", "5"), "vLLM 0.21.0 has no lease"),
    ]:
        result = _replay("examples/pd_idle.jsonl", "--runner", "mock", *args)
        assert result.exit_code == 2 and says in result.output, (args, result.output)


def test_a_bad_lines_text_and_an_outputs_path_are_printed_as_they_are_never_as_markup(tmp_path):
    """A skipped line quoting "[/]" raised rich's MarkupError (a traceback, exit 1) after the
    run; a path with "[bold]" in it was printed without it."""
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"t": 0, "id": "a", "prompt_len": 8, "max_tokens": 2}\n'
        '{"t": 1, "id": "b", "prompt_len": "[/]", "max_tokens": 2}\n'
        '{"t": 2, "id": "c", "prompt_len": 8, "max_tokens": 2}\n'
    )
    report = tmp_path / "r[bold]x.json"
    result = _replay(str(trace), "--skip-bad-lines", "--report", str(report))
    assert result.exit_code == 0, result.output
    assert 'prompt_len: must be an integer >= 1, got "[/]"' in result.output
    assert f"wrote {report}" in result.output and report.exists()


def test_the_old_vllm_start_timeout_says_it_is_deprecated_and_never_goes_with_start_limit(
    tmp_path,
):
    """Given both, --start-limit won silently after the deprecation line; the renamed
    --profile and --cost-profile refuse the pair, and so does this one now."""
    example = str(Path(__file__).resolve().parents[3] / "examples" / "pd_idle.jsonl")
    vllm = [example, "--engine", "vllm", "--vllm-venv", str(tmp_path / "no-venv"), "--no-live"]
    runner = CliRunner()
    old = runner.invoke(cli, ["replay", *vllm, "--vllm-start-timeout", "5"])
    assert old.exit_code == 2 and "--vllm-venv" in old.output, old.output  # reached the launch
    assert "kvdrain: --vllm-start-timeout is deprecated, use --start-limit" in old.stderr
    both = runner.invoke(cli, ["replay", *vllm, "--vllm-start-timeout", "5", "--start-limit", "20"])
    assert both.exit_code == 2
    assert "--vllm-start-timeout: the old name of --start-limit; give --start-limit alone" in (
        both.output
    ), both.output
