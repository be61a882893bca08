"""A replay's contract and its default tail: what the deployment promises for an unread
request's blocks, learned from the deployment, and a tail long enough to see it kept."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

import replay.pipeline
from engine.config import EngineConfig, KVTransferConfig
from replay.pipeline import (
    LAUNCHED,
    ReplayConfig,
    deployment_contract,
    prepare_replay,
    with_contract_tail,
)
from replay.target.client import HttpTargetOptions
from replay.verify.contract import NEWEST_MODELLED, NIXL_DEFAULT_LEASE
from replay.verify.timeline import RequestRecord, Timeline
from tests.paths import EXAMPLE

HTTP = HttpTargetOptions(base_url="http://127.0.0.1:9")


def served(version: str | None, engines: dict | None = None, server: str = "vLLM") -> Timeline:
    settings = {"server": server, "version": version, "engines": engines or {}}
    return Timeline(
        engines=[],
        num_usable_blocks={},
        samples=[],
        requests=[],
        arrivals=[],
        aborts=[],
        end_t=0.0,
        meta={"http": {"settings": settings, "server": {}}},
    )


def test_a_local_replay_is_judged_by_its_own_settings():
    config = ReplayConfig(
        trace=EXAMPLE,
        engine=EngineConfig(vllm_release="0.21", liveness="event"),
        kv=KVTransferConfig(kv_lease_s=6.0),
    )
    contract = deployment_contract(config)
    assert (str(contract.release), contract.lease_s, contract.steps_while_idle) == (
        "0.21.0",
        6.0,
        True,
    )
    legacy = replace(config, engine=EngineConfig(liveness="legacy"))
    assert not deployment_contract(legacy).steps_while_idle


def test_a_served_release_comes_from_the_launcher_then_version_then_the_flag_then_newest():
    config = ReplayConfig(trace=EXAMPLE, target=HTTP.base_url, http=HTTP)
    newest = deployment_contract(config, served(None))
    assert newest.release_from == NEWEST_MODELLED and newest.lease_from == NIXL_DEFAULT_LEASE
    prefill = {"D": {"version": "0.34.0"}, "P": {"version": "0.21.0+cpu"}}
    learned = deployment_contract(config, served("0.34.0", prefill))
    assert str(learned.release) == "0.21.0" and not learned.steps_while_idle
    assert learned.release_from == "P's /version: 0.21.0+cpu"
    flagged = replace(
        config, served_release=("0.32", "--vllm-release"), served_lease_s=(6.0, "--kv-lease-s")
    )
    assert str(deployment_contract(flagged, served("0.22.1")).release) == "0.22.1"
    said = deployment_contract(flagged, served(None))
    assert (str(said.release), said.release_from, said.lease_s) == ("0.32.0", "--vllm-release", 6.0)
    launched = replace(config, served_release=("0.32.0+cpu", LAUNCHED))
    assert str(deployment_contract(launched, served("0.21.0")).release) == "0.32.0"


def test_a_kvdrain_server_s_version_is_not_a_vllm_release():
    config = ReplayConfig(trace=EXAMPLE, target=HTTP.base_url, http=HTTP)
    kvdrain = served("0.1.0", server="kvdrain")
    kvdrain.meta["http"]["settings"]["liveness"] = "legacy"
    contract = deployment_contract(config, kvdrain)
    assert contract.release_from == NEWEST_MODELLED and not contract.steps_while_idle


def dropped(at: float) -> RequestRecord:
    return RequestRecord(
        req_id="r1",
        arrival_t=at,
        send_t=at,
        send_lateness_s=0.0,
        first_token_t=None,
        end_t=at + 0.5,
        num_prompt_tokens=64,
        num_output_tokens=0,
        num_prefix_hit_tokens=0,
        finish_reason="error",
        fault="drop_decode",
        prefill_done_t=at + 0.5,
    )


def forecast(requests) -> Timeline:
    return Timeline(
        engines=["P", "D"],
        num_usable_blocks={"P": 10, "D": 10},
        samples=[],
        requests=requests,
        arrivals=[r.arrival_t for r in requests],
        aborts=[],
        end_t=10.0,
    )


def test_the_default_tail_covers_an_unread_request_s_lease_and_extension():
    config = ReplayConfig(trace=EXAMPLE, clock="virtual")
    longer = with_contract_tail(config, forecast([dropped(1.0)]))
    assert longer.effective_tail_s() == pytest.approx(50.5)  # lease + extension + deadline
    assert with_contract_tail(config, forecast([])) is config
    given = replace(config, tail_s=3.0)
    assert with_contract_tail(given, forecast([dropped(1.0)])) is given
    legacy = replace(config, engine=EngineConfig(liveness="legacy"))
    assert with_contract_tail(legacy, forecast([dropped(1.0)])) is legacy


def test_the_virtual_clock_runs_again_with_the_tail_its_first_run_needed(monkeypatch):
    tails = []

    def simulate(records, options, on_progress):
        list(records)
        tails.append(options.tail_s)
        return forecast([dropped(1.0)])

    monkeypatch.setattr(replay.pipeline, "simulate_interruptible", simulate)
    with prepare_replay(ReplayConfig(trace=Path(EXAMPLE), clock="virtual")) as prepared:
        result = prepared.run()
    assert tails == [2.0, pytest.approx(50.5)]
    assert result.settings()["tail_s"] == pytest.approx(50.5)
    assert result.verdict.contract.release_from == "the miniature's settings"
