"""kvdrain's pure EngineCore (with connector/pd.py's scheduler half for P/D) behind the harness's side API.

Runs in: the parity venv; kvdrain is imported from the repo root on sys.path (its pure
core needs the stdlib, plus msgpack through connector/messages.py), never installed.
EngineCore.step is what the engine loop calls (the sync step, or the batch queue's
under async scheduling); the fakes play its model runner and its connector's agent and worker.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import islice

from connector.pd import PDConnector
from engine.config import EngineConfig, KVTransferConfig
from engine.core.block_pool import BlockPool
from engine.core.engine_core import EngineCore
from engine.core.kv_connector import KVConnectorAgentBase, KVConnectorMetadata
from engine.core.outputs import KVConnectorOutput, ModelRunnerOutput, SchedulerOutput
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler
from tests.parity.fakes import FakeKVWorker, FakeModel
from tests.parity.spec import RequestSpec, SchedConfig, Snapshot, StepOutput

KV_ROLES = {"P": "kv_producer", "D": "kv_consumer"}


def build_engine_config(config: SchedConfig) -> EngineConfig:
    kv_transfer = None
    if config.role is not None:
        kv_transfer = KVTransferConfig(kv_role=KV_ROLES[config.role], kv_addr="")
    return EngineConfig(
        engine_id=config.role or "engine",
        num_blocks=config.num_blocks,
        block_size=config.block_size,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        eos_token_id=config.eos_token_id,
        liveness="legacy" if config.legacy else "poll",
        kv_transfer=kv_transfer,
        scheduler_reserve_full_isl=config.reserve_full_isl,
        kv_load_failure_policy=config.kv_load_failure_policy,
        async_scheduling=config.async_scheduling,
        vllm_release=config.vllm_release,
    )


class EvictionCounter:
    """Counts prefix-cache evictions (a hashed block reused for new data)."""

    def __init__(self, pool: BlockPool) -> None:
        self.count = 0
        original = pool._maybe_evict_cached_block

        def counting(block):
            self.count += block.block_hash is not None
            return original(block)

        pool._maybe_evict_cached_block = counting
        # get_new_blocks evicts the hashes of the blocks it takes inline, not through
        # _maybe_evict_cached_block: count the hashed ones among the n it will take.
        get_new_blocks = pool.get_new_blocks

        def counting_get(num_blocks):
            if num_blocks <= pool.get_num_free_blocks():  # else it raises, taking none
                taken = islice(pool.free_block_queue, num_blocks)
                self.count += sum(block.block_hash is not None for block in taken)
            return get_new_blocks(num_blocks)

        pool.get_new_blocks = counting_get


class FakeRunner:
    """The model runner: one token per chunk that reaches the end, from the fake model.
    Aborts that arrive while it runs a request's last prefill chunk go to `abort` (the
    engine core's aborts_queue)."""

    def __init__(self, model: FakeModel, aborts_in_last_prefill: frozenset[str]) -> None:
        self.model = model
        self.aborts_in_last_prefill = aborts_in_last_prefill
        self.scheduler: Scheduler | None = None
        self.abort: Callable[[str], None] | None = None
        self.last: SchedulerOutput | None = None  # the batch it ran last

    def execute(self, sched_out: SchedulerOutput) -> ModelRunnerOutput:
        self.last = sched_out
        sampled = {}
        for sched_req in sched_out.scheduled:
            if sched_req.sample:
                request = self.scheduler.requests[sched_req.req_id]
                # The sampled token's place among the outputs (vllm_side.py's rule).
                position = (
                    sched_req.num_computed_tokens
                    + len(sched_req.token_ids)
                    - request.num_prompt_tokens
                )
                sampled[sched_req.req_id] = self.model.token(
                    sched_req.req_id, position, request.stop_token_ids
                )
        for req_id in sampled.keys() & self.aborts_in_last_prefill:
            if not self.scheduler.requests[req_id].output_token_ids:
                self.abort(req_id)  # arrived during the forward (vllm_side.py's rule)
        return ModelRunnerOutput(sampled_token_ids=sampled)


class FakeAgent(KVConnectorAgentBase):
    """The connector's agent: hands the fake worker its transfers and returns its reports at `now`."""

    def __init__(self, worker: FakeKVWorker) -> None:
        self.worker = worker
        self.now = 0
        self.released: tuple[str, ...] = ()  # by the last metadata

    def start_load_kv(self, metadata: KVConnectorMetadata | None) -> None:
        if metadata is None:
            return
        self.released = tuple(
            sorted(
                [r for r, spec in metadata.reqs_to_recv.items() if not spec.local_block_ids]
                + [spec.req_id for spec in metadata.reqs_to_release]
            )
        )
        recvs = {
            req_id: list(spec.local_block_ids)
            for req_id, spec in metadata.reqs_to_recv.items()
            if spec.local_block_ids
        }  # an empty read only tells P to free
        self.worker.register(self.now, sorted(metadata.reqs_to_send), recvs)

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        reports = self.worker.reports(self.now)
        return KVConnectorOutput(
            set(reports.finished_sending),
            set(reports.finished_recving),
            set(reports.invalid_block_ids),
        )


class Coverage:
    """Counts the in-flight cases a run reached (kvdrain's side; the sides agree on them):
    a preemption or an abort while the request's output is in flight, a free deferred
    for a step in flight, the connector reports consumed (delayed frees, loads), and the
    faults: sends freed after a dropped or refused D leg, aborts during a last prefill
    step, legs D refused before admission."""

    NAMES = (
        "preempted_in_flight",
        "aborted_in_flight",
        "deferred_frees",
        "kv_reports",
        "dropped_legs",
        "refused_legs",
        "aborted_in_last_prefill",
        "refused_at_d",
    )

    def __init__(self, scheduler: Scheduler, leg_faults: dict[str, str]) -> None:
        self.counts = dict.fromkeys(self.NAMES, 0)
        preempt, release = scheduler._preempt, scheduler._free_request_blocks
        on_reports = scheduler._update_from_kv_xfer_finished
        can_free = scheduler._request_blocks_can_be_freed

        def counting_preempt(request, out):
            self.counts["preempted_in_flight"] += request.num_in_flight_tokens > 0
            preempt(request, out)

        def counting_release(request):
            self.counts["deferred_frees"] += not can_free(request)
            release(request)

        def counting_reports(kv_out):
            self.counts["kv_reports"] += len(kv_out.finished_sending) + len(kv_out.finished_recving)
            for req_id in kv_out.finished_sending:
                fault = leg_faults.get(req_id)
                if fault is not None:
                    self.counts["dropped_legs" if fault == "dropped" else "refused_legs"] += 1
            on_reports(kv_out)

        scheduler._preempt = counting_preempt
        scheduler._free_request_blocks = counting_release
        scheduler._update_from_kv_xfer_finished = counting_reports


class KvdrainSide:
    name = "kvdrain"

    def __init__(
        self,
        config: SchedConfig,
        model: FakeModel,
        worker: FakeKVWorker,
        aborts_in_last_prefill: frozenset[str] = frozenset(),
    ) -> None:
        self.config = config
        engine_config = build_engine_config(config)
        connector = PDConnector(engine_config) if config.role is not None else None
        self.runner = FakeRunner(model, aborts_in_last_prefill)
        self.agent = FakeAgent(worker) if config.role is not None else None
        self.core = EngineCore(engine_config, self.runner, connector, self.agent)
        self.scheduler = self.core.scheduler
        self.runner.scheduler = self.scheduler
        self.runner.abort = self._abort_in_step
        self.aborted_in_step: set[str] = set()
        self.evictions = EvictionCounter(self.scheduler.block_pool)
        self.coverage = Coverage(self.scheduler, worker.leg_faults)

    def add(self, spec: RequestSpec) -> None:
        request = Request(
            spec.req_id,
            list(spec.prompt),
            spec.max_tokens,
            self.config.block_size,
            eos_token_id=self.config.eos_token_id,
            stop_token_ids=spec.stop_token_ids,
            kv_transfer_params=spec.kv_transfer_params(self.config.block_size),
        )
        self.core.add(request)

    def abort(self, req_id: str) -> None:
        request = self.scheduler.requests.get(req_id)
        if request is not None and not request.is_finished():
            self.coverage.counts["aborted_in_flight"] += request.num_in_flight_tokens > 0
        self.core.abort_requests([req_id])

    def _abort_in_step(self, req_id: str) -> None:
        """An abort that arrives during the forward: the engine core's aborts_queue, taken
        before the step's output or not at all, as the release kvdrain follows does."""
        self.coverage.counts["aborted_in_last_prefill"] += 1
        self.aborted_in_step.add(req_id)
        self.core.aborts_queue.append(req_id)

    def reject(self, spec: RequestSpec) -> None:
        """D refuses the request before admission (an error output; its params' send on P
        is released)."""
        self.coverage.counts["refused_at_d"] += 1
        params = spec.kv_transfer_params(self.config.block_size)
        self.scheduler.reject_request(spec.req_id, params, "refused before admission")

    def step(self, now: int) -> Snapshot:
        """EngineCore.step: nothing when has_work() is false (the loop would block)."""
        if self.agent is not None:
            self.agent.now = now
            self.agent.released = ()
        if not self.core.has_work():
            return self.snapshot(Snapshot())
        self.runner.last = None
        result = self.core.step()
        sched_out = self.runner.last  # None: this step only processed a batch in flight
        snap = Snapshot(stepped=True)
        if sched_out is not None:
            snap.num_scheduled = dict(zip(sched_out.req_ids, sched_out.num_scheduled_tokens))
            snap.new_req_ids = tuple(sorted(sched_out.new_req_ids))
        # An abort taken from the aborts queue answers the frontend's abort (kvdrain's
        # frontend reads it); vLLM's output processor ends the request itself.
        in_step, self.aborted_in_step = self.aborted_in_step, set()
        snap.outputs = sorted(
            (
                StepOutput(o.req_id, tuple(o.new_token_ids), o.finish_reason)
                for o in result.outputs
                if not (o.req_id in in_step and o.finish_reason == "abort")
            ),
            key=lambda o: o.req_id,
        )
        return self.snapshot(snap)

    def snapshot(self, snap: Snapshot) -> Snapshot:
        sched = self.scheduler
        pool = sched.block_pool
        snap.free = pool.get_num_free_blocks()
        snap.used = pool.get_num_used_blocks()
        snap.cached_free = pool.num_cached_free_blocks
        snap.running = len(sched.running)
        snap.waiting = len(sched.waiting) + len(sched.skipped_waiting)
        snap.waiting_for_remote_kvs = sum(
            1 for r in sched.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        )
        snap.held = len(sched.requests) - sched.get_num_unfinished_requests()
        snap.evictions = self.evictions.count
        snap.preemptions = sched.num_preemptions
        snap.has_requests = sched.has_requests()
        snap.has_unfinished_requests = sched.has_unfinished_requests()
        snap.in_flight = len(self.core.batch_queue or ())
        snap.released = self.agent.released if self.agent is not None else ()
        snap.block_tables = {
            req_id: tuple(sched.kv_cache_manager.get_block_ids(req_id))
            for req_id in sorted(sched.requests)
        }
        return snap
