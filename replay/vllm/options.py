"""What `replay --engine vllm` launches, as options (cli.py's vLLM option group builds them). Runs in: frontend process.

Kept apart from replay/vllm/launch.py so that cli.py, which every engine process
imports again, loads only this.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from replay.deploy.pd_flow import engine_roles
from replay.runtime.startup import START_LIMIT_S

ENGINES = ("kvdrain", "vllm")  # --engine: kvdrain's own engines, or real vLLM
DEFAULT_VENV = Path(".venv-vllm")
Producer = Literal["serve", "inproc"]
# --vllm-producer: P as `vllm serve`, or as vLLM's LLM class in kvdrain's in-process driver
PRODUCERS: tuple[Producer, ...] = ("serve", "inproc")


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmOptions:
    """What --engine vllm launches (cli.py's vLLM option group builds it)."""

    venv: Path = DEFAULT_VENV
    topology: str = "pd"
    model: str | None = None  # a local dir or a model name; None: the tiny model, written
    args: tuple[str, ...] = ()  # passed to every `vllm serve`
    env: tuple[tuple[str, str], ...] = ()  # set in every instance's environment
    start_limit_s: float = START_LIMIT_S  # replay/runtime/startup.py judges slower starts
    producer: Producer = "serve"  # what runs each P

    def __post_init__(self) -> None:
        roles = engine_roles(self.topology)  # ValueError on an unknown topology
        if self.producer not in PRODUCERS:
            raise ValueError(f"producer: must be one of {', '.join(PRODUCERS)}")
        if self.producer == "inproc" and not any(r == "kv_producer" for _, r in roles):
            raise ValueError(
                f"producer inproc: needs a P/D topology (pd, NpMd), got {self.topology}"
            )
        if not self.start_limit_s > 0:
            raise ValueError(f"start limit: must be > 0, got {self.start_limit_s}")
