"""The KV connector interfaces the engine owns; connectors implement them. Runs in: engine-core process.

Two halves, as in vLLM's KVConnectorBase_V1. The scheduler side is pure and lives
inside the Scheduler. The other half is vLLM's worker role (KVConnectorRole.WORKER,
the role's name kept); kvdrain calls its object the agent, since "worker" here always
means the connector worker process. The agent lives in the engine core next to the
model runner: it ships each step's metadata to wherever the blocks are moved (for
kvdrain, its connector worker process) and collects completion reports. Reports pile
up until `get_finished` is called, which happens only when the engine steps: that is
the liveness question.

Time: the scheduler side is pure and reads no clock. Its time comes from the agent's
clock (`KVConnectorAgentBase.now_ns`: time.monotonic_ns() in the engine-core
process, virtual time in the simulator), handed over by EngineCore.step through
`KVConnectorBase.set_time` before schedule() and again before update_from_output, the
moments vLLM's NIXL scheduler reads time.perf_counter() (build_connector_meta's
heartbeats, request_finished's lease). So both halves stamp with one clock.
"""

from __future__ import annotations

import enum
import importlib
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Protocol

from engine.core.outputs import KVConnectorOutput, SchedulerOutput

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.core.request import Request


class KVConnectorMetadata:
    """Per-step instructions from the scheduler side to the agent."""

    def is_empty(self) -> bool:
        return True


class KVConnectorBase(ABC):
    """Scheduler side. Contract: request_finished -> (True, _) means the id appears
    exactly once in a later finished_sending; (False, _) means never."""

    @abstractmethod
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """(tokens the connector can provide beyond num_computed_tokens, load async?).

        None: not ready to tell yet; the scheduler asks again on a later step.
        """

    @abstractmethod
    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        """The request now owns `block_ids`; the last ones receive the external tokens."""

    @abstractmethod
    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Everything decided since the last call, for the agent. Resets state."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """(delay_free, kv_transfer_params for the frontend)."""

    def request_rejected(self, req_id: str, kv_transfer_params: dict | None) -> None:
        """A request this engine refused before it became one (malformed, a duplicate
        id): release whatever its params hold elsewhere, since request_finished will
        never come for it (P/D: P's blocks). Default: nothing."""

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """Observe the agent's reports (counters, leases). Default: nothing."""

    def on_new_request(self, request: Request) -> None:
        """A request was added (vLLM's on_new_request: say, start its heartbeats)."""

    def set_time(self, now_ns: int) -> None:
        """The engine's clock now (ns; see the module docstring). Default: ignored."""

    def next_deadline_ns(self) -> int | None:
        """When this side next acts on time alone (a heartbeat due), on the set_time
        clock; None: never. An event-driven loop blocked on reports wakes then."""
        return None

    def get_counters(self) -> dict[str, int]:
        """Scheduler-side counters for stats (say, rejected transfer params)."""
        return {}


class KVConnectorAgentBase(ABC):
    """The agent (vLLM's worker role), in the engine-core process next to the model runner."""

    # What died or broke behind the agent (its worker process, say), for the engine to
    # report; None: healthy.
    error: str | None = None

    @abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        """Hand this step's metadata over: loads start, finished sends are registered."""

    @abstractmethod
    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Reports that arrived since the last call (never blocks)."""

    def wait_handles(self) -> list[object]:
        """Sockets or file descriptors an event-driven loop may block on for reports."""
        return []

    def now_ns(self) -> int | None:
        """This side's clock (ns), which the scheduler side is given too; None: none."""
        return None

    def next_deadline_ns(self) -> int | None:
        """When get_finished next has something to do on time alone (a lease to reap),
        on the now_ns clock; None: never. An event-driven loop blocked on reports wakes
        then, so the step that asks comes."""
        return None

    def get_counters(self) -> dict[str, int]:
        """Transfer counters for stats (in flight, expired, failed...)."""
        return {}

    def shutdown(self) -> None:
        """Release sockets and memory. Default: nothing."""


class KVConnectorRole(enum.Enum):
    """vLLM's roles; WORKER builds the agent (KVConnectorAgentBase)."""

    SCHEDULER = "scheduler"
    WORKER = "worker"


class KVConnectorFactory(Protocol):
    """The type of a connector factory: named in KVTransferConfig.kv_connector as
    "module:function" and imported by name (import_factory) in the engine-core process,
    which calls it once per role, so the engine never imports a connector package."""

    def __call__(
        self, config: EngineConfig, role: KVConnectorRole, kv_cache_handle: dict | None = None
    ) -> KVConnectorBase | KVConnectorAgentBase: ...


def import_factory(name: str) -> KVConnectorFactory:
    """The connector factory named "module:function" (KVTransferConfig.kv_connector)."""
    module_name, _, attr = name.partition(":")
    return getattr(importlib.import_module(module_name), attr)
