"""The scheduler's half of the KV-transfer lifecycle: remote loads, delayed frees, stale reports. Runs in: engine-core process.

Split out of scheduler.py to keep each module to one concept; Scheduler inherits it.
Reports come from the worker side through the runner output. Each finished request
that still holds blocks waits for exactly one report: `held_for_send` (the connector
delayed its free) for finished_sending, `held_for_recv` (aborted while its remote load
was in flight, vLLM #32255) for finished_recving. Anything else is stale or a
duplicate (vLLM #46240, #25067): counted and ignored, never a crash.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.outputs import KVConnectorOutput, RequestOutput
from engine.request import Request, RequestStatus

if TYPE_CHECKING:
    from engine.scheduler import Scheduler


class KVTransferMixin:
    def _init_kv_transfer_state(self: Scheduler) -> None:
        self.finished_recving_kv_req_ids: set[str] = set()
        # Remote loads that lost blocks: req_id -> tokens still valid (a block boundary).
        self.failed_recving_kv_req_ids: dict[str, int] = {}
        self.held_for_send: set[str] = set()
        self.held_for_recv: set[str] = set()
        self.num_stale_kv_reports = 0
        self.num_kv_load_failures = 0

    def _promote_skipped_waiting(self: Scheduler) -> None:
        """Blocked requests whose wait is over go back to the head of `waiting`, in order."""
        if not self.skipped_waiting:
            return
        still_blocked, ready = [], []
        for request in self.skipped_waiting:
            if (request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                    and not self._update_waiting_for_remote_kv(request)):
                still_blocked.append(request)
                continue
            request.status = RequestStatus.WAITING
            ready.append(request)
        self.skipped_waiting.clear()
        self.skipped_waiting.extend(still_blocked)
        self.waiting.extendleft(reversed(ready))

    def _update_waiting_for_remote_kv(self: Scheduler, request: Request) -> bool:
        """True once the remote load finished; sets num_computed_tokens and caches blocks."""
        req_id = request.req_id
        if req_id not in self.finished_recving_kv_req_ids:
            return False
        self.finished_recving_kv_req_ids.remove(req_id)
        if req_id in self.failed_recving_kv_req_ids:
            num_computed = self.failed_recving_kv_req_ids.pop(req_id)
        else:
            num_blocks = len(self.kv_cache_manager.get_block_ids(req_id))
            num_computed = min(num_blocks * self.block_size, request.num_tokens)
        # The last prompt token is always recomputed locally, to sample from its logits.
        num_computed = min(num_computed, request.num_tokens - 1)
        self.kv_cache_manager.cache_blocks(request, num_computed)
        request.num_computed_tokens = num_computed
        return True

    def _update_from_kv_xfer_finished(self: Scheduler, kv_out: KVConnectorOutput) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        if kv_out.invalid_block_ids:
            self._handle_invalid_blocks(kv_out.invalid_block_ids)
        for req_id in sorted(kv_out.finished_recving):  # sorted: same order in every process
            output = self._on_finished_recving(req_id)
            if output is not None:
                outputs.append(output)
        for req_id in sorted(kv_out.finished_sending):
            if req_id in self.held_for_send:
                self.held_for_send.remove(req_id)
                self._free_blocks(self.requests[req_id])
            else:
                self.num_stale_kv_reports += 1
        return outputs

    def _on_finished_recving(self: Scheduler, req_id: str) -> RequestOutput | None:
        if req_id in self.held_for_recv:
            self.held_for_recv.remove(req_id)
            self.failed_recving_kv_req_ids.pop(req_id, None)
            self._free_blocks(self.requests[req_id])
            return None
        request = self.requests.get(req_id)
        if (request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS
                or req_id in self.finished_recving_kv_req_ids):
            self.num_stale_kv_reports += 1
            return None
        if req_id in self.failed_recving_kv_req_ids and self.config.kv_load_failure_policy == "fail":
            self.failed_recving_kv_req_ids.pop(req_id)
            return self._fail_request(request, "KV load from the remote engine failed")
        self.finished_recving_kv_req_ids.add(req_id)
        return None

    def _fail_request(self: Scheduler, request: Request, why: str) -> RequestOutput:
        self._remove_from_queues(request)
        request.status = RequestStatus.FINISHED_ERROR
        request.stop_reason = why
        params = self._free_request(request)
        return RequestOutput(request.req_id, [], "error", params, error=why)

    def _handle_invalid_blocks(self: Scheduler, invalid_block_ids: set[int]) -> None:
        """Loads that lost blocks keep only the valid prefix before the first lost block."""
        matched: set[int] = set()
        for request in self._loading_requests():
            block_ids = self.kv_cache_manager.get_block_ids(request.req_id)
            bad = [i for i, block_id in enumerate(block_ids) if block_id in invalid_block_ids]
            if not bad:
                continue
            matched.update(block_ids[i] for i in bad)
            self.num_kv_load_failures += 1
            self.failed_recving_kv_req_ids[request.req_id] = bad[0] * self.block_size
        self.num_stale_kv_reports += len(invalid_block_ids - matched)

    def _loading_requests(self: Scheduler) -> list[Request]:
        loading = [r for r in self.skipped_waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS]
        loading.extend(self.requests[req_id] for req_id in self.held_for_recv)
        return loading
