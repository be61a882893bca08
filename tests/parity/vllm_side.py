"""vLLM's real v1 Scheduler (or AsyncScheduler), built offline on the CPU, behind the harness's side API.

Runs in: the parity venv (.venv-parity-<version>), never in the default test run: a
tiny Llama config.json in a temp dir, HF_HUB_OFFLINE, async_scheduling as the workload
says (False: the synchronous Scheduler; True: the AsyncScheduler, stepped as
EngineCore.step_with_batch_queue steps it), a hand-made KVCacheConfig and, for P/D,
the NIXL connector's scheduler half (no NIXL library needed).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

from collections import deque  # noqa: E402

import torch  # noqa: E402
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,  # noqa: E402
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.async_scheduler import AsyncScheduler  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,  # noqa: E402
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

from tests.parity.fakes import FakeKVWorker, FakeModel  # noqa: E402
from tests.parity.spec import RequestSpec, SchedConfig, Snapshot, StepOutput  # noqa: E402
from tests.parity.switches import VllmSwitches, apply  # noqa: E402

# Expected events (a failed load, recovered or failed) are not news here.
logging.getLogger("vllm").setLevel(logging.CRITICAL)

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
}
KV_ROLES = {"P": "kv_producer", "D": "kv_consumer"}
BATCH_QUEUE_SIZE = 2  # vllm_config.max_concurrent_batches with async scheduling, no PP


def _model_dir() -> str:
    path = os.path.join(tempfile.gettempdir(), "kvdrain-parity-tiny-llama")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(TINY_LLAMA, f)
    return path


def build_vllm_config(config: SchedConfig, switches: VllmSwitches) -> VllmConfig:
    model = ModelConfig(
        model=_model_dir(),
        dtype="float32",
        seed=0,
        skip_tokenizer_init=True,
        max_model_len=config.max_model_len,
    )
    sched = SchedulerConfig(
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=config.max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=config.async_scheduling,
        scheduler_reserve_full_isl=(config.reserve_full_isl and switches.reserve_full_isl),
    )
    kv_transfer = None
    if config.role is not None:
        kv_transfer = KVTransferConfig(
            kv_connector="NixlConnector",
            kv_role=KV_ROLES[config.role],
            engine_id=config.role,
            kv_load_failure_policy=(
                switches.kv_load_failure_policy or config.kv_load_failure_policy
            ),
        )
    vllm_config = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=CacheConfig(block_size=config.block_size, enable_prefix_caching=True),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=kv_transfer,
    )
    vllm_config.cache_config.num_gpu_blocks = config.num_blocks
    return vllm_config


def build_scheduler(config: SchedConfig, switches: VllmSwitches) -> Scheduler:
    vllm_config = build_vllm_config(config, switches)
    spec = FullAttentionSpec(
        block_size=config.block_size, num_kv_heads=1, head_size=1, dtype=torch.float32
    )
    kv_cache_config = KVCacheConfig(
        num_blocks=config.num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    scheduler_cls = AsyncScheduler if config.async_scheduling else Scheduler
    return scheduler_cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=config.block_size,
    )


def patch_legacy_liveness(scheduler: Scheduler) -> None:
    """vLLM before #43433: only finished ids not yet shipped count as finished work."""
    scheduler.has_finished_requests = lambda: bool(scheduler.finished_req_ids)


class SortedSet(set):
    """A set that iterates in sorted order.

    vLLM frees finished_sending (and promotes finished_recving) in set iteration order,
    which depends on PYTHONHASHSEED; kvdrain sorts. Iterating sorted feeds vLLM the
    same order, so the comparison is about scheduling, not about hash seeds.
    """

    def __iter__(self):
        return iter(sorted(set.__iter__(self)))


class EvictionCounter:
    """Counts prefix-cache evictions (a hashed block reused for new data)."""

    def __init__(self, pool: BlockPool) -> None:
        self.count = 0
        original = pool._maybe_evict_cached_block

        def counting(block):
            evicted = original(block)
            self.count += bool(evicted)
            return evicted

        pool._maybe_evict_cached_block = counting


class VllmSide:
    name = "vllm"

    def __init__(
        self,
        config: SchedConfig,
        model: FakeModel,
        worker: FakeKVWorker,
        switches: VllmSwitches = VllmSwitches(),
        aborts_in_last_prefill: frozenset[str] = frozenset(),
    ) -> None:
        init_none_hash(sha256)
        self.config = config
        self.model = model
        self.worker = worker
        self.aborts_in_last_prefill = aborts_in_last_prefill
        self.switches = switches
        self.aborts_after_output: list[str] = []  # switches.abort_after_output
        self.released: tuple[str, ...] = ()  # by the metadata of the batch just scheduled
        self.scheduler = build_scheduler(config, switches)
        apply(self.scheduler, switches)
        if config.legacy:
            patch_legacy_liveness(self.scheduler)
        self.block_hasher = get_request_block_hasher(config.block_size, sha256)
        self.evictions = EvictionCounter(self.scheduler.kv_cache_manager.block_pool)
        self.num_preemptions = 0
        self.batch_queue: deque = deque()  # newest first, as vLLM's
        self.stop_ids: dict[str, tuple[int, ...]] = {}

    def add(self, spec: RequestSpec) -> None:
        params = SamplingParams(
            max_tokens=spec.max_tokens, stop_token_ids=list(spec.stop_token_ids) or None
        )
        params.update_from_generation_config({}, self.config.eos_token_id)
        request = Request(
            spec.req_id, list(spec.prompt), params, None, block_hasher=self.block_hasher
        )
        request.kv_transfer_params = spec.kv_transfer_params(self.config.block_size)
        self.stop_ids[spec.req_id] = spec.stop_token_ids
        self.scheduler.add_request(request)

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)

    def reject(self, spec: RequestSpec) -> None:
        """AsyncLLM.notify_kv_transfer_request_rejected: a one-token request carrying the
        params, which EngineCore.add_request aborts as it adds it (abort_immediately)."""
        if self.switches.no_rejection_notice:
            return
        params = SamplingParams(max_tokens=1)
        request = Request(spec.req_id, [0], params, None, block_hasher=self.block_hasher)
        request.kv_transfer_params = spec.kv_transfer_params(self.config.block_size)
        self.scheduler.add_request(request)
        self.abort(spec.req_id)

    def has_work(self) -> bool:
        """EngineCore.has_work: requests, or a batch in flight."""
        return self.scheduler.has_requests() or bool(self.batch_queue)

    def step(self, now: int) -> Snapshot:
        """EngineCore.step (or step_with_batch_queue): nothing when has_work() is false
        (the loop would block on its input)."""
        self.released = ()
        if not self.has_work():
            return self.snapshot(Snapshot())
        if self.config.async_scheduling:
            return self._step_with_batch_queue(now)
        sched_out = self._schedule(now)
        runner_out = self._run_model(sched_out, now)
        snap = Snapshot(
            stepped=True,
            num_scheduled=dict(sched_out.num_scheduled_tokens),
            new_req_ids=_new_req_ids(sched_out),
        )
        return self.snapshot(self._update(snap, sched_out, runner_out))

    def _step_with_batch_queue(self, now: int) -> Snapshot:
        """vllm/v1/engine/core.py step_with_batch_queue, the executor played by the fakes:
        a batch runs (and its connector worker reports) when it is submitted."""
        queue, snap = self.batch_queue, Snapshot(stepped=True)
        if self.scheduler.has_requests():
            sched_out = self._schedule(now)
            queue.appendleft((sched_out, self._run_model(sched_out, now)))
            snap.num_scheduled = dict(sched_out.num_scheduled_tokens)
            snap.new_req_ids = _new_req_ids(sched_out)
            model_executed = sched_out.total_num_scheduled_tokens > 0
            if len(queue) < BATCH_QUEUE_SIZE and (model_executed or self.scheduler.has_requests()):
                return self.snapshot(snap)
        sched_out, runner_out = queue.pop()
        return self.snapshot(self._update(snap, sched_out, runner_out))

    def _schedule(self, now: int):
        sched_out = self.scheduler.schedule()
        self.num_preemptions += len(sched_out.preempted_req_ids)
        self._register_transfers(now, sched_out.kv_connector_metadata)
        return sched_out

    def _update(self, snap: Snapshot, sched_out, runner_out) -> Snapshot:
        engine_outputs = self.scheduler.update_from_output(sched_out, runner_out)
        for req_id in self.aborts_after_output:
            self.abort(req_id)
        self.aborts_after_output.clear()
        for eco in engine_outputs.values():
            snap.outputs.extend(
                StepOutput(
                    o.request_id,
                    tuple(o.new_token_ids),
                    str(o.finish_reason) if o.finish_reason is not None else None,
                )
                for o in eco.outputs
            )
        snap.outputs.sort(key=lambda o: o.req_id)
        return snap

    def _register_transfers(self, now: int, meta) -> None:
        if meta is None:
            return
        self.released = tuple(
            sorted(
                req_id
                for req_id, m in meta.reqs_to_recv.items()
                if not (m.awaiting_kvs or any(m.local_block_ids))
            )
        )
        sends = sorted(meta.reqs_to_send)
        # Only loads the scheduler parked in WAITING_FOR_REMOTE_KVS are reported back;
        # a notify-only receive (an aborted request's empty read) is not (awaiting_kvs).
        recvs = {
            req_id: list(m.local_block_ids[0])
            for req_id, m in meta.reqs_to_recv.items()
            if m.awaiting_kvs
        }
        self.worker.register(now, sends, recvs)

    def _run_model(self, sched_out, now: int) -> ModelRunnerOutput:
        req_ids = list(sched_out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            # The sampled token's place among the outputs: the chunk ends at
            # num_computed_tokens (placeholders included, under async scheduling).
            position = request.num_computed_tokens - request.num_prompt_tokens
            token = self.model.token(req_id, position, self.stop_ids[req_id])
            sampled.append([] if request.is_prefill_chunk else [token])
        out = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, **_index_field(req_ids))
        reports = self.worker.reports(now)
        if self.config.role is not None:
            out.kv_connector_output = KVConnectorOutput(
                finished_sending=SortedSet(reports.finished_sending) or None,
                finished_recving=SortedSet(reports.finished_recving) or None,
                invalid_block_ids=set(reports.invalid_block_ids),
            )
        self._abort_in_last_prefill(req_ids, sampled)
        return out

    def _abort_in_last_prefill(self, req_ids: list[str], sampled: list[list[int]]) -> None:
        """Aborts that arrive while the forward runs the request's last prefill chunk
        (it samples its first token): EngineCore handles them before the step's output
        (_process_aborts_queue)."""
        for req_id, tokens in zip(req_ids, sampled):
            request = self.scheduler.requests[req_id]
            if req_id in self.aborts_in_last_prefill and tokens and not request.output_token_ids:
                if self.switches.abort_after_output:
                    self.aborts_after_output.append(req_id)
                else:
                    self.abort(req_id)

    def snapshot(self, snap: Snapshot) -> Snapshot:
        sched = self.scheduler
        pool = sched.kv_cache_manager.block_pool
        free_blocks = list(_iter_free(pool))
        snap.free = pool.get_num_free_blocks()
        snap.used = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
        snap.cached_free = sum(1 for b in free_blocks if b.block_hash is not None)
        num_running, num_waiting = sched.get_request_counts()
        snap.running, snap.waiting = num_running, num_waiting
        snap.waiting_for_remote_kvs = sum(
            1 for r in sched.requests.values() if r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        )
        snap.held = len(sched.requests) - num_running - num_waiting
        snap.evictions = self.evictions.count
        snap.preemptions = self.num_preemptions
        snap.has_requests = sched.has_requests()
        snap.has_unfinished_requests = sched.has_unfinished_requests()
        snap.in_flight = len(self.batch_queue)
        snap.released = self.released
        snap.block_tables = {
            req_id: tuple(sched.kv_cache_manager.get_block_ids(req_id)[0])
            for req_id in sorted(sched.requests)
        }
        return snap


def _new_req_ids(sched_out) -> tuple[str, ...]:
    new = {req.req_id for req in sched_out.scheduled_new_reqs}
    resumed = getattr(sched_out.scheduled_cached_reqs, "resumed_req_ids", ())  # before 0.34
    return tuple(sorted(new.union(resumed)))


def _index_field(req_ids: list[str]) -> dict:
    """0.32 and 0.33 also take the outputs' order as a dict (req_id_to_index); 0.34
    reads it from req_ids alone."""
    if "req_id_to_index" not in ModelRunnerOutput.__dataclass_fields__:
        return {}
    return {"req_id_to_index": {req_id: i for i, req_id in enumerate(req_ids)}}


def _iter_free(pool: BlockPool):
    block = pool.free_block_queue.fake_free_list_head.next_free_block
    while block is not None and block is not pool.free_block_queue.fake_free_list_tail:
        yield block
        block = block.next_free_block
