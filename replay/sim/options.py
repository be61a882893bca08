"""What a simulation is set by: the engines' own config, the topology and the latencies. Runs in: frontend process.

The one home of a simulator setting. Engine and KV-transfer settings are the same
EngineConfig and KVTransferConfig the wall clock runs (the replay passes its own in);
only what the virtual clock simulates (latencies, step costs, sampling) lives here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from engine.config import EngineConfig, KVTransferConfig
from replay.deploy.pd_flow import parse_topology
from replay.deploy.placement import RouterPolicy
from replay.sim.cost import StepCost


def _default_engine() -> EngineConfig:
    return EngineConfig(num_blocks=4096, max_model_len=8192)


@dataclass(frozen=True, slots=True)
class SimOptions:
    """Engine and KV-transfer config, topology, and the latencies (seconds)."""

    engine: EngineConfig = field(default_factory=_default_engine)  # per engine; runner: mock
    kv: KVTransferConfig = field(default_factory=KVTransferConfig)  # the connector factory too
    topology: str = "pd"
    router: RouterPolicy = (
        "round-robin"  # which P and D take each request (replay/deploy/placement.py)
    )
    pull_delay_s: float = 0.002  # D waits before reading (kv.pull_delay_ms > 0 replaces it)
    per_block_s: float = 0.00005  # D's read time per block
    read_done_latency_s: float = 0.0005  # D's worker -> P's worker
    step_base_s: float = 0.004
    step_per_token_s: float = 0.00002
    zero_step_s: float = 0.0001  # a step with no forward: the worker round trip
    # A calibrated step cost (replay/sim/cost.py, `kvdrain calibrate`) in place of
    # step_base_s + step_per_token_s * tokens; None: those two.
    step_cost: StepCost | None = None
    sample_interval_s: float = 0.1
    tail_s: float = 5.0  # observed after the last request ends
    # Skip steps whose outcome is known (replay/sim/engine.py): idle poll/spin steps, and
    # runs of plain decode steps; False takes every step (the tests' reference).
    fast_forward: bool = True

    def __post_init__(self) -> None:
        parse_topology(self.topology)
        for name in ("zero_step_s", "sample_interval_s"):
            if not getattr(self, name) >= 1e-9:
                raise ValueError(f"{name}: must be >= 1e-9 s, got {getattr(self, name)!r}")
        for name in (
            "pull_delay_s",
            "per_block_s",
            "read_done_latency_s",
            "step_base_s",
            "step_per_token_s",
            "tail_s",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")

    def engine_config(self, name: str, role: str | None) -> EngineConfig:
        """The config of engine `name`; role None means no connector."""
        kv = None if role is None else replace(self.kv, kv_role=role, kv_addr=f"sim://{name}")
        return replace(self.engine, engine_id=name, runner="mock", kv_transfer=kv)

    def pull_delay(self) -> float:
        """How long D waits before a read: the configured pull delay, else the simulator's default."""
        return self.kv.pull_delay_ms / 1000 if self.kv.pull_delay_ms > 0 else self.pull_delay_s
