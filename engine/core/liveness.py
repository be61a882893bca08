"""The engine loop's liveness policies: after a step, may it block, and on what? Runs in: engine-core process.

Pure: the process shell (core_proc.py) and the virtual-clock simulator both ask
`next_action`, so both follow the same rule.

| policy | work pending, no model ran                         | no work                 |
|--------|----------------------------------------------------|-------------------------|
| legacy | unfinished requests: sleep poll_interval, step     | block on frontend input |
|        | again; else (finished ids to ship) step again      |                         |
| poll   | sleep poll_interval, step again                    | block on frontend input |
| event  | block on frontend input + connector (+ its timer)  | block on frontend input |

Whether work is pending is `scheduler.has_requests()`, whose meaning also depends on
the policy: under legacy, a finished request whose blocks the connector still holds
is not work once its id has been shipped (vLLM before #43433), so the engine parks on
its input and never collects the connector's report (nor checks a lease).

With async scheduling (engine/core/batch_queue.py) a batch in flight is work too
(vLLM's EngineCore.has_work: has_requests() or a batch queued): the loop steps until
it is processed, and then the table above holds. So under legacy the last batch's
reports are collected, but a report that comes later still is not.

vLLM's loop (v1/engine/core.py _process_engine_step) before #43433 was
`if not model_executed and scheduler.has_unfinished_requests(): time.sleep(0.001)`,
and after it `... and scheduler.has_requests(): ...`: neither spins.
"""

from __future__ import annotations

import enum


class LoopAction(enum.Enum):
    STEP = "step"  # step again at once
    SLEEP = "sleep"  # sleep poll_interval_s, then step (vLLM's time.sleep(0.001))
    WAIT_INPUT = "wait_input"  # block on the frontend input socket only
    # Block on frontend input and the connector worker's socket, until the connector's
    # next timed action at the latest (a lease to reap, a heartbeat due).
    WAIT_ANY = "wait_any"


# What a loop in each action looks like from outside (the TUI's "loop state").
LOOP_STATES = {
    LoopAction.STEP: "stepping",
    LoopAction.SLEEP: "polling",
    LoopAction.WAIT_INPUT: "blocked",
    LoopAction.WAIT_ANY: "blocked",
}
# Every loop state a stats snapshot can report: the above, and "stopped" (its last one).
LOOP_STATE_NAMES = ("stepping", "polling", "blocked", "stopped")


def next_action(
    liveness: str,
    has_work: bool,
    model_executed: bool,
    can_progress: bool = False,
    must_poll: bool = False,
    *,
    has_unfinished: bool,
    only_in_flight: bool = False,
) -> LoopAction:
    """What the loop does after a step.

    has_work: scheduler.has_requests(); has_unfinished: scheduler.has_unfinished_requests()
    (legacy sleeps only while these exist: a load being waited for, a request waiting
    for blocks). can_progress: the next schedule() has work it can do without any new
    report (it consumed reports, preempted, or has finished ids to ship or finished
    receives to promote). must_poll: a connector deferred a request ("ask again later")
    and will send nothing to wake us. Under `event` the first steps at once and the
    second polls; otherwise nothing could change before a report, an input or a timer,
    so the loop blocks on all of them. `poll` keeps vLLM's exact behaviour: it always
    sleeps first. only_in_flight (async scheduling): the work is only a batch in flight,
    the scheduler has no requests; vLLM sleeps only while it has requests, so every
    policy steps at once to process that batch.
    """
    if not has_work:
        return LoopAction.WAIT_INPUT
    if model_executed or only_in_flight:
        return LoopAction.STEP
    if liveness == "legacy":
        # Without unfinished requests only finished ids to ship remain: the next step
        # ships them, then has_requests() is false and the loop parks on its input.
        return LoopAction.SLEEP if has_unfinished else LoopAction.STEP
    if liveness == "poll":
        return LoopAction.SLEEP
    if liveness == "event":
        if can_progress:
            return LoopAction.STEP
        return LoopAction.SLEEP if must_poll else LoopAction.WAIT_ANY
    raise ValueError(f"liveness: unknown policy {liveness!r}")
