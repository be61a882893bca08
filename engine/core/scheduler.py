"""The scheduler: queues, token budget, preemption and the connector lifecycle. Runs in: engine-core process.

No prefill/decode phases: every step spends one token budget until each request's
num_computed_tokens reaches num_tokens, so chunked prefill needs no special case. What
async scheduling needs of a step in flight is kept here too, as in vLLM's Scheduler
(the "steps in flight" section); AsyncScheduler adds only the placeholders.
"""

from __future__ import annotations

from collections import deque

from engine.config import EngineConfig
from engine.core.block_hash import hash_request_blocks
from engine.core.block_pool import KVCacheBlock
from engine.core.invalid_blocks import cut_back_to_valid_prefix
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_connector import KVConnectorBase
from engine.core.outputs import (
    PLACEHOLDER_TOKEN_ID,
    KVConnectorOutput,
    ModelRunnerOutput,
    RequestOutput,
    ScheduledRequest,
    SchedulerOutput,
    SchedulerStats,
    StepOutputs,
)
from engine.core.release import VllmRelease, caches_blocks_early, notifies_rejection
from engine.core.request import Request, RequestStatus
from engine.core.stop import check_stop

__all__ = ["Scheduler"]

# No request's KV failed this step (update_from_output): shared, never mutated.
_NO_IDS: frozenset[str] = frozenset()
# Statuses above it are finished. A plain name: on Python 3.11 each read of an Enum
# class attribute goes through its metaclass's __getattr__ hook (~850 instructions).
_PREEMPTED = RequestStatus.PREEMPTED
_RUNNING = RequestStatus.RUNNING
_CONSUMER_ROLES = ("kv_consumer", "kv_both")
_PRODUCER_ROLES = ("kv_producer", "kv_both")


class Scheduler:
    def __init__(self, config: EngineConfig, connector: KVConnectorBase | None = None) -> None:
        self.config = config
        self.connector = connector
        self.block_size = config.block_size
        self.kv_cache_manager = KVCacheManager(
            config.num_blocks, config.block_size, config.enable_prefix_caching, config.max_model_len
        )
        self.block_pool = self.kv_cache_manager.block_pool
        # Every request not yet fully released, including finished ones whose
        # blocks a connector still holds (delayed free).
        self.requests: dict[str, Request] = {}
        # Waiting requests that hold no KV blocks: new, preempted, deferred by the connector.
        self.waiting: deque[Request] = deque()
        # Waiting requests that hold KV blocks (vLLM 0.32's kv_holding_waiting): in
        # WAITING_FOR_REMOTE_KVS, or loaded and not yet admitted. Admitted before `waiting`.
        self.skipped_waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Ids the connector told to ask again later (get_num_new_matched_tokens None).
        self.deferred_req_ids: set[str] = set()
        # Finished since the last schedule(); shipped to the connector's agent, then reset.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0  # vLLM's prefix_cache_queries: tokens looked up
        # ---- KV transfer state (see the KV transfer section below)
        self.finished_recving_kv_req_ids: set[str] = set()
        # Remote loads that lost blocks (policy recompute); num_computed_tokens already
        # cut back to the valid prefix.
        self.failed_recving_kv_req_ids: set[str] = set()
        self.held_for_send: set[str] = set()
        self.held_for_recv: set[str] = set()
        self.num_stale_kv_reports = 0
        self.num_kv_load_failures = 0
        self.release = VllmRelease.parse(config.vllm_release)
        # vLLM 0.21+ (#41269): a request refused before admission tells the connector,
        # so that P frees what the params hold; before, nobody told P.
        self.notifies_rejection = notifies_rejection(self.release)
        self._init_steps_in_flight(config, connector)
        # Decode and sampled-token fast paths; tests turn them off to compare with the
        # straightforward paths (tests/engine/core/test_scheduler_fast_paths.py). Not a
        # configuration knob. They assume no step in flight.
        self.fast_path = not self.multiple_inflight_batches

    def _init_steps_in_flight(
        self, config: EngineConfig, connector: KVConnectorBase | None
    ) -> None:
        """vLLM's Scheduler state for steps whose output is not processed yet (the
        "steps in flight" section below)."""
        # vLLM: vllm_config.max_concurrent_batches > 1, async scheduling here (no
        # pipeline parallelism). With one batch in flight at most, every step's output is
        # processed before the next schedule(), so nothing is in flight between calls and
        # the in-flight counts are not kept.
        self.multiple_inflight_batches = config.async_scheduling
        role = config.kv_transfer.kv_role if config.kv_transfer is not None and connector else None
        # A step in flight may still write a consumer's freed blocks while a load refills
        # them: their free waits for that step's output (sched_step_seq fences).
        self.defer_block_free = self.multiple_inflight_batches and role in _CONSUMER_ROLES
        # vLLM's KVConnectorBase_V1.requires_kv_delivery (the producer role): a preempted
        # request's output in flight is dropped, its hand-off needs the KV just freed.
        self.requires_kv_delivery = role in _PRODUCER_ROLES
        self.sched_step_seq = 0  # steps with tokens scheduled
        self.processed_step_seq = 0  # of those, steps whose output was processed
        self.deferred_frees: deque[tuple[int, list[KVCacheBlock]]] = deque()
        self.caches_blocks_early = caches_blocks_early(self.release)

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> RequestOutput | None:
        """Queue a request; one that can never run finishes FINISHED_IGNORED at once.

        A duplicate id fails alone ("error") and nothing of the original is touched:
        no finished id (the agent would drop the original's state); only what
        the duplicate's own params hold elsewhere is released. vLLM never sees one:
        its front makes ids unique (a random suffix).
        """
        original = self.requests.get(request.req_id)
        if original is not None:
            why = f"duplicate request id {request.req_id!r}"
            if (
                self.connector is not None
                and self.notifies_rejection
                and not _same_remote_send(original, request)
            ):
                self.connector.request_rejected(request.req_id, request.kv_transfer_params)
            return RequestOutput(request.req_id, [], "error", error=why)
        reason = self._why_unschedulable(request)
        if reason is not None:
            request.status = RequestStatus.FINISHED_IGNORED
            if self.connector is not None:
                # It may carry a remote prefill whose blocks P holds for us: the connector
                # must hear of it (it tells P to free them), and the id must reach the
                # connector's agent in a step, so it goes out like any finished id.
                self.connector.request_finished(request, [])
                self.finished_req_ids.add(request.req_id)
            # vLLM reports FINISHED_IGNORED as "length"; the reason is in `error`.
            return RequestOutput(request.req_id, [], request.get_finished_reason(), error=reason)
        self.requests[request.req_id] = request
        self.waiting.append(request)
        if self.connector is not None:
            self.connector.on_new_request(request)  # say, D starts heartbeating for it
        return None

    def reject_request(
        self, req_id: str, kv_transfer_params: dict | None, why: str
    ) -> RequestOutput:
        """A request that never became one (malformed): an error output, and the
        connector hears of it, since its params may hold blocks elsewhere (a remote
        prefill on P: the NIXL rule, an empty receive tells P to free). Its id goes
        out in the next step like a finished one, so that step comes. Before vLLM
        0.21 (#41269) the engine never heard of a refusal: only the output."""
        if self.connector is not None and kv_transfer_params and self.notifies_rejection:
            self.connector.request_rejected(req_id, kv_transfer_params)
            if req_id not in self.requests:  # never another request's finished id
                self.finished_req_ids.add(req_id)
        return RequestOutput(req_id, [], "error", error=why)

    def _why_unschedulable(self, request: Request) -> str | None:
        # vLLM's front rejects these prompts (input_processor); kvdrain ignores them.
        if request.num_prompt_tokens >= self.config.max_model_len:
            return (
                f"prompt has {request.num_prompt_tokens} tokens; max_model_len is "
                f"{self.config.max_model_len}"
            )
        # Its longest possible life must fit the pool alone, or it would wait forever.
        # vLLM has no counterpart: there such a request waits (or is preempted) forever.
        # The last sampled token never gets a KV slot: at most max_len - 1 are computed.
        max_len = min(request.num_prompt_tokens + request.max_tokens, self.config.max_model_len)
        need = self.kv_cache_manager.get_num_blocks_to_allocate(max_len - 1)
        if need > self.block_pool.num_usable_blocks:
            return (
                f"up to {max_len - 1} tokens of KV need {need} KV blocks; the pool has "
                f"{self.block_pool.num_usable_blocks}"
            )
        return None

    def finish_requests(self, req_ids: list[str], status: RequestStatus) -> list[RequestOutput]:
        """Finish requests from outside (abort). Unknown or finished ids are ignored (vLLM #25067)."""
        outputs = []
        for req_id in req_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            self._remove_from_queues(request)
            # vLLM #32255: an in-flight remote load may still write into these blocks.
            hold_for_recv = False
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                hold_for_recv = req_id not in self.finished_recving_kv_req_ids
                self.finished_recving_kv_req_ids.discard(req_id)
                self.failed_recving_kv_req_ids.discard(req_id)
            request.status = status
            params = self._free_request(request, hold_for_recv)
            outputs.append(
                RequestOutput(req_id, [], request.get_finished_reason(), kv_transfer_params=params)
            )
        return outputs

    def _remove_from_queues(self, request: Request) -> None:
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.skipped_waiting:
            self.skipped_waiting.remove(request)
        else:
            self.waiting.remove(request)

    def _free_request(self, request: Request, hold_for_recv: bool = False) -> dict | None:
        """A request just finished: ask the connector whether to delay freeing its blocks."""
        delay_free, params = False, None
        if self.connector is not None:  # always asked: a connector may hold state for it
            block_ids = self.kv_cache_manager.get_block_ids(request.req_id)
            delay_free, params = self.connector.request_finished(request, block_ids)
        self.finished_req_ids.add(request.req_id)
        self.deferred_req_ids.discard(request.req_id)
        if hold_for_recv:  # the receive's report frees it, whatever the connector said
            self.held_for_recv.add(request.req_id)
        elif delay_free:
            self.held_for_send.add(request.req_id)
        else:
            self._free_blocks(request)
        return params

    def _free_blocks(self, request: Request) -> None:
        self._free_request_blocks(request)
        del self.requests[request.req_id]

    # ---- schedule ------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput.empty()
        budget, running = self.config.max_num_batched_tokens, self.running
        if (
            running and self.fast_path
        ):  # the decodes up front; the loop past the first that is not one
            num_decodes = self._schedule_decodes(out, 0, budget)
            budget -= num_decodes
            if num_decodes < len(running) and budget > 0:
                budget = self._schedule_running(out, budget, num_decodes)
        elif running:
            budget = self._schedule_running(out, budget)
        # Like vLLM: no new admissions (nor promotions) in a step that had to preempt.
        # Most decode steps find both queues empty and make no call.
        if (self.skipped_waiting or self.waiting) and not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        if self.finished_req_ids:  # else out keeps NO_REQ_IDS
            out.finished_req_ids, self.finished_req_ids = self.finished_req_ids, set()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta(out)
        if self.defer_block_free and out.total_num_scheduled_tokens > 0:
            self.sched_step_seq += 1
        self._update_after_schedule(out)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int, req_index: int = 0) -> int:
        """running[req_index:] in order, each its remaining tokens within the budget."""
        running, fast_path = self.running, self.fast_path
        while req_index < len(running) and budget > 0:
            request = running[req_index]
            num_new = self._num_new_tokens(request, budget)
            if num_new > 0:
                new_blocks = self._allocate_or_preempt(request, num_new, out)
                if new_blocks is None:
                    break  # the request preempted itself: nothing else fits either
                self._add_scheduled(out, request, num_new, [b.block_id for b in new_blocks], False)
                budget -= num_new
            req_index += 1
            if fast_path and budget > 0:  # plain decodes up to the next request that needs more
                num_decodes = self._schedule_decodes(out, req_index, budget)
                req_index += num_decodes
                budget -= num_decodes
        return budget

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """A running request's tokens this step: those not computed yet, with the
        placeholders of tokens sampled in steps in flight; none once those steps reach
        max_tokens (vLLM: no extra step when the previous one is sure to finish it)."""
        computed, placeholders = request.num_computed_tokens, request.num_output_placeholders
        if (
            placeholders
            and computed + 2 - placeholders >= request.num_prompt_tokens + request.max_tokens
        ):
            return 0
        return min(
            request.num_tokens + placeholders - computed,
            budget,
            self.config.max_model_len - 1 - computed,
        )

    def _schedule_decodes(self, out: SchedulerOutput, req_index: int, budget: int) -> int:
        """The decode fast path: running[req_index:] while each needs exactly one token.
        (engine/core/decode_run.py takes k such steps at once: what one changes here and in
        _update_sampled, it changes too.)

        The same decisions as the loop above (tests/engine/core/test_scheduler_fast_paths.py checks it step by
        step): one token per request; no new block while the slot is inside the table
        (a request's table always covers its computed tokens, so a slot off a block
        boundary is), else one from the pool; a block the token fills gets its hash,
        the one allocate_slots would cache (earlier ones were cached as they filled).
        Stops at the first request that needs more, a full pool (the slow path
        preempts) or the end of the budget; returns how many it scheduled.
        """
        bs, kv, req_ids = self.block_size, self.kv_cache_manager, out.req_ids
        num_computed_tokens, token_ids = out.num_computed_tokens, out.token_ids
        max_computed, last_slot = self.config.max_model_len - 1, bs - 1
        num_before, running = len(req_ids), self.running
        if req_index or budget < len(running):  # else no copy: it walks every request twice
            running = running[req_index : req_index + budget]
        for request in running:
            num_computed = request.num_computed_tokens
            if request.num_tokens - num_computed != 1 or num_computed >= max_computed:
                break
            req_id = request.req_id
            slot = num_computed % bs
            if slot == 0:  # the slot starts a block: in the table already?
                new_block_ids = kv.append_slot(req_id, num_computed)
                if new_block_ids is None:
                    break
                if new_block_ids:
                    out.new_block_ids[req_id] = new_block_ids
            req_ids.append(req_id)
            num_computed_tokens.append(num_computed)
            token_ids.append(
                request.all_token_ids[num_computed]
            )  # the last (an index >= 0 is CPython's fast one)
            request.num_computed_tokens = num_computed + 1
            if slot == last_slot:  # the token fills its block
                kv.cache_blocks(request, num_computed + 1)
        num_decodes = len(req_ids) - num_before
        out.num_scheduled_tokens += [1] * num_decodes
        out.total_num_scheduled_tokens += num_decodes
        return num_decodes

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput):
        while True:
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_blocks is not None:
                return new_blocks
            # Recompute preemption, FCFS: the last admitted request goes first.
            victim = self.running[-1]
            if not self._request_blocks_can_be_freed(victim):
                return None  # a deferred free would not help now
            self.running.pop()
            self._preempt(victim, out)
            if victim is request:
                return None

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._free_request_blocks(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Its output in flight is stale: still delivered on return (unless a producer's
        # hand-off needs it recomputed), but it must not move the counters just reset.
        request.drop_stale_output = self.requires_kv_delivery or (
            request.drop_stale_output and request.num_stale_output_tokens > 0
        )
        request.num_stale_output_tokens = request.num_in_flight_tokens
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.add_preempted(request.req_id)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """vLLM's admission loop: requests holding KV blocks first, then `waiting`, in order.

        A finished remote load is promoted only here, when the loop reaches it with a
        seat and budget left. A skipped request (load in flight, connector not ready,
        load just started) goes back to the head of its queue, in order, at the end.
        """
        skipped_holding: list[Request] = []
        skipped: list[Request] = []
        while budget > 0:
            queue = self.skipped_waiting or self.waiting
            if not queue or len(self.running) >= self.config.max_num_seqs:
                break
            request = queue[0]
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                if request.req_id not in self.finished_recving_kv_req_ids:
                    skipped_holding.append(queue.popleft())
                    continue
                self._update_waiting_for_remote_kv(request)
            if self._must_wait_for_output(request):
                skipped.append(queue.popleft())
                continue
            admitted = self._try_admit(request, budget)
            if admitted is None:
                break  # not enough free blocks: wait, never preempt for a newcomer
            queue.popleft()
            if admitted < 0:  # skipped: a load started, or the connector can't tell yet
                holds_blocks = request.status == RequestStatus.WAITING_FOR_REMOTE_KVS
                (skipped_holding if holds_blocks else skipped).append(request)
                continue
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            block_ids = self.kv_cache_manager.get_block_ids(request.req_id)
            self._add_scheduled(out, request, admitted, block_ids, True)
            out.prompt_token_ids[request.req_id] = request.prompt_token_ids
            budget -= admitted
        self.skipped_waiting.extendleft(reversed(skipped_holding))
        self.waiting.extendleft(reversed(skipped))

    def _must_wait_for_output(self, request: Request) -> bool:
        """A preempted request whose stale output is still to be delivered: resuming
        now could resample a position that output later fills."""
        return bool(request.num_stale_output_tokens) and not request.drop_stale_output

    def _try_admit(self, request: Request, budget: int) -> int | None:
        """Tokens to schedule for a waiting request; -1 if it was skipped; None if no room."""
        hits, num_local, num_external, load_async = [], 0, 0, False
        num_computed = request.num_computed_tokens  # > 0: its remote load has landed
        if num_computed == 0:
            hits, num_local = self.kv_cache_manager.get_computed_blocks(request)
            if self.connector is not None:
                num_external, load_async = self.connector.get_num_new_matched_tokens(
                    request, num_local
                )
                if num_external is None:  # the connector can't tell yet: ask next step
                    self.deferred_req_ids.add(request.req_id)
                    return -1
                self.deferred_req_ids.discard(request.req_id)
            num_computed = num_local + num_external
        num_new = 0 if load_async else min(request.num_tokens - num_computed, budget)
        # vLLM also admits an async load only if it leaves the blocks that in-flight
        # prefills still need free (_inflight_prefill_reserved_blocks). With its
        # synchronous scheduler that reservation is always 0 here: a prefill stays in
        # flight only when the budget cut its chunk, and then no admission follows in
        # that step; so kvdrain leaves it out.
        new_blocks = self.kv_cache_manager.allocate_slots(
            request,
            num_new,
            hits,
            num_external,
            delay_cache_blocks=load_async,
            full_sequence_must_fit=self.config.scheduler_reserve_full_isl,
        )
        if new_blocks is None:
            return None
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_local
            self.num_prefix_hit_tokens += num_local
            self.num_prefix_query_tokens += request.num_tokens
        if self.connector is not None:
            block_ids = self.kv_cache_manager.get_block_ids(request.req_id)
            self.connector.update_state_after_alloc(request, block_ids, num_external)
        request.num_computed_tokens = num_computed
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            return -1
        return num_new

    def _add_scheduled(
        self,
        out: SchedulerOutput,
        request: Request,
        num_new: int,
        new_block_ids: list[int],
        is_new: bool,
    ) -> None:
        start = request.num_computed_tokens
        token_ids = request.all_token_ids[start : start + num_new]
        if len(token_ids) < num_new:  # the positions of tokens sampled in steps in flight
            token_ids += [PLACEHOLDER_TOKEN_ID] * (num_new - len(token_ids))
        out.add(
            ScheduledRequest(
                req_id=request.req_id,
                token_ids=token_ids,
                num_computed_tokens=start,
                new_block_ids=new_block_ids,
                is_new=is_new,
                sample=start + num_new >= request.num_tokens,
            )
        )
        out.total_num_scheduled_tokens += num_new
        # Like vLLM's _update_after_schedule: computed as soon as it is scheduled.
        request.num_computed_tokens += num_new

    def _update_after_schedule(self, out: SchedulerOutput) -> None:
        """vLLM's: the step's tokens are in flight until its output is processed.
        (num_computed_tokens moved as each request was scheduled: the fast paths need it
        there.)"""
        if not self.multiple_inflight_batches:
            return
        requests, seq = self.requests, self.sched_step_seq
        for req_id, num_new in zip(out.req_ids, out.num_scheduled_tokens):
            request = requests[req_id]
            request.num_in_flight_tokens += num_new
            if self.defer_block_free:
                request.last_sched_seq = seq

    # ---- update --------------------------------------------------------------

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> StepOutputs:
        if self.defer_block_free and sched_out.total_num_scheduled_tokens > 0:
            # Every write of this and earlier steps is done: deferred blocks may go back.
            self.processed_step_seq += 1
            self._drain_deferred_frees()
        outputs = StepOutputs()
        kv_out = runner_out.kv_connector_output  # None: no reports (no connector, say)
        if self.connector is not None:  # first: it may say the worker process is gone
            kv_out = kv_out or KVConnectorOutput()
            self.connector.update_connector_output(kv_out)
        elif kv_out is None and self.fast_path and not runner_out.failed:
            # No reports and nothing failed: the sampled tokens are the whole update.
            if self._update_sampled(sched_out, runner_out.sampled_token_ids, outputs):
                self._remove_finished()
            return outputs
        failed_ids: set[str] | frozenset[str] = _NO_IDS
        if kv_out is not None and kv_out.invalid_block_ids:  # before the tokens, like vLLM
            failed_ids = self._handle_invalid_blocks(kv_out.invalid_block_ids, sched_out)
        if self.fast_path and not failed_ids and not runner_out.failed:
            any_finished = self._update_sampled(sched_out, runner_out.sampled_token_ids, outputs)
        else:
            any_finished = self._update_scheduled(sched_out, runner_out, failed_ids, outputs)
        if any_finished:
            self._remove_finished()
        if failed_ids and self.config.kv_load_failure_policy == "fail":
            outputs.extend(
                self._fail_requests(sorted(failed_ids), "KV load from the remote engine failed")
            )
        if kv_out is not None:
            self._update_from_kv_xfer_finished(kv_out)
        return outputs

    def _remove_finished(self) -> None:
        self.running = [
            r for r in self.running if r.status <= _PREEMPTED
        ]  # r.is_finished(), inline

    def _update_scheduled(
        self,
        sched_out: SchedulerOutput,
        runner_out: ModelRunnerOutput,
        failed_ids: set[str],
        outputs: StepOutputs,
    ) -> bool:
        """Each scheduled request's result, into `outputs` (vLLM's update loop); True if
        a running one finished."""
        any_finished = False
        stopped_waiting: list[Request] = []
        for req_id, num_new in zip(sched_out.req_ids, sched_out.num_scheduled_tokens):
            request = self.requests.get(req_id)
            is_stale = request is not None and self._land_in_flight_tokens(request, num_new)
            if request is None or request.is_finished() or req_id in failed_ids:
                continue  # aborted while the step ran, or its KV turned out bad
            if is_stale and request.drop_stale_output:
                continue  # its positions are computed again since the preemption
            status_before = request.status
            output = self._update_request(request, runner_out, is_stale)
            if output is None:
                continue
            outputs.append(output)
            if request.is_finished():
                if status_before == _RUNNING:
                    any_finished = True
                else:  # stale output stopped a preempted request
                    stopped_waiting.append(request)
        for request in stopped_waiting:
            self._remove_from_waiting(request)
        return any_finished

    def _land_in_flight_tokens(self, request: Request, num_new: int) -> bool:
        """The step's tokens leave the in-flight count; True if they are stale (scheduled
        before a preemption)."""
        if not self.multiple_inflight_batches:
            return False
        request.num_in_flight_tokens -= num_new
        if request.num_stale_output_tokens > 0:
            request.num_stale_output_tokens -= num_new
            return True
        return False

    def _remove_from_waiting(self, request: Request) -> None:
        if request in self.skipped_waiting:
            self.skipped_waiting.remove(request)
        else:
            self.waiting.remove(request)

    def _update_sampled(
        self, sched_out: SchedulerOutput, sampled_token_ids: dict[str, int], outputs: StepOutputs
    ) -> bool:
        """_update_scheduled's fast path for a step in which nothing failed.

        The same outputs: a request that may stop goes through check_stop and
        _free_request like any other; the rest are plain outputs, three column
        entries each (StepOutputs) and no object.

        The step's requests lead `running`, in scheduling order (running ones first,
        then admissions, which schedule() appended): each is read from there, not
        looked up by id, unless the request at its place is another (one left running
        while the step ran: an abort) or running ran out. A request in running is the
        one `requests` holds under its id, so the lookup would find the same, and is
        not finished (finishing takes a request out of running), so only a looked-up
        one can be.
        """
        requests, max_len, req_ids = self.requests, self.config.max_model_len, sched_out.req_ids
        out_ids, out_tokens, out_cached = (
            outputs.req_ids,
            outputs.new_token_ids,
            outputs.num_cached_tokens,
        )
        bs = self.block_size
        any_finished = False
        running = self.running
        if len(running) < len(req_ids):  # some left it: the places past its end hold None
            running = running + [None] * (len(req_ids) - len(running))
        for request, req_id in zip(running, req_ids):
            if request is None or request.req_id is not req_id:
                request = requests.get(req_id)
                if request is None or request.status > _PREEMPTED:
                    continue  # aborted while the step ran
            token = sampled_token_ids.get(req_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end
            # request.append_output_token_ids(token), inline:
            request.all_token_ids.append(token)
            request.num_tokens = num_tokens = request.num_tokens + 1
            if num_tokens % bs == 0:
                hash_request_blocks(request.all_token_ids, bs, request.block_hashes)
            # check_stop's conditions: if one holds, check_stop decides. (An int compared
            # with a None eos takes CPython's slow path, both sides' __eq__: hence `is`.)
            eos = request.eos_token_id
            if (
                (eos is not None and token == eos)
                or token in request.stop_token_ids
                or num_tokens >= max_len
                or num_tokens - request.num_prompt_tokens >= request.max_tokens
            ):
                outputs.append(self._stop_request(request, token))
                any_finished = any_finished or request.is_finished()
                continue
            # RequestOutput(req_id, [token], num_cached_tokens=...), as columns:
            out_ids.append(req_id)
            out_tokens.append(token)
            num_cached = request.num_cached_tokens
            out_cached.append(num_cached if num_cached > 0 else 0)
        return any_finished

    def _stop_request(self, request: Request, token: int) -> RequestOutput:
        """The output of a request that just sampled `token` and may have to stop."""
        return self._token_output(request, token, check_stop(request, self.config.max_model_len))

    def _token_output(self, request: Request, token: int, stopped: bool) -> RequestOutput:
        params = self._free_request(request) if stopped else None
        return RequestOutput(
            request.req_id,
            [token],
            request.get_finished_reason(),
            params,
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )

    def _update_request(
        self, request: Request, runner_out: ModelRunnerOutput, is_stale: bool
    ) -> RequestOutput | None:
        error = runner_out.failed.get(request.req_id)
        if error is not None:
            request.status = RequestStatus.FINISHED_ERROR
            params = self._free_request(request)
            return RequestOutput(request.req_id, [], "error", params, error=error)
        token = runner_out.sampled_token_ids.get(request.req_id)
        if token is None:
            return None  # a prefill chunk that did not reach the end
        status_before = request.status
        has_placeholders = request.num_output_placeholders > 0
        stopped = self._update_request_with_output(request, token, is_stale)
        if (
            self.caches_blocks_early
            and has_placeholders
            and not is_stale
            and status_before == _RUNNING
        ):  # before a stop frees them
            self.kv_cache_manager.cache_blocks(
                request, request.num_computed_tokens - request.num_in_flight_tokens
            )
        return self._token_output(request, token, stopped)

    def _update_request_with_output(self, request: Request, token: int, is_stale: bool) -> bool:
        """Append a sampled token; True if the request stops. A token that was a
        placeholder is one no more (stale output predates the preemption's reset)."""
        request.append_output_token_ids(token)
        stopped = check_stop(request, self.config.max_model_len)
        if not is_stale and request.num_output_placeholders > 0:
            request.num_output_placeholders -= 1
        return stopped

    def _fail_requests(self, req_ids: list[str], why: str) -> list[RequestOutput]:
        outputs = self.finish_requests(req_ids, RequestStatus.FINISHED_ERROR)
        for output in outputs:
            output.error = why
        return outputs

    # ---- steps in flight (async scheduling) ----------------------------------------
    # Step N+1 is scheduled before step N's output is processed (engine/core/batch_queue.py).
    # A decode scheduled while its previous token is in flight computes a placeholder
    # (AsyncScheduler counts them, num_output_placeholders); its token id is
    # PLACEHOLDER_TOKEN_ID until the batch queue fills it from the step in flight, as
    # vLLM's model runner does. num_in_flight_tokens counts the tokens of unprocessed
    # steps; a preemption makes them stale (num_stale_output_tokens): still delivered
    # unless drop_stale_output, and a request with deliverable stale output is not
    # resumed until it lands. A consumer (D) defers the free of a request scheduled in
    # an unprocessed step until that step's output is processed, and does not preempt
    # such a request to make room.

    def _request_blocks_can_be_freed(self, request: Request) -> bool:
        return not self.defer_block_free or request.last_sched_seq <= self.processed_step_seq

    def _free_request_blocks(self, request: Request) -> None:
        """Return a finished or preempted request's blocks to the pool, or set them aside
        while a step in flight may still write them."""
        if self._request_blocks_can_be_freed(request):
            self.kv_cache_manager.free(request)
            return
        blocks = self.kv_cache_manager.pop_blocks_for_free(request)
        if blocks:
            self.deferred_frees.append((self.sched_step_seq, blocks))

    def _drain_deferred_frees(self) -> None:
        pool = self.kv_cache_manager.block_pool
        while self.deferred_frees and self.deferred_frees[0][0] <= self.processed_step_seq:
            _, blocks = self.deferred_frees.popleft()
            pool.free_blocks(blocks[::-1])  # tail first: tail blocks are evicted first

    def has_deferred_frees(self) -> bool:
        return bool(self.deferred_frees)

    # ---- KV transfer: remote loads, delayed frees, reports ----------------------
    # Reports come from the connector's agent through the runner output. Each finished
    # request that still holds blocks waits for exactly one report: `held_for_send`
    # (the connector delayed its free) for finished_sending, `held_for_recv` (aborted
    # while its remote load was in flight, vLLM #32255) for finished_recving. Anything
    # else is stale or a duplicate (vLLM #46240, #25067): counted and ignored (vLLM
    # asserts). Reports are handled in sorted id order, the same in every process;
    # vLLM iterates its sets, an order that depends on PYTHONHASHSEED.

    def _update_waiting_for_remote_kv(self, request: Request) -> None:
        """Promote a request whose remote load finished (vLLM's lazy promotion).

        Caches the loaded blocks (a failed load: only its valid prefix; with none
        valid it frees them and starts over, with a fresh prefix lookup), then, if
        the whole sequence is there, recomputes the last token to sample from it.
        """
        req_id = request.req_id
        if req_id in self.failed_recving_kv_req_ids:
            self.failed_recving_kv_req_ids.remove(req_id)
            if request.num_computed_tokens:
                self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            else:
                self.kv_cache_manager.free(request)
        else:
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
        if request.num_computed_tokens == request.num_tokens:
            request.num_computed_tokens = request.num_tokens - 1
        self.finished_recving_kv_req_ids.remove(req_id)
        request.status = (
            RequestStatus.PREEMPTED if request.num_preemptions else RequestStatus.WAITING
        )

    def _update_from_kv_xfer_finished(self, kv_out: KVConnectorOutput) -> None:
        for req_id in sorted(kv_out.finished_recving):
            self._on_finished_recving(req_id)
        for req_id in sorted(kv_out.finished_sending):
            if req_id in self.held_for_send:
                self.held_for_send.remove(req_id)
                self._free_blocks(self.requests[req_id])
            else:
                self.num_stale_kv_reports += 1

    def _on_finished_recving(self, req_id: str) -> None:
        if req_id in self.held_for_recv:
            self.held_for_recv.remove(req_id)
            self._free_blocks(self.requests[req_id])
            return
        request = self.requests.get(req_id)
        if (
            request is None
            or request.status != RequestStatus.WAITING_FOR_REMOTE_KVS
            or req_id in self.finished_recving_kv_req_ids
        ):
            self.num_stale_kv_reports += 1
            return
        self.finished_recving_kv_req_ids.add(req_id)

    def _handle_invalid_blocks(
        self, invalid_block_ids: set[int], sched_out: SchedulerOutput
    ) -> set[str]:
        """vLLM's _handle_invalid_blocks: requests whose KV lost blocks keep only the
        valid prefix before the first lost block. Loads in flight (WAITING_FOR_REMOTE_KVS)
        and running requests are both cut back. Returns the ids the token loop skips:
        all of them under policy "fail" (they then fail), the running ones under
        "recompute" (they recompute next step; the loads retry on promotion)."""
        num_scheduled = dict(zip(sched_out.req_ids, sched_out.num_scheduled_tokens))
        matched: set[int] = set()
        loading = [
            r for r in self.skipped_waiting if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        ]
        kv = self.kv_cache_manager
        async_failed, _ = cut_back_to_valid_prefix(
            loading, invalid_block_ids, num_scheduled, kv, matched
        )
        sync_failed, to_evict = cut_back_to_valid_prefix(
            self.running, invalid_block_ids, num_scheduled, kv, matched
        )
        for req_id in self.held_for_recv:  # an aborted load's report: expected, not stale
            matched.update(self.kv_cache_manager.get_block_ids(req_id))
        self.num_stale_kv_reports += len(invalid_block_ids - matched)
        self.num_kv_load_failures += len(async_failed) + len(sync_failed)
        if self.config.kv_load_failure_policy == "fail":
            # The bad KV and everything after it must not serve prefix hits.
            self.kv_cache_manager.evict_blocks(to_evict)
            return async_failed | sync_failed
        self.failed_recving_kv_req_ids |= async_failed
        return sync_failed

    # ---- liveness --------------------------------------------------------------

    def get_num_unfinished_requests(self) -> int:
        return len(self.waiting) + len(self.skipped_waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.skipped_waiting or self.running)

    def has_finished_requests(self) -> bool:
        if self.finished_req_ids:
            return True
        if self.config.liveness == "legacy" or self.connector is None:
            return False  # vLLM before #43433: only ids not yet shipped count
        # vLLM #43433: entries of `requests` in no queue are finished requests whose
        # blocks a connector still holds (delayed free, aborted remote load).
        return len(self.requests) > self.get_num_unfinished_requests()

    def has_requests(self) -> bool:
        """has_unfinished_requests() or has_finished_requests(), asked every step:
        without unfinished requests, #43433's count is just `requests` being non-empty."""
        if self.waiting or self.skipped_waiting or self.running or self.finished_req_ids:
            return True
        return (
            bool(self.requests) and self.connector is not None and self.config.liveness != "legacy"
        )

    def can_progress(self, sched_out: SchedulerOutput, got_kv_reports: bool) -> bool:
        """After a step: could the next schedule() do work without a new report or input?

        (engine/core/liveness.py next_action.) Consumed reports count only while unfinished
        requests remain: a report that only freed a finished request's blocks leaves
        nothing for the next step to do.
        """
        return (
            (got_kv_reports and self.has_unfinished_requests())
            or bool(sched_out.preempted_req_ids)
            or self.has_pending_updates()
        )

    def has_pending_updates(self) -> bool:
        """Work for the next schedule() that needs no new report: finished ids to ship.

        Not finished receives: the step after their report tries to promote them, and
        one it cannot promote (no seat, no blocks) waits for something else to change
        (a running request's step, a report, an input), or an event loop would spin.
        """
        return bool(self.finished_req_ids)

    def has_deferred_requests(self) -> bool:
        """Requests a connector told to ask again later."""
        return bool(self.deferred_req_ids)

    def make_stats(self) -> SchedulerStats:
        pool, skipped = self.block_pool, self.skipped_waiting
        num_remote = (
            sum(r.status == RequestStatus.WAITING_FOR_REMOTE_KVS for r in skipped) if skipped else 0
        )
        return SchedulerStats(
            num_waiting=len(self.waiting),
            num_skipped_waiting=len(self.skipped_waiting),
            num_waiting_for_remote_kvs=num_remote,
            num_running=len(self.running),
            num_finished_awaiting_free=len(self.requests) - self.get_num_unfinished_requests(),
            num_usable_blocks=pool.num_usable_blocks,
            num_used_blocks=pool.get_num_used_blocks(),
            num_cached_blocks=pool.num_cached_free_blocks,
            num_free_blocks=pool.get_num_free_blocks(),
            num_preemptions=self.num_preemptions,
            num_stale_kv_reports=self.num_stale_kv_reports,
            num_prefix_hit_tokens=self.num_prefix_hit_tokens,
            num_prefix_query_tokens=self.num_prefix_query_tokens,
            num_kv_load_failures=self.num_kv_load_failures,
        )


def _same_remote_send(original: Request, duplicate: Request) -> bool:
    """Both name the same remote send (a resent request): releasing it would take
    the original's KV away."""
    keys = ("remote_engine_id", "remote_request_id", "remote_block_ids")
    a, b = original.kv_transfer_params or {}, duplicate.kv_transfer_params or {}
    return all(a.get(k) == b.get(k) for k in keys)
