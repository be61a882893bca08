"""Which vLLM release the miniature follows, and what that release does. Runs in: every process.

A plain table of facts: each is a behaviour, the releases that have it, the vLLM file
and function it mirrors, and whether the miniature follows it; a predicate per fact
answers for one release. Without a choice the miniature follows DEFAULT_RELEASE, the
newest release modelled; it models OLDEST_RELEASE and later.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_RELEASE",
    "FACTS",
    "KV_LEASE_S",
    "OLDEST_RELEASE",
    "ReleaseFact",
    "VllmRelease",
    "aborts_before_output",
    "caches_blocks_early",
    "counts_async_kv_waiting",
    "decoder_ttl_s",
    "fact_of_issue",
    "fallback_timer_s",
    "has_kv_lease",
    "is_modelled_release",
    "lease_extension_s",
    "liveness_of",
    "modelled_facts",
    "models_issue",
    "notifies_rejection",
    "reaper_scans_all",
    "reports_d_prefix_hit",
    "steps_while_delayed_frees",
    "stops_stepping_in_process",
    "unmodelled_facts",
]


@dataclass(frozen=True, slots=True, order=True)
class VllmRelease:
    """A vLLM release ("0.33" or "0.33.0"), ordered as releases are."""

    major: int
    minor: int
    patch: int = 0

    @classmethod
    def parse(cls, text: str) -> VllmRelease:
        parts = text.strip().split(".")
        if not 2 <= len(parts) <= 3 or not all(part.isdigit() for part in parts):
            raise ValueError(f"a vLLM release is X.Y or X.Y.Z, got {text!r}")
        return cls(*(int(part) for part in parts))

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


DEFAULT_RELEASE = VllmRelease(0, 34)  # the newest release the parity suite runs
OLDEST_RELEASE = VllmRelease(0, 10)  # the first with a fallback free of unread sends


def is_modelled_release(release: VllmRelease) -> bool:
    """OLDEST_RELEASE up to DEFAULT_RELEASE's patch releases: the facts say nothing of others."""
    return OLDEST_RELEASE <= release < VllmRelease(DEFAULT_RELEASE.major, DEFAULT_RELEASE.minor + 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseFact:
    """A behaviour of vLLM from release `first` to `last` (None: still in the newest)."""

    what: str
    first: VllmRelease
    last: VllmRelease | None = None
    mirrors: str  # the vLLM file and function
    issues: tuple[int, ...] = ()  # the vLLM issues and pull requests it is known by
    modelled: bool = True  # the miniature follows it (a release's lifecycle, on every clock)

    def holds_in(self, release: VllmRelease) -> bool:
        return self.first <= release and (self.last is None or release <= self.last)


EARLY_BLOCK_CACHING = ReleaseFact(
    what="under async scheduling, update_from_output caches a running request's blocks up to "
    "num_computed_tokens - num_in_flight_tokens when its token arrives; before, "
    "AsyncScheduler._update_request_with_output cached them up to num_computed_tokens - "
    "num_output_placeholders (the same prefix unless a step samples more than one token)",
    first=VllmRelease(0, 33),
    mirrors="vllm/v1/core/sched/scheduler.py Scheduler.update_from_output",
)
ASYNC_KV_WAITING_COUNTED = ReleaseFact(
    what="get_request_counts() counts the async_kv_waiting queue among the waiting, and so "
    "does has_finished_requests(); the queue fills only under --max-num-inflight-kv-loads, "
    "which the miniature does not model, so its counts are the same in every release",
    first=VllmRelease(0, 34),
    mirrors="vllm/v1/core/sched/scheduler.py Scheduler.get_request_counts",
)

# The KV lifecycle of P/D with the NIXL connector, release by release: one module up to
# 0.21, a package of them in 0.32.
NIXL_0_21 = "vllm/distributed/kv_transfer/kv_connector/v1/nixl_connector.py"
NIXL = "vllm/distributed/kv_transfer/kv_connector/v1/nixl"
IDLE_STEPS_FOR_DELAYED_FREES = ReleaseFact(
    what="an engine with only delayed frees pending keeps stepping (#43433): with a connector, "
    "requests in none of the queues count as finished work, and a step that ran no model "
    "sleeps 1 ms and steps again; before, an idle P blocked on its input with the blocks held",
    first=VllmRelease(0, 22),
    mirrors="vllm/v1/core/sched/scheduler.py Scheduler.has_finished_requests",
    issues=(43433, 41180, 36958),
)
FALLBACK_TIMER_120 = ReleaseFact(
    what="P frees an unread request's blocks VLLM_NIXL_ABORT_REQUEST_TIMEOUT (120 s) after it "
    "finished, checked only inside get_finished(), that is when P steps",
    first=VllmRelease(0, 10),
    last=VllmRelease(0, 11, 1),
    mirrors=f"{NIXL_0_21} NixlConnectorWorker.get_finished",
)
FALLBACK_TIMER_480 = ReleaseFact(
    what="the same fallback timer at 480 s; the variable is gone from 0.22.0 (the lease)",
    first=VllmRelease(0, 11, 2),
    last=VllmRelease(0, 21),
    mirrors=f"{NIXL_0_21} NixlConnectorWorker.get_finished",
)
KV_LEASE = ReleaseFact(
    what="P holds an unread request's blocks for a lease (kv_lease_duration, 30 s); D's "
    "heartbeats, sent from D's forward loop every lease/6 while it waits, extend it to now + "
    "2/3 of the lease; P reaps expired leases only when it steps. A lease too short for a "
    "slow or paused D frees blocks D reads later",
    first=VllmRelease(0, 22),
    mirrors=f"{NIXL}/base_worker.py NixlBaseConnectorWorker._handle_heartbeat",
    issues=(21570,),
)
DECODER_TTL = ReleaseFact(
    what="with bidirectional_kv_xfer, D delays its frees too, for decoder_kv_blocks_ttl (480 s), "
    "not renewed by heartbeats; not modelled: kvdrain's D never delays a free",
    first=VllmRelease(0, 22),
    mirrors=f"{NIXL}/pull_scheduler.py NixlPullConnectorScheduler.request_finished",
    modelled=False,
)
ABORTS_BEFORE_OUTPUT = ReleaseFact(
    what="aborts are taken right before update_from_output (#29987); before, an abort during "
    "P's last prefill step let the connector take the request as finished, its blocks "
    "pinned until the fallback timer",
    first=VllmRelease(0, 13),
    mirrors="vllm/v1/engine/core.py EngineCore._process_aborts_queue",
    issues=(29987, 29906),
)
REJECTION_NOTIFIES_P = ReleaseFact(
    what="D's rejection before admission notifies P, which frees at once (#41269, "
    "notify_kv_transfer_request_rejected); an idle 0.21 P never steps to read it",
    first=VllmRelease(0, 21),
    mirrors="vllm/v1/engine/async_llm.py AsyncLLM.notify_kv_transfer_request_rejected",
    issues=(41269,),
)
REAPER_SCANS_ALL = ReleaseFact(
    what="the lease reaper scans every entry; before, it stopped at the first unexpired one, so "
    "a heartbeated request (or a 480 s bidirectional entry) stranded expired ones behind it "
    "(#50789, #58222)",
    first=VllmRelease(0, 31),
    mirrors=f"{NIXL}/base_worker.py NixlBaseConnectorWorker._reap_expired_send_leases",
    issues=(50789, 58222),
)
D_PREFIX_HIT_REPORTED = ReleaseFact(
    what="D reports a full prefix-cache hit on a remote-prefill request; before, the request "
    "parked in skipped_waiting for the life of the process (#56640); not modelled",
    first=VllmRelease(0, 30),
    mirrors="vllm/v1/core/sched/scheduler.py Scheduler._update_waiting_for_remote_kv",
    issues=(56640, 54714),
    modelled=False,
)
IN_PROCESS_ENGINE_STOPS = ReleaseFact(
    what="vLLM's in-process engine (the LLM class, VLLM_ENABLE_V1_MULTIPROCESSING=0) as a "
    "producer stops stepping with delayed frees pending: InprocClient.dp_engines_running() "
    "is always False, so its step loop exits; not modelled: kvdrain's engines are processes",
    first=VllmRelease(0, 11, 2),
    mirrors="vllm/v1/engine/core_client.py InprocClient.dp_engines_running",
    issues=(46502,),
    modelled=False,
)

FACTS: tuple[ReleaseFact, ...] = (
    EARLY_BLOCK_CACHING,
    ASYNC_KV_WAITING_COUNTED,
    IDLE_STEPS_FOR_DELAYED_FREES,
    FALLBACK_TIMER_120,
    FALLBACK_TIMER_480,
    KV_LEASE,
    DECODER_TTL,
    ABORTS_BEFORE_OUTPUT,
    REJECTION_NOTIFIES_P,
    REAPER_SCANS_ALL,
    D_PREFIX_HIT_REPORTED,
    IN_PROCESS_ENGINE_STOPS,
)
KV_LEASE_S = 30.0  # kv_lease_duration's default
LEASE_EXTENSION = 2 / 3  # a heartbeat extends the lease to now + this share of it
DECODER_TTL_S = 480.0


def caches_blocks_early(release: VllmRelease) -> bool:
    return EARLY_BLOCK_CACHING.holds_in(release)


def counts_async_kv_waiting(release: VllmRelease) -> bool:
    return ASYNC_KV_WAITING_COUNTED.holds_in(release)


def steps_while_delayed_frees(release: VllmRelease) -> bool:
    return IDLE_STEPS_FOR_DELAYED_FREES.holds_in(release)


def fallback_timer_s(release: VllmRelease) -> float | None:
    """P's fallback free of an unread request, read only when P steps; None: a lease."""
    if FALLBACK_TIMER_480.holds_in(release):
        return 480.0
    return 120.0 if FALLBACK_TIMER_120.holds_in(release) else None


def has_kv_lease(release: VllmRelease) -> bool:
    return KV_LEASE.holds_in(release)


def lease_extension_s(lease_s: float) -> float:
    """How far one heartbeat extends a lease of lease_s: to now + 2/3 of it."""
    return lease_s * LEASE_EXTENSION


def decoder_ttl_s(release: VllmRelease) -> float | None:
    return DECODER_TTL_S if DECODER_TTL.holds_in(release) else None


def aborts_before_output(release: VllmRelease) -> bool:
    return ABORTS_BEFORE_OUTPUT.holds_in(release)


def notifies_rejection(release: VllmRelease) -> bool:
    return REJECTION_NOTIFIES_P.holds_in(release)


def reaper_scans_all(release: VllmRelease) -> bool:
    return REAPER_SCANS_ALL.holds_in(release)


def reports_d_prefix_hit(release: VllmRelease) -> bool:
    return D_PREFIX_HIT_REPORTED.holds_in(release)


def stops_stepping_in_process(release: VllmRelease) -> bool:
    return IN_PROCESS_ENGINE_STOPS.holds_in(release)


def liveness_of(release: VllmRelease) -> str:
    """The engine loop a release runs (engine/core/liveness.py): before #43433 `legacy`,
    after it kvdrain's `event`, which frees when vLLM's 1 ms poll would, without spinning."""
    return "event" if steps_while_delayed_frees(release) else "legacy"


def fact_of_issue(issue: int) -> ReleaseFact | None:
    """The fact a vLLM issue or pull request is about (a bug-matrix row's); None: none known."""
    return next((fact for fact in FACTS if issue in fact.issues), None)


def modelled_facts(release: VllmRelease) -> tuple[ReleaseFact, ...]:
    """The facts the miniature follows when told `release`: it has each that holds in
    it and lacks each that does not. None outside the releases modelled."""
    if not is_modelled_release(release):
        return ()
    return tuple(fact for fact in FACTS if fact.modelled)


def unmodelled_facts() -> tuple[ReleaseFact, ...]:
    """The facts the miniature never follows, in any release: a prediction that needs one
    is "not modelled", never a guess."""
    return tuple(fact for fact in FACTS if not fact.modelled)


def models_issue(issue: int, release: VllmRelease) -> bool:
    """Whether the miniature told `release` predicts what vLLM does about `issue` (a
    bug-matrix row); False: the row's prediction is "not modelled"."""
    return fact_of_issue(issue) in modelled_facts(release)
