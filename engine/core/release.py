"""Which vLLM release the miniature follows, and what that release does. Runs in: every process.

A plain table of facts: each is a behaviour, the releases that have it and the vLLM file
and function it mirrors; a predicate per fact answers for one release. Without a choice
the miniature follows DEFAULT_RELEASE, the newest release modelled.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "DEFAULT_RELEASE",
    "FACTS",
    "ReleaseFact",
    "VllmRelease",
    "caches_blocks_early",
    "counts_async_kv_waiting",
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


@dataclass(frozen=True, slots=True, kw_only=True)
class ReleaseFact:
    """A behaviour of vLLM from release `first` to `last` (None: still in the newest)."""

    what: str
    first: VllmRelease
    last: VllmRelease | None = None
    mirrors: str  # the vLLM file and function

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

FACTS: tuple[ReleaseFact, ...] = (EARLY_BLOCK_CACHING, ASYNC_KV_WAITING_COUNTED)


def caches_blocks_early(release: VllmRelease) -> bool:
    return EARLY_BLOCK_CACHING.holds_in(release)


def counts_async_kv_waiting(release: VllmRelease) -> bool:
    return ASYNC_KV_WAITING_COUNTED.holds_in(release)
