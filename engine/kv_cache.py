"""Paged KV cache memory other processes map by handle. Runs in: engine core, connector worker."""
from __future__ import annotations

import os
import tempfile
import uuid
import warnings
from dataclasses import asdict, dataclass, fields
from multiprocessing import util

import torch

from engine.config import ModelConfig

DTYPES = ("float32", "float64", "float16", "bfloat16")
HANDLE_KINDS = ("shm", "cuda")
SHM_PREFIX = "kvdrain-kv-"  # segment file names: kvdrain-kv-<owner pid>-<random>


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda[:N]" requires one."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return device
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but torch.cuda.is_available() is False")
        return device
    raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")


def resolve_dtype(model_config: ModelConfig, device: str) -> torch.dtype:
    """The model and KV dtype: ModelConfig.dtype, or for "auto" fp32 on the CPU, bf16 on CUDA."""
    if model_config.dtype == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    return getattr(torch, model_config.dtype)


def kv_cache_shape(model_config: ModelConfig, num_blocks: int, block_size: int) -> list[int]:
    """[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
    return [model_config.num_layers, 2, num_blocks, block_size,
            model_config.num_kv_heads, model_config.head_dim]


@dataclass(frozen=True, slots=True)
class KVCacheHandle:
    """Everything a peer needs to map the owner's KV memory; plain msgpack-native fields."""

    kind: str  # "shm": a file under /dev/shm; "cuda": a CUDA IPC allocation
    name: str  # shm: the file's path; cuda: ""
    shape: list[int]
    dtype: str
    owner_pid: int
    # CUDA IPC only: the fields of torch's UntypedStorage._share_cuda_().
    device_index: int = -1
    cuda_handle: bytes = b""
    storage_size_bytes: int = 0
    storage_offset_bytes: int = 0
    ref_counter_handle: bytes = b""
    ref_counter_offset: int = 0
    event_handle: bytes = b""  # b"": none (torch passes None)
    event_sync_required: bool = False

    def to_dict(self) -> dict[str, str | int | bool | bytes | list[int]]:
        """Plain dict for msgpack (never pickle)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> KVCacheHandle:
        """Validate and rebuild a handle from to_dict()'s output; ValueError on anything else."""
        if not isinstance(data, dict) or set(data) != {f.name for f in fields(cls)}:
            names = [f.name for f in fields(cls)]
            raise ValueError(f"KV cache handle needs exactly the fields {names}")
        for f in fields(cls):
            _check_field_type(f.name, data[f.name], f.type)
        handle = cls(**{**data, "shape": list(data["shape"])})
        if handle.kind not in HANDLE_KINDS or handle.dtype not in DTYPES:
            raise ValueError(f"bad KV cache handle kind {handle.kind!r} or dtype {handle.dtype!r}")
        if len(handle.shape) != 6 or min(handle.shape) <= 0:
            raise ValueError(f"KV cache shape must be 6 positive ints, got {handle.shape}")
        return handle


_FIELD_TYPES = {"str": str, "int": int, "bool": bool, "bytes": bytes}


def _check_field_type(name: str, value: object, type_name: str) -> None:
    if type_name == "list[int]":
        ok = isinstance(value, (list, tuple)) and all(
            isinstance(x, int) and not isinstance(x, bool) for x in value)
    else:
        expected = _FIELD_TYPES[type_name]
        ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
    if not ok:
        raise ValueError(f"KV cache handle field {name!r} must be {type_name}, got {value!r:.60}")


class KVCache:
    """The paged KV tensor [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

    The owner (allocate) removes the shared memory on close(), at exit, or when it is
    garbage-collected; a peer (open) only maps it and never removes it. A block spans all
    layers, K and V; bytes of a block list are block-major: [n, num_layers, 2, block_size,
    num_kv_heads, head_dim] in the cache dtype.
    """

    def __init__(self, tensor: torch.Tensor, handle: KVCacheHandle, is_owner: bool) -> None:
        self.tensor = tensor
        self.handle = handle
        self.is_owner = is_owner
        # multiprocessing's Finalize (not weakref.finalize) also runs in a multiprocessing
        # child that dies of an exception (those exit with os._exit, skipping atexit), is
        # ignored in forked children, and runs at most once.
        self._finalizer = (util.Finalize(self, _unlink_quietly, args=(handle.name,),
                                         exitpriority=0)
                           if is_owner and handle.kind == "shm" else None)

    @classmethod
    def allocate(cls, model_config: ModelConfig, num_blocks: int, block_size: int,
                 device: str = "cpu", dtype: torch.dtype | None = None) -> KVCache:
        """Allocate zeroed shareable KV memory (this process owns it)."""
        device = resolve_device(device)
        dtype = dtype or resolve_dtype(model_config, device)
        shape = kv_cache_shape(model_config, num_blocks, block_size)
        if device.startswith("cuda"):
            return cls._allocate_cuda(shape, dtype, device)
        return cls._allocate_shm(shape, dtype)

    @classmethod
    def _allocate_shm(cls, shape: list[int], dtype: torch.dtype) -> KVCache:
        numel = _numel(shape)
        path = os.path.join(_shm_dir(), f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        nbytes = numel * dtype.itemsize
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # Reserve the pages now: a full tmpfs fails here, not as SIGBUS on first write.
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, nbytes)
                else:  # macOS: sparse file
                    os.ftruncate(fd, nbytes)
            except OSError as e:
                raise OSError(e.errno, f"cannot reserve {nbytes} bytes of KV cache in "
                              f"{os.path.dirname(path)}: {e.strerror}") from e
            finally:
                os.close(fd)
            tensor = torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)
        except BaseException:
            _unlink_quietly(path)
            raise
        handle = KVCacheHandle(kind="shm", name=path, shape=shape,
                               dtype=_dtype_name(dtype), owner_pid=os.getpid())
        return cls(tensor, handle, is_owner=True)

    @classmethod
    def _allocate_cuda(cls, shape: list[int], dtype: torch.dtype, device: str) -> KVCache:
        tensor = torch.zeros(shape, dtype=dtype, device=device)
        (device_index, cuda_handle, size_bytes, offset_bytes, ref_handle, ref_offset,
         event_handle, event_sync) = tensor.untyped_storage()._share_cuda_()
        handle = KVCacheHandle(
            kind="cuda", name="", shape=shape, dtype=_dtype_name(dtype), owner_pid=os.getpid(),
            device_index=int(device_index), cuda_handle=bytes(cuda_handle),
            storage_size_bytes=int(size_bytes), storage_offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(ref_handle), ref_counter_offset=int(ref_offset),
            event_handle=bytes(event_handle or b""), event_sync_required=bool(event_sync))
        return cls(tensor, handle, is_owner=True)

    @classmethod
    def open(cls, handle: KVCacheHandle) -> KVCache:
        """Map the memory another process allocated (never removes it)."""
        dtype = getattr(torch, handle.dtype)
        if handle.kind == "cuda":
            return cls(_open_cuda(handle, dtype), handle, is_owner=False)
        numel = _numel(handle.shape)
        if not os.path.basename(handle.name).startswith(SHM_PREFIX):
            raise ValueError(f"{handle.name!r} is not a kvdrain KV cache segment")
        try:
            size = os.stat(handle.name).st_size
        except FileNotFoundError:
            raise ValueError(f"KV cache {handle.name!r} no longer exists") from None
        if size != numel * dtype.itemsize:
            raise ValueError(f"KV cache {handle.name!r} holds {size} bytes, handle says "
                             f"{numel * dtype.itemsize}")
        tensor = torch.from_file(handle.name, shared=True, size=numel, dtype=dtype)
        return cls(tensor.view(handle.shape), handle, is_owner=False)

    @property
    def num_blocks(self) -> int:
        return self.handle.shape[2]

    @property
    def num_bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        itemsize = getattr(torch, self.handle.dtype).itemsize
        return _numel(self.handle.shape) // self.num_blocks * itemsize

    def gather_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The blocks' contents as one contiguous uint8 CPU tensor, block-major, in one
        copy (advanced indexing of the block-major view gathers straight into it)."""
        index = self._block_index(block_ids)
        blocks = self.tensor.permute(2, 0, 1, 3, 4, 5)[index]
        return blocks.view(torch.uint8).reshape(-1).cpu()

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """The blocks' contents as bytes, block-major (see the class docstring)."""
        return self.gather_blocks(block_ids).numpy().tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes | bytearray | memoryview) -> None:
        """Overwrite the blocks with read_blocks() bytes of a cache of the same layout.

        Returns once the data is in place, visible to every process mapping this memory.
        """
        index = self._block_index(block_ids, distinct=True)
        expected = len(block_ids) * self.num_bytes_per_block
        if memoryview(data).nbytes != expected:
            raise ValueError(f"{len(block_ids)} blocks need {expected} bytes, "
                             f"got {memoryview(data).nbytes}")
        if not block_ids:
            return
        shape = [self.handle.shape[i] for i in (0, 1, 3, 4, 5)]
        with warnings.catch_warnings():  # read-only bytes: we only read from the view
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(data, dtype=torch.uint8)
        blocks = raw.view(self.tensor.dtype).view(len(block_ids), *shape)
        self.tensor.index_copy_(2, index, blocks.permute(1, 2, 0, 3, 4, 5).to(self.tensor.device))
        self._synchronize()

    def copy_blocks_from(self, other: KVCache, src_ids: list[int], dst_ids: list[int]) -> None:
        """Same-host copy of other's blocks src_ids into this cache's dst_ids (synchronous)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destinations")
        if other.tensor.dtype != self.tensor.dtype or (
                [s for i, s in enumerate(other.handle.shape) if i != 2]
                != [s for i, s in enumerate(self.handle.shape) if i != 2]):
            raise ValueError(f"KV layouts differ: {other.handle.shape} {other.handle.dtype} vs "
                             f"{self.handle.shape} {self.handle.dtype}")
        src = other._block_index(src_ids)
        dst = self._block_index(dst_ids, distinct=True)
        blocks = other.tensor.index_select(2, src).to(self.tensor.device)
        self.tensor.index_copy_(2, dst, blocks)
        self._synchronize()

    def close(self) -> None:
        """Drop the mapping; the owner also removes the shared memory. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self.tensor = torch.empty(0)

    def _synchronize(self) -> None:
        # A CUDA copy is queued on this process's stream: finish it before anyone is told
        # the blocks are ready (another process reads them on its own stream).
        if self.tensor.is_cuda:
            torch.cuda.synchronize(self.tensor.device)

    def _block_index(self, block_ids: list[int], distinct: bool = False) -> torch.Tensor:
        for block_id in block_ids:
            if not 0 < block_id < self.num_blocks:
                raise ValueError(f"block id {block_id} outside 1..{self.num_blocks - 1} "
                                 "(block 0 is the null block)")
        if distinct and len(set(block_ids)) != len(block_ids):
            raise ValueError(f"duplicate destination block ids in {block_ids}")
        return torch.tensor(block_ids, dtype=torch.long, device=self.tensor.device)


def _open_cuda(handle: KVCacheHandle, dtype: torch.dtype) -> torch.Tensor:
    """Rebuild the owner's CUDA tensor from its IPC handle (another process only)."""
    if not torch.cuda.is_available():
        raise ValueError("a CUDA KV cache handle needs CUDA in this process")
    if handle.owner_pid == os.getpid():
        raise ValueError("CUDA IPC memory cannot be opened by the process that exported it")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        handle.device_index, handle.cuda_handle, handle.storage_size_bytes,
        handle.storage_offset_bytes, handle.ref_counter_handle, handle.ref_counter_offset,
        handle.event_handle or None, handle.event_sync_required)
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    stride = torch.empty(handle.shape, device="meta").stride()
    return torch._utils._rebuild_tensor(typed, 0, handle.shape, stride)


def _shm_dir() -> str:
    """/dev/shm where it exists (RAM-backed), else the temp directory."""
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _numel(shape: list[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
