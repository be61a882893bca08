"""The vLLM releases the miniature follows: parsing, order, and what each release does."""

from __future__ import annotations

import re

import pytest

from engine.config import EngineConfig
from engine.core.release import (
    DEFAULT_RELEASE,
    FACTS,
    KV_LEASE_S,
    VllmRelease,
    aborts_before_output,
    caches_blocks_early,
    counts_async_kv_waiting,
    decoder_ttl_s,
    fact_of_issue,
    fallback_timer_s,
    has_kv_lease,
    is_modelled_release,
    lease_extension_s,
    liveness_of,
    modelled_facts,
    models_issue,
    notifies_rejection,
    reaper_scans_all,
    steps_while_delayed_frees,
    stops_stepping_in_process,
    unmodelled_facts,
)
from tests.utils import make_scheduler


def test_a_release_parses_with_or_without_its_patch_number():
    assert VllmRelease.parse("0.33") == VllmRelease.parse("0.33.0") == VllmRelease(0, 33, 0)
    assert VllmRelease.parse(" 0.11.2 ") == VllmRelease(0, 11, 2)
    assert str(VllmRelease.parse("0.34")) == "0.34.0"


@pytest.mark.parametrize("text", ["", "0", "0.33.0.1", "v0.33", "0.33rc1", "0..3"])
def test_anything_but_a_release_number_is_refused(text):
    with pytest.raises(ValueError, match="X.Y or X.Y.Z"):
        VllmRelease.parse(text)


def test_releases_order_as_vllm_numbers_them():
    names = ["0.9.1", "0.11.2", "0.13", "0.21.0", "0.22", "0.32.0", "0.33", "0.34.0"]
    releases = [VllmRelease.parse(name) for name in names]
    assert sorted(reversed(releases)) == releases
    assert VllmRelease.parse("0.9.1") < VllmRelease.parse("0.10")


def test_the_default_is_the_newest_release_modelled():
    assert DEFAULT_RELEASE == VllmRelease(0, 34)
    assert EngineConfig().vllm_release == "0.34.0"
    assert all(fact.first <= DEFAULT_RELEASE for fact in FACTS)


@pytest.mark.parametrize(
    "release,early,async_kv_waiting",
    [("0.32.0", False, False), ("0.33.0", True, False), ("0.34.0", True, True)],
)
def test_what_each_release_of_the_parity_suite_does(release, early, async_kv_waiting):
    parsed = VllmRelease.parse(release)
    assert caches_blocks_early(parsed) is early
    assert counts_async_kv_waiting(parsed) is async_kv_waiting


def test_every_fact_cites_the_vllm_file_and_function_it_mirrors():
    for fact in FACTS:
        assert re.fullmatch(r"vllm/[\w/]+\.py \w+\.\w+", fact.mirrors), fact.mirrors
        assert fact.last is None or fact.first <= fact.last


def test_the_engine_config_refuses_a_release_it_cannot_read():
    with pytest.raises(ValueError, match="vllm_release"):
        EngineConfig(vllm_release="latest")


def test_the_scheduler_follows_the_release_in_its_config():
    for release, early in (("0.32", False), ("0.33.0", True)):
        scheduler = make_scheduler(async_scheduling=True, vllm_release=release)
        assert scheduler.release == VllmRelease.parse(release)
        assert scheduler.caches_blocks_early is early


@pytest.mark.parametrize(
    "release, steps, timer, lease, aborts_first, notifies, scans_all",
    [
        ("0.11.2", False, 480.0, False, False, False, False),
        ("0.12.0", False, 480.0, False, False, False, False),
        ("0.13.0", False, 480.0, False, True, False, False),
        ("0.20.2", False, 480.0, False, True, False, False),
        ("0.21.0", False, 480.0, False, True, True, False),
        ("0.22.0", True, None, True, True, True, False),
        ("0.30.0", True, None, True, True, True, False),
        ("0.31.0", True, None, True, True, True, True),
        ("0.34.0", True, None, True, True, True, True),
    ],
)
def test_the_kv_lifecycle_each_release_keeps(
    release, steps, timer, lease, aborts_first, notifies, scans_all
):
    """vllm-kv-bugs' contracts by release: the idle loop (#43433), the 480 s timer read on
    steps, the lease, aborts before the output (#29987), D's rejection told to P (#41269),
    the reaper that scans every lease (#50789)."""
    r = VllmRelease.parse(release)
    assert steps_while_delayed_frees(r) is steps
    assert fallback_timer_s(r) == timer
    assert has_kv_lease(r) is lease and (decoder_ttl_s(r) == 480.0) is lease
    assert aborts_before_output(r) is aborts_first
    assert notifies_rejection(r) is notifies
    assert reaper_scans_all(r) is scans_all


def test_before_the_480_s_timer_it_was_120_s_and_a_heartbeat_extends_by_two_thirds():
    assert fallback_timer_s(VllmRelease.parse("0.10.1")) == 120.0
    assert lease_extension_s(KV_LEASE_S) == pytest.approx(20.0)


@pytest.mark.parametrize(
    "release, loop",
    [("0.10", "legacy"), ("0.21.0", "legacy"), ("0.22", "event"), ("0.34", "event")],
)
def test_a_release_runs_the_loop_before_or_after_43433(release, loop):
    assert liveness_of(VllmRelease.parse(release)) == loop


@pytest.mark.parametrize(
    "release, modelled",
    [("0.9.1", False), ("0.10", True), ("0.21", True), ("0.34.2", True), ("0.35", False)],
)
def test_the_miniature_models_the_releases_its_facts_cover(release, modelled):
    assert is_modelled_release(VllmRelease.parse(release)) is modelled
    assert bool(modelled_facts(VllmRelease.parse(release))) is modelled
    if not modelled:
        with pytest.raises(ValueError, match="vllm_release"):
            EngineConfig(vllm_release=release)


@pytest.mark.parametrize(
    "issue, modelled",
    [
        (43433, True),  # the idle P that never steps
        (29987, True),  # an abort during P's last prefill step
        (41269, True),  # D's rejection told to P
        (50789, True),  # the reaper that stopped at the first live lease
        (21570, True),  # a lease too short for a slow D
        (56640, False),  # D's full prefix hit parked in skipped_waiting
        (46502, False),  # vLLM's in-process engine stops stepping
        (1, False),  # unknown
    ],
)
def test_a_bug_matrix_row_is_predicted_only_where_its_fact_is_modelled(issue, modelled):
    for release in ("0.12", "0.21", "0.34"):
        assert models_issue(issue, VllmRelease.parse(release)) is modelled
    assert models_issue(issue, VllmRelease.parse("0.9.1")) is False


def test_the_facts_the_miniature_never_follows_say_so():
    names = {fact.issues[0] for fact in unmodelled_facts() if fact.issues}
    assert names == {56640, 46502}
    assert all("not modelled" in fact.what for fact in unmodelled_facts())
    assert fact_of_issue(46502).holds_in(DEFAULT_RELEASE)  # not fixed in 0.34
    assert stops_stepping_in_process(VllmRelease.parse("0.34"))
