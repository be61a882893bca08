"""N prefill and M decode engine processes in real time (mock runner): each engine's own idle windows judged."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from replay.pipeline import ReplayConfig, run_replay
from replay.trace.shaping import ShapingOptions
from tests.paths import EXAMPLE
from tests.replay.sim.test_xpyd import two_prefix_groups, write

pytestmark = pytest.mark.slow


def wall(path, topology: str, router: str, liveness: str, speedup: float = 1.0):
    engine = EngineConfig(liveness=liveness, runner="mock", num_blocks=512)
    return run_replay(
        ReplayConfig(
            trace=path,
            clock="wall",
            topology=topology,
            router=router,
            engine=engine,
            shaping=ShapingOptions(speedup=speedup),
        )
    )


def test_a_starved_prefill_engine_leaks_in_its_own_window_under_legacy_in_real_time(tmp_path):
    path = write(tmp_path, two_prefix_groups())
    result = wall(path, "2p1d", "prefix", "legacy", speedup=2.0)
    leaks = [w for w in result.verdict.windows if w.verdict == "leak" and not w.is_tail]
    assert leaks and {w.engine for w in leaks} == {"P0"}, result.verdict.windows
    assert 1.5 <= leaks[0].start < 2.5 and leaks[0].length > 3.0
    assert result.verdict.exit_code == 1


def test_event_drains_the_starved_prefill_engines_window_in_real_time(tmp_path):
    result = wall(write(tmp_path, two_prefix_groups()), "2p1d", "prefix", "event", speedup=2.0)
    own = [w for w in result.verdict.windows if w.engine == "P0" and not w.is_tail]
    assert own and all(w.verdict == "drained" for w in own)
    assert result.verdict.status in ("verified", "inconclusive"), result.verdict.reasons
    assert not result.verdict.violations


def test_a_4p4d_replay_runs_and_verifies_on_two_cores():
    result = wall(EXAMPLE, "4p4d", "round-robin", "event")
    assert not result.verdict.violations
    engines = {w.engine for w in result.verdict.windows}
    assert engines == {f"P{i}" for i in range(4)} | {f"D{i}" for i in range(4)}
    routed = {e: c["num_routed_requests"] for e, c in result.timeline.counters.items()}
    assert routed == {**{f"P{i}": 8 for i in range(4)}, **{f"D{i}": 8 for i in range(4)}}
