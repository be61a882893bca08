"""kvdrain's pure Scheduler (with connector/pd.py's scheduler half for P/D) behind the harness's side API.

Runs in: the parity venv; kvdrain is imported from the repo root on sys.path (its pure
core needs the stdlib, plus msgpack through connector/messages.py), never installed.
"""
from __future__ import annotations

from itertools import islice

from connector.pd import PDConnector
from engine.core.block_pool import BlockPool
from engine.config import EngineConfig, KVTransferConfig
from engine.core.outputs import KVConnectorOutput, ModelRunnerOutput
from engine.core.request import Request, RequestStatus
from engine.core.scheduler import Scheduler

from tests.parity.fakes import FakeKVWorker, FakeModel
from tests.parity.spec import RequestSpec, SchedConfig, Snapshot, StepOutput

KV_ROLES = {"P": "kv_producer", "D": "kv_consumer"}


def build_engine_config(config: SchedConfig) -> EngineConfig:
    kv_transfer = None
    if config.role is not None:
        kv_transfer = KVTransferConfig(kv_role=KV_ROLES[config.role], kv_addr="")
    return EngineConfig(engine_id=config.role or "engine", num_blocks=config.num_blocks,
                        block_size=config.block_size, max_num_seqs=config.max_num_seqs,
                        max_num_batched_tokens=config.max_num_batched_tokens,
                        max_model_len=config.max_model_len, eos_token_id=config.eos_token_id,
                        liveness="legacy" if config.legacy else "poll", kv_transfer=kv_transfer,
                        scheduler_reserve_full_isl=config.reserve_full_isl,
                        kv_load_failure_policy=config.kv_load_failure_policy)


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


class KvdrainSide:
    name = "kvdrain"

    def __init__(self, config: SchedConfig, model: FakeModel, worker: FakeKVWorker) -> None:
        self.config = config
        self.model = model
        self.worker = worker
        engine_config = build_engine_config(config)
        connector = PDConnector(engine_config) if config.role is not None else None
        self.scheduler = Scheduler(engine_config, connector)
        self.evictions = EvictionCounter(self.scheduler.block_pool)

    def add(self, spec: RequestSpec) -> None:
        request = Request(spec.req_id, list(spec.prompt), spec.max_tokens, self.config.block_size,
                          eos_token_id=self.config.eos_token_id,
                          stop_token_ids=spec.stop_token_ids,
                          kv_transfer_params=spec.kv_transfer_params(self.config.block_size))
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    def step(self, now: int) -> Snapshot:
        """EngineCore.step(): nothing when has_requests() is false (the loop would block)."""
        if not self.scheduler.has_requests():
            return self.snapshot(Snapshot())
        sched_out = self.scheduler.schedule()
        self._register_transfers(now, sched_out.kv_connector_metadata)
        runner_out = self._run_model(sched_out, now)
        outputs = self.scheduler.update_from_output(sched_out, runner_out)
        snap = Snapshot(stepped=True,
                        num_scheduled={s.req_id: len(s.token_ids) for s in sched_out.scheduled})
        snap.outputs = sorted((StepOutput(o.req_id, tuple(o.new_token_ids), o.finish_reason)
                               for o in outputs), key=lambda o: o.req_id)
        return self.snapshot(snap)

    def _register_transfers(self, now: int, meta) -> None:
        if meta is None:
            return
        recvs = {req_id: list(spec.local_block_ids) for req_id, spec in meta.reqs_to_recv.items()
                 if spec.local_block_ids}  # an empty read only tells P to free
        self.worker.register(now, sorted(meta.reqs_to_send), recvs)

    def _run_model(self, sched_out, now: int) -> ModelRunnerOutput:
        sampled = {}
        for sched_req in sched_out.scheduled:
            if sched_req.sample:
                request = self.scheduler.requests[sched_req.req_id]
                sampled[sched_req.req_id] = self.model.token(
                    sched_req.req_id, request.num_output_tokens, request.stop_token_ids)
        reports = self.worker.reports(now)
        kv_out = None
        if self.config.role is not None:
            kv_out = KVConnectorOutput(set(reports.finished_sending), set(reports.finished_recving),
                                       set(reports.invalid_block_ids))
        return ModelRunnerOutput(sampled_token_ids=sampled, kv_connector_output=kv_out)

    def snapshot(self, snap: Snapshot) -> Snapshot:
        sched = self.scheduler
        pool = sched.block_pool
        snap.free = pool.get_num_free_blocks()
        snap.used = pool.get_num_used_blocks()
        snap.cached_free = pool.num_cached_free_blocks
        snap.running = len(sched.running)
        snap.waiting = len(sched.waiting) + len(sched.skipped_waiting)
        snap.waiting_for_remote_kvs = sum(1 for r in sched.requests.values()
                                          if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
        snap.held = len(sched.requests) - sched.get_num_unfinished_requests()
        snap.evictions = self.evictions.count
        snap.preemptions = sched.num_preemptions
        snap.has_requests = sched.has_requests()
        snap.has_unfinished_requests = sched.has_unfinished_requests()
        snap.block_tables = {req_id: tuple(sched.kv_cache_manager.get_block_ids(req_id))
                             for req_id in sorted(sched.requests)}
        return snap
