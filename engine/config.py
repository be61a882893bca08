"""Engine, model and KV-transfer configuration. Runs in: every process (plain data)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from engine.core.release import DEFAULT_RELEASE, OLDEST_RELEASE, VllmRelease, is_modelled_release

LIVENESS_POLICIES = ("legacy", "poll", "event")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
RUNNERS = ("mock", "torch")
DEVICES = ("auto", "cpu", "cuda")
TRANSPORTS = ("shm", "zmq")


def _require(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{name}: {what}")


def _require_positive(obj: object, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        _require(value > 0, name, f"must be > 0, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """A tiny Llama-style decoder; weights come from `seed`, never a download."""

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    seed: int = 0
    dtype: str = "auto"  # auto: fp32 on the CPU, bf16 on CUDA

    def __post_init__(self) -> None:
        _require_positive(
            self,
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate_size",
        )
        _require(
            self.num_heads % self.num_kv_heads == 0,
            "num_kv_heads",
            f"must divide num_heads={self.num_heads}, got {self.num_kv_heads}",
        )
        _require(
            self.dtype in ("auto", "float32", "float64", "float16", "bfloat16"),
            "dtype",
            f"unknown dtype {self.dtype!r}",
        )


MODEL_PRESETS: dict[str, ModelConfig] = {
    # Replays on 2 CPU cores in seconds.
    "tiny": ModelConfig(),
    # A few times the tiny model's work per token; still fine on a CPU.
    "small": ModelConfig(
        vocab_size=4096,
        hidden_size=256,
        num_layers=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=32,
        intermediate_size=768,
    ),
    # About 0.3 B parameters: for GPUs.
    "medium": ModelConfig(
        vocab_size=32000,
        hidden_size=1024,
        num_layers=16,
        num_heads=16,
        num_kv_heads=4,
        head_dim=64,
        intermediate_size=2816,
    ),
}


def get_model_config(name: str) -> ModelConfig:
    """The ModelConfig of a named preset."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(MODEL_PRESETS)}")
    return MODEL_PRESETS[name]


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """Which connector the engine core runs and how its worker moves blocks.

    `kv_connector` names a factory as "module:function"; the engine core imports it by
    name at start-up, so the engine never imports a connector package itself.
    """

    kv_connector: str = "connector.factory:make_pd_connector"
    kv_role: str = "kv_both"
    transport: str = "shm"
    # vLLM 0.32 NIXL's kv_lease_duration: P holds a send's blocks this long past its
    # finish unless D's heartbeats (every lease/6 while D waits) extend it; reaped only
    # when P steps. (Older vLLM: a fixed 480 s VLLM_NIXL_ABORT_REQUEST_TIMEOUT.)
    kv_lease_s: float = 30.0
    pull_delay_ms: float = 0.0
    drop_read_done: bool = False
    # Where this engine's connector worker serves block reads; set by the launcher and
    # handed to the decode side in kv_transfer_params (vLLM's remote_host/remote_port).
    kv_addr: str = ""
    agent_addr: str = ""  # PAIR between the engine core and its connector worker

    def __post_init__(self) -> None:
        _require(
            ":" in self.kv_connector,
            "kv_connector",
            f"must be 'module:function', got {self.kv_connector!r}",
        )
        _require(self.kv_role in KV_ROLES, "kv_role", f"must be one of {KV_ROLES}")
        _require(self.transport in TRANSPORTS, "transport", f"must be one of {TRANSPORTS}")
        _require_positive(self, "kv_lease_s")
        _require(self.pull_delay_ms >= 0, "pull_delay_ms", "must be >= 0")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one engine core needs; bad values raise ValueError naming the field."""

    engine_id: str = "engine"
    num_blocks: int = 256  # includes the null block 0
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_prefix_caching: bool = True
    liveness: str = "event"
    poll_interval_s: float = 0.001  # vLLM #43433's time.sleep(0.001)
    kv_load_failure_policy: str = "fail"  # vLLM 0.32's default (config/kv_transfer.py)
    # vLLM 0.32's admission rule (SchedulerConfig.scheduler_reserve_full_isl): admit a
    # waiting request only if blocks for its whole current sequence are free, not
    # just its first chunk's.
    scheduler_reserve_full_isl: bool = True
    # vLLM's SchedulerConfig.async_scheduling: schedule step N+1 before step N's output
    # is processed (engine/core/async_scheduler.py, engine/core/batch_queue.py).
    async_scheduling: bool = False
    # The vLLM release whose behaviour the engine follows where releases differ
    # (engine/core/release.py): "X.Y" or "X.Y.Z". Its KV lifecycle: how long P holds an
    # unread send and how it lets go, aborts during a step, D's rejections; the loop is
    # `liveness`, which the command line sets from the release unless given.
    vllm_release: str = str(DEFAULT_RELEASE)
    eos_token_id: int | None = None
    runner: str = "mock"
    device: str = "auto"
    # vLLM's gpu_memory_utilization: with a fraction here, the torch runner on CUDA sizes
    # the pool from device memory (engine/runner/kv_cache_sizing.py) and num_blocks is only the
    # CPU's size; None: num_blocks everywhere (vLLM's num_gpu_blocks_override).
    gpu_memory_utilization: float | None = None
    model: ModelConfig = field(default_factory=ModelConfig)
    kv_transfer: KVTransferConfig | None = None  # None: no connector
    # How long a start-up may take before the waits inside the engine (its connector
    # worker's) give up; the frontend judges starved or stuck engines before that.
    start_limit_s: float = 300.0

    def __post_init__(self) -> None:
        _require(bool(self.engine_id), "engine_id", "must not be empty")
        _require(self.num_blocks >= 2, "num_blocks", f"must be >= 2, got {self.num_blocks}")
        _require_positive(
            self,
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "max_model_len",
            "poll_interval_s",
            "start_limit_s",
        )
        _require(
            self.liveness in LIVENESS_POLICIES,
            "liveness",
            f"must be one of {LIVENESS_POLICIES}, got {self.liveness!r}",
        )
        _require(
            self.kv_load_failure_policy in KV_LOAD_FAILURE_POLICIES,
            "kv_load_failure_policy",
            f"must be one of {KV_LOAD_FAILURE_POLICIES}",
        )
        _require(
            _is_release(self.vllm_release),
            "vllm_release",
            f"must be a vLLM release from {OLDEST_RELEASE.major}.{OLDEST_RELEASE.minor} to "
            f"{DEFAULT_RELEASE.major}.{DEFAULT_RELEASE.minor} (X.Y or X.Y.Z), "
            f"got {self.vllm_release!r}",
        )
        _require(self.runner in RUNNERS, "runner", f"must be one of {RUNNERS}")
        _require(self.device in DEVICES, "device", f"must be one of {DEVICES}")
        _require(
            self.gpu_memory_utilization is None or 0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization!r}",
        )
        if self.eos_token_id is not None:
            _require(
                0 <= self.eos_token_id < self.model.vocab_size,
                "eos_token_id",
                f"must be a token id below vocab_size={self.model.vocab_size}",
            )


def _is_release(text: object) -> bool:
    """A release the miniature models (engine/core/release.py), as X.Y or X.Y.Z."""
    try:
        return is_modelled_release(VllmRelease.parse(text))
    except (AttributeError, ValueError):
        return False


def config_to_dict(config: object) -> dict:
    """Plain nested dict of a config dataclass (for reports and the wire)."""
    out = {}
    for f in fields(config):
        value = getattr(config, f.name)
        out[f.name] = config_to_dict(value) if hasattr(value, "__dataclass_fields__") else value
    return out


@dataclass(frozen=True, slots=True)
class EngineAddresses:
    """The frontend binds both; the engine core connects (ipc paths in a private dir)."""

    input: str
    output: str
