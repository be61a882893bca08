"""The start-up lines of `replay --engine vllm`, without vLLM."""

from __future__ import annotations

import io

from rich.console import Console

from replay.commands.replay_vllm import HEARTBEAT_S, _StartupView
from replay.vllm.launch import InstanceStatus


def test_an_instance_ready_at_a_heartbeat_still_gets_its_ready_line():
    out = io.StringIO()
    view = _StartupView(Console(file=out, width=200), ["P", "D"])
    view.last_heartbeat -= HEARTBEAT_S  # the heartbeat is due on this tick
    view(
        [
            InstanceStatus(name="P", state="ready", ready_s=254.0, since_s=254.0),
            InstanceStatus(name="D", state="loading", since_s=254.0),
        ]
    )
    lines = out.getvalue().splitlines()
    assert lines == ["  P: ready in 254.0 s", "  D: loading (254 s)"]
    view(
        [
            InstanceStatus(name="P", state="ready", ready_s=254.0, since_s=255.0),
            InstanceStatus(name="D", state="ready", ready_s=255.0, since_s=255.0),
        ]
    )
    assert out.getvalue().splitlines()[2:] == ["  D: ready in 255.0 s"]
