"""Plain records that flow scheduler -> runner -> scheduler -> frontend. Runs in: engine-core process."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice

_new_object = object.__new__  # an instance without __init__ (SchedulerOutput.empty)
# The id sets of SchedulerOutput.empty() until a first id: one immutable empty set for
# every output (most steps add none to most of them; a set costs ~600 instructions to
# make and free), so a consumer that tries to add to it fails instead of reaching others.
NO_REQ_IDS: frozenset[str] = frozenset()
# The id of a token sampled in a step still in flight (async scheduling), in a
# SchedulerOutput's token_ids until the batch queue fills it in.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True, kw_only=True)
class ScheduledRequest:
    """One request's share of a step: compute `token_ids` at positions from `num_computed_tokens`."""

    req_id: str
    token_ids: list[int]
    num_computed_tokens: int
    # Blocks appended to the request's block table this step. When `is_new` the table
    # starts over from these (first schedule, or resumed after preemption).
    new_block_ids: list[int]
    is_new: bool
    # True when this chunk reaches the end of the request's known tokens: sample one.
    sample: bool


@dataclass(slots=True, init=False)
class SchedulerOutput:
    """One step's plan: which requests compute which tokens, in scheduling order.

    Columnar, like vLLM's CachedRequestData: entry i of `req_ids`,
    `num_computed_tokens` and `num_scheduled_tokens` is the i-th scheduled request,
    whose tokens are the next num_scheduled_tokens[i] of the flat `token_ids`. A
    decode adds four list entries and no object. `scheduled` gives the same as
    ScheduledRequest records, and the constructor takes records too.
    """

    req_ids: list[str]
    num_computed_tokens: list[int]  # the first scheduled token's position
    num_scheduled_tokens: list[int]
    token_ids: list[int]  # every request's tokens, back to back
    # Blocks appended to a request's block table this step; absent: none. For a
    # request in `new_req_ids` the table starts over from these (first schedule, or
    # resumed after preemption).
    new_block_ids: dict[str, list[int]]
    new_req_ids: set[str] | frozenset[str]  # the id sets: NO_REQ_IDS while empty (empty())
    # The prompt of each request in new_req_ids (vLLM's NewRequestData.prompt_token_ids),
    # by reference; empty when built from records.
    prompt_token_ids: dict[str, list[int]]
    # Chunks that end before their request's known tokens do: nothing to sample.
    partial_req_ids: set[str] | frozenset[str]
    total_num_scheduled_tokens: int
    # Finished since the previous schedule(): the connector's agent drops their state.
    finished_req_ids: set[str] | frozenset[str]
    preempted_req_ids: set[str] | frozenset[str]
    kv_connector_metadata: object | None

    def __init__(
        self,
        scheduled: Iterable[ScheduledRequest] = (),
        total_num_scheduled_tokens: int = 0,
        finished_req_ids: set[str] | None = None,
        preempted_req_ids: set[str] | None = None,
        kv_connector_metadata: object | None = None,
    ) -> None:
        self.req_ids, self.num_computed_tokens, self.num_scheduled_tokens = [], [], []
        self.token_ids, self.new_block_ids, self.prompt_token_ids = [], {}, {}
        self.new_req_ids, self.partial_req_ids = set(), set()
        self.total_num_scheduled_tokens = total_num_scheduled_tokens
        self.finished_req_ids = set() if finished_req_ids is None else finished_req_ids
        self.preempted_req_ids = set() if preempted_req_ids is None else preempted_req_ids
        self.kv_connector_metadata = kv_connector_metadata
        for sched_req in scheduled:
            self.add(sched_req)

    @classmethod
    def empty(cls) -> SchedulerOutput:
        """SchedulerOutput() for the scheduler's step: the same empty columns, every slot
        stored once, without __init__'s arguments (a cost paid on every step); its id
        sets are NO_REQ_IDS until add(), add_preempted() or an assignment fills them."""
        out = _new_object(cls)
        out.req_ids = []
        out.num_computed_tokens = []
        out.num_scheduled_tokens = []
        out.token_ids = []
        out.new_block_ids = {}
        out.prompt_token_ids = {}
        out.new_req_ids = NO_REQ_IDS
        out.partial_req_ids = NO_REQ_IDS
        out.total_num_scheduled_tokens = 0
        out.finished_req_ids = NO_REQ_IDS
        out.preempted_req_ids = NO_REQ_IDS
        out.kv_connector_metadata = None
        return out

    def add(self, sched_req: ScheduledRequest) -> None:
        """Append one request's share (does not count its tokens in the total)."""
        req_id = sched_req.req_id
        self.req_ids.append(req_id)
        self.num_computed_tokens.append(sched_req.num_computed_tokens)
        self.num_scheduled_tokens.append(len(sched_req.token_ids))
        self.token_ids.extend(sched_req.token_ids)
        if sched_req.new_block_ids or sched_req.is_new:
            self.new_block_ids[req_id] = sched_req.new_block_ids
        if sched_req.is_new:
            if self.new_req_ids is NO_REQ_IDS:
                self.new_req_ids = set()
            self.new_req_ids.add(req_id)
        if not sched_req.sample:
            if self.partial_req_ids is NO_REQ_IDS:
                self.partial_req_ids = set()
            self.partial_req_ids.add(req_id)

    def add_preempted(self, req_id: str) -> None:
        if self.preempted_req_ids is NO_REQ_IDS:
            self.preempted_req_ids = set()
        self.preempted_req_ids.add(req_id)

    @property
    def scheduled(self) -> tuple[ScheduledRequest, ...]:
        """The scheduled requests as records, in order: made on each call, read-only
        (a tuple, so that an append meant for the output fails loudly; use add())."""
        records, offset = [], 0
        new_block_ids, new_req_ids, partial = (
            self.new_block_ids,
            self.new_req_ids,
            self.partial_req_ids,
        )
        for req_id, num_computed, num_new in zip(
            self.req_ids, self.num_computed_tokens, self.num_scheduled_tokens
        ):
            records.append(
                ScheduledRequest(
                    req_id=req_id,
                    token_ids=self.token_ids[offset : offset + num_new],
                    num_computed_tokens=num_computed,
                    new_block_ids=new_block_ids.get(req_id, []),
                    is_new=req_id in new_req_ids,
                    sample=req_id not in partial,
                )
            )
            offset += num_new
        return tuple(records)


@dataclass(slots=True)
class KVConnectorOutput:
    """What the connector's agent reports back through the runner output."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    invalid_block_ids: set[int] = field(default_factory=set)
    # What died behind the agent (say, the connector worker process); None: healthy.
    worker_error: str | None = None

    def is_empty(self) -> bool:
        return not (self.finished_sending or self.finished_recving or self.invalid_block_ids)


@dataclass(slots=True)
class ModelRunnerOutput:
    # One sampled token per request whose computed tokens reached its length this step.
    sampled_token_ids: dict[str, int] = field(default_factory=dict)
    # Requests the runner could not execute (bad token ids, bad block table): id -> why.
    failed: dict[str, str] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None


@dataclass(slots=True)
class RequestOutput:
    """Per request per step, to the frontend (vLLM's EngineCoreOutput). A step's come
    in a StepOutputs, where a plain one is three column entries, not a record."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" (also ignored) | "abort" | "error"
    kv_transfer_params: dict | None = None
    num_cached_tokens: int = 0
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def _plain_output(req_id: str, token: int, num_cached_tokens: int) -> RequestOutput:
    return RequestOutput(req_id, [token], num_cached_tokens=num_cached_tokens)


class StepOutputs:
    """One step's RequestOutputs, in order; what update_from_output returns.

    A plain output (one new token; not finished, no params, no error) is an entry of
    three columns, `req_ids`, `new_token_ids`, `num_cached_tokens`, and no object: a
    decode step of n requests allocates no n records. Any other output is a record in
    `records`. Iterating, indexing or comparing (with a list too) gives the records,
    plain ones made on first use, once. A request has at most one output per step, so
    a consumer that reads the columns may take them and the records in either order.
    """

    __slots__ = (
        "req_ids",
        "new_token_ids",
        "num_cached_tokens",
        "records",
        "_record_positions",
        "_list",
    )

    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.new_token_ids: list[int] = []
        self.num_cached_tokens: list[int] = []
        # Lists from the first record on (most steps have none: no list to make).
        self.records: list[RequestOutput] | tuple[()] = ()
        self._record_positions: list[int] | None = None  # each record's place among all outputs
        self._list: list[RequestOutput] | None = None

    def append(self, output: RequestOutput) -> None:
        """Add a record (a plain output goes into the columns instead)."""
        if not self.records:
            self.records, self._record_positions = [], []
        self._record_positions.append(len(self.req_ids) + len(self.records))
        self.records.append(output)

    def extend(self, outputs: Iterable[RequestOutput]) -> None:
        for output in outputs:
            self.append(output)

    def to_list(self) -> list[RequestOutput]:
        """Every output as a record, in order (made once; later appends are not seen)."""
        if self._list is None:
            plain = map(_plain_output, self.req_ids, self.new_token_ids, self.num_cached_tokens)
            if not self.records:
                self._list = list(plain)
            else:
                merged: list[RequestOutput] = []
                records = iter(self.records)
                for position in self._record_positions:
                    merged.extend(islice(plain, position - len(merged)))
                    merged.append(next(records))
                merged.extend(plain)
                self._list = merged
        return self._list

    def __len__(self) -> int:
        return len(self.req_ids) + len(self.records)

    def __bool__(self) -> bool:
        return bool(self.req_ids or self.records)

    def __iter__(self) -> Iterator[RequestOutput]:
        return iter(self.to_list())

    def __getitem__(self, index):
        return self.to_list()[index]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, StepOutputs):
            return self.to_list() == other.to_list()
        if isinstance(other, list):
            return self.to_list() == other
        return NotImplemented

    __hash__ = None  # mutable, compared by content

    def __repr__(self) -> str:
        return f"StepOutputs({self.to_list()!r})"


@dataclass(slots=True)
class SchedulerStats:
    """Queue and block counts of one engine at one moment."""

    num_waiting: int = 0
    num_skipped_waiting: int = 0
    num_waiting_for_remote_kvs: int = 0
    num_running: int = 0
    num_finished_awaiting_free: int = 0
    num_usable_blocks: int = 0  # the pool's blocks but the null block: used + free
    num_used_blocks: int = 0
    num_cached_blocks: int = 0  # free but still holding a prefix hash
    num_free_blocks: int = 0
    num_preemptions: int = 0
    num_stale_kv_reports: int = 0
    num_prefix_hit_tokens: int = 0
    num_prefix_query_tokens: int = (
        0  # prompt tokens looked up in the prefix cache (once per request)
    )
    num_kv_load_failures: int = 0
