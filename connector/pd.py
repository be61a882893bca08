"""Pull-mode prefill/decode connector, scheduler side (NIXL-like). Runs in: engine-core process.

P runs a `do_remote_decode` request for one token and holds its blocks (delayed free) until D has
read them or their lease is reaped; D loads a `do_remote_prefill` request's prompt KV
asynchronously (WAITING_FOR_REMOTE_KVS) and heartbeats P while it waits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from connector.heartbeats import HeartbeatTracker
from connector.messages import (
    HeartbeatSpec,
    RecvSpec,
)  # a load: remote_block_ids -> local_block_ids
from connector.send_ledger import HoldRules
from engine.config import EngineConfig
from engine.core.kv_connector import KVConnectorBase, KVConnectorMetadata
from engine.core.outputs import KVConnectorOutput, SchedulerOutput
from engine.core.request import Request, RequestStatus
from engine.utils import cdiv


@dataclass(slots=True)
class PDConnectorMetadata(KVConnectorMetadata):
    reqs_to_send: dict[str, list[int]] = field(default_factory=dict)
    reqs_to_recv: dict[str, RecvSpec] = field(default_factory=dict)
    send_deadlines: dict[str, int] = field(default_factory=dict)  # each send's lease (ns)
    heartbeats: list[HeartbeatSpec] = field(default_factory=list)
    # Empty receives (no local blocks) in reqs_to_recv, as vLLM's, are sends on P that D
    # will never read (its request ended first, was refused, or its params did not fit):
    # the worker tells P to free them. Those whose id is taken in reqs_to_recv this step
    # (a refused duplicate of a request whose load starts) wait here instead.
    reqs_to_release: list[RecvSpec] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (
            self.reqs_to_send or self.reqs_to_recv or self.heartbeats or self.reqs_to_release
        )


class PDConnector(KVConnectorBase):
    """One engine's scheduler side, P's or D's.

    P: a `do_remote_decode` request runs with max_tokens=1; finished length-capped, its blocks
    are kept until the decode side has read them, and the frontend gets the params D needs.
    Leases (vLLM 0.32's NIXL): request_finished stamps each held send with now + kv_lease_s;
    the deadline travels in the metadata to P's worker, which reaps it when P steps past it,
    and extends the leases D's heartbeats (connector/heartbeats.py) name. Before 0.22 the
    stamp is the fallback timer's (480 s, 120 s before 0.11.2) and D sends no heartbeats.
    D: a `do_remote_prefill` request's prompt KV is an async load; it waits in
    WAITING_FOR_REMOTE_KVS until the worker reports finished_recving.
    Time is the agent's clock, given by the engine core (set_time).
    """

    def __init__(self, config: EngineConfig) -> None:
        self.engine_id = config.engine_id
        self.block_size = config.block_size
        self.kv_addr = config.kv_transfer.kv_addr if config.kv_transfer else ""
        self._reqs_need_send: dict[str, list[int]] = {}
        self._reqs_need_recv: dict[str, RecvSpec] = {}
        self._send_deadlines: dict[str, int] = {}
        self._reqs_to_release: list[RecvSpec] = []
        lease_s = config.kv_transfer.kv_lease_s if config.kv_transfer else 30.0
        rules = HoldRules.of(config.vllm_release, lease_s)
        # vLLM's kv_lease_duration, or before 0.22 its fallback timer (no heartbeats then)
        self.lease_ns, self.has_lease = rules.hold_ns, rules.heartbeats
        self._heartbeats = HeartbeatTracker(self.lease_ns // 6)  # vLLM: kv_lease_duration // 6
        self._now = 0  # the engine's clock (ns), from set_time
        self.num_bad_params = 0  # requests (not admission attempts) whose params did not fit
        self._bad_params_counted: set[str] = set()  # waiting ones, counted already
        # Once the worker process is gone nobody serves reads: offer no KV to decode any
        # more (the router then lets D prefill itself), or D could read freed blocks.
        self.worker_error: str | None = None

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return 0, False
        if self.worker_error is not None:
            return 0, False  # nobody could load it: prefill locally
        if not self._remote_params_fit(request, params):
            if request.req_id not in self._bad_params_counted:  # asked every step it waits
                self._bad_params_counted.add(request.req_id)
                self.num_bad_params += 1  # computed locally instead
            return 0, False
        count = request.num_prompt_tokens - num_computed_tokens
        return (count, True) if count > 0 else (0, False)

    def _remote_params_fit(self, request: Request, params: dict) -> bool:
        remote_block_ids = params.get("remote_block_ids")
        return (
            isinstance(remote_block_ids, list)
            and len(remote_block_ids) == cdiv(request.num_prompt_tokens, self.block_size)
            and all(type(b) is int and b > 0 for b in remote_block_ids)
            and all(
                isinstance(params.get(k, ""), str)
                for k in ("remote_request_id", "remote_engine_id", "remote_addr")
            )
            and isinstance(params.get("remote_request_id"), str)
        )

    def update_state_after_alloc(
        self, request: Request, block_ids: list[int], num_external_tokens: int
    ) -> None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return
        self._bad_params_counted.discard(request.req_id)  # admitted: never asked again
        if num_external_tokens > 0:
            # Local prefix hits are whole blocks, so the external tokens fill the tail.
            n = cdiv(num_external_tokens, self.block_size)
            displaced = self._reqs_need_recv.pop(request.req_id, None)  # a duplicate's release
            if displaced is not None:
                self._reqs_to_release.append(displaced)
            self._reqs_need_recv[request.req_id] = RecvSpec(
                req_id=request.req_id,
                local_block_ids=block_ids[-n:],
                remote_block_ids=list(params["remote_block_ids"][-n:]),
                remote_engine_id=str(params.get("remote_engine_id", "")),
                remote_request_id=params["remote_request_id"],
                remote_addr=str(params.get("remote_addr", "")),
            )
        else:  # nothing to load (params that do not fit): P still holds the blocks for us
            self._release(request.req_id, params)  # vLLM NIXL: an empty receive
        params["do_remote_prefill"] = False  # load once, even after a preemption

    def on_new_request(self, request: Request) -> None:
        if self.has_lease:  # before 0.22 D sends no heartbeats: P's timer is fixed
            self._heartbeats.track(request.req_id, request.kv_transfer_params)

    def set_time(self, now_ns: int) -> None:
        self._now = now_ns

    def next_deadline_ns(self) -> int | None:
        return self._heartbeats.next_due_ns(self._now)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PDConnectorMetadata:
        meta = PDConnectorMetadata(
            self._reqs_need_send,
            self._reqs_need_recv,
            self._send_deadlines,
            self._heartbeats.package(self._now),
            self._reqs_to_release,
        )
        self._reqs_need_send, self._reqs_need_recv, self._send_deadlines = {}, {}, {}
        self._reqs_to_release = []
        return meta

    def request_rejected(self, req_id: str, kv_transfer_params: dict | None) -> None:
        """Refused at add (malformed, a duplicate id): P's blocks for it are released."""
        if kv_transfer_params and kv_transfer_params.get("do_remote_prefill"):
            self._release(req_id, kv_transfer_params)

    def _release(self, req_id: str, params: dict) -> None:
        """Queue an empty receive: D's worker tells P to free the send the params name
        (if they name one: any id and address will do, the block ids need not fit)."""
        remote_req_id, addr = params.get("remote_request_id"), params.get("remote_addr", "")
        if isinstance(remote_req_id, str) and remote_req_id and isinstance(addr, str) and addr:
            engine_id = params.get("remote_engine_id", "")
            spec = RecvSpec(
                req_id, [], [], engine_id if isinstance(engine_id, str) else "", remote_req_id, addr
            )
            if req_id in self._reqs_need_recv:
                self._reqs_to_release.append(spec)
            else:
                self._reqs_need_recv[req_id] = spec

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._heartbeats.stop(request.req_id)  # finished before its load completed
        self._bad_params_counted.discard(request.req_id)
        params = request.kv_transfer_params
        if params and params.get("do_remote_prefill"):
            # Finished before its load was ever scheduled (aborted while waiting, ignored):
            # P still holds the blocks for us, so ask the worker to tell P to free them
            # without reading (vLLM NIXL queues an empty receive for this).
            self._release(request.req_id, params)
            params["do_remote_prefill"] = False
            return False, None
        if not params or not params.get("do_remote_decode"):
            return False, None
        if (
            request.status
            not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)
            or not block_ids
        ):
            # Aborted or failed: nothing for the decode side to read. A stop (its one
            # token was EOS) is held like a length cap, as vLLM 0.32's NIXL does.
            return False, None
        if self.worker_error is not None:
            return False, None
        self._reqs_need_send[request.req_id] = list(block_ids)
        self._send_deadlines[request.req_id] = self._now + self.lease_ns
        return True, {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self.engine_id,
            "remote_request_id": request.req_id,
            "remote_block_ids": list(block_ids),
            "remote_addr": self.kv_addr,
        }

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        for req_id in connector_output.finished_recving:
            self._heartbeats.stop(req_id)
        if connector_output.worker_error is not None:
            self.worker_error = connector_output.worker_error

    def get_counters(self) -> dict[str, int]:
        return {"num_bad_params": self.num_bad_params}
