"""Paged KV cache memory other processes map by handle. Runs in: engine core, connector worker.

On the CPU it is a file under /dev/shm, mapped with numpy on first use: copying blocks (the
connector worker's whole job) needs no torch, and the mock runner's engine core, which only shares
it, imports neither. torch comes in only for a torch model's view of the same pages (made on first
use) and for CUDA memory with its IPC handles.
"""

from __future__ import annotations

import os
import tempfile
import uuid
import warnings
from dataclasses import asdict, dataclass, fields
from multiprocessing import util
from typing import TYPE_CHECKING

from engine.config import ModelConfig

if TYPE_CHECKING:
    import numpy as np
    import torch

DTYPE_SIZES = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2}
DTYPES = tuple(DTYPE_SIZES)
HANDLE_KINDS = ("shm", "cuda")
SHM_PREFIX = "kvdrain-kv-"  # segment file names: kvdrain-kv-<owner pid>-<random>


def resolve_device(device: str) -> str:
    """ "auto" -> "cuda" when torch sees a GPU, else "cpu"; "cuda[:N]" requires one."""
    if device == "cpu":
        return device
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but torch.cuda.is_available() is False")
        return device
    raise ValueError(f"unknown device {device!r}; use auto, cpu, cuda or cuda:N")


def resolve_dtype(model_config: ModelConfig, device: str) -> torch.dtype:
    """The model and KV dtype: ModelConfig.dtype, or for "auto" fp32 on the CPU, bf16 on CUDA."""
    import torch

    return getattr(torch, dtype_name(model_config, device))


def dtype_name(model_config: ModelConfig, device: str) -> str:
    """resolve_dtype's answer by name, without torch."""
    if model_config.dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return model_config.dtype


def kv_cache_shape(model_config: ModelConfig, num_blocks: int, block_size: int) -> list[int]:
    """[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]."""
    return [
        model_config.num_layers,
        2,
        num_blocks,
        block_size,
        model_config.num_kv_heads,
        model_config.head_dim,
    ]


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
            isinstance(x, int) and not isinstance(x, bool) for x in value
        )
    else:
        expected = _FIELD_TYPES[type_name]
        ok = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
    if not ok:
        raise ValueError(f"KV cache handle field {name!r} must be {type_name}, got {value!r:.60}")


class KVCache:
    """The paged KV memory [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].

    The owner (allocate) removes the shared memory on close(), at exit, or when it is
    garbage-collected; a peer (open) only maps it and never removes it. A block spans all
    layers, K and V; bytes of a block list are block-major: [n, num_layers, 2, block_size,
    num_kv_heads, head_dim] in the cache dtype. On the CPU, blocks move as bytes through
    `pages` (numpy, no torch); `tensor` is the torch view of the same memory.
    """

    def __init__(
        self,
        handle: KVCacheHandle,
        is_owner: bool,
        pages: np.ndarray | None = None,
        tensor: torch.Tensor | None = None,
    ) -> None:
        self.handle = handle
        self.is_owner = is_owner
        self._pages = pages  # see `pages`; mapped on first use
        self._closed = False
        self._tensor = tensor
        # multiprocessing's Finalize (not weakref.finalize) also runs in a multiprocessing
        # child that dies of an exception (those exit with os._exit, skipping atexit), is
        # ignored in forked children, and runs at most once.
        self._finalizer = (
            util.Finalize(self, _unlink_quietly, args=(handle.name,), exitpriority=0)
            if is_owner and handle.kind == "shm"
            else None
        )

    @classmethod
    def allocate(
        cls,
        model_config: ModelConfig,
        num_blocks: int,
        block_size: int,
        device: str = "cpu",
        dtype: torch.dtype | str | None = None,
    ) -> KVCache:
        """Allocate zeroed shareable KV memory (this process owns it)."""
        device = resolve_device(device)
        name = dtype_name(model_config, device) if dtype is None else _dtype_name(dtype)
        shape = kv_cache_shape(model_config, num_blocks, block_size)
        if device.startswith("cuda"):
            return cls._allocate_cuda(shape, name, device)
        return cls._allocate_shm(shape, name)

    @classmethod
    def _allocate_shm(cls, shape: list[int], dtype: str) -> KVCache:
        path = os.path.join(_shm_dir(), f"{SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        nbytes = _numel(shape) * DTYPE_SIZES[dtype]
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                # Reserve the pages now: a full tmpfs fails here, not as SIGBUS on first write.
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, nbytes)
                else:  # macOS: sparse file
                    os.ftruncate(fd, nbytes)
            except OSError as e:
                raise OSError(
                    e.errno,
                    f"cannot reserve {nbytes} bytes of KV cache in "
                    f"{os.path.dirname(path)}: {e.strerror}",
                ) from e
            finally:
                os.close(fd)
            handle = KVCacheHandle(
                kind="shm", name=path, shape=shape, dtype=dtype, owner_pid=os.getpid()
            )
            return cls(handle, is_owner=True)
        except BaseException:
            _unlink_quietly(path)
            raise

    @classmethod
    def _allocate_cuda(cls, shape: list[int], dtype: str, device: str) -> KVCache:
        import torch

        tensor = torch.zeros(shape, dtype=getattr(torch, dtype), device=device)
        (
            device_index,
            cuda_handle,
            size_bytes,
            offset_bytes,
            ref_handle,
            ref_offset,
            event_handle,
            event_sync,
        ) = tensor.untyped_storage()._share_cuda_()
        handle = KVCacheHandle(
            kind="cuda",
            name="",
            shape=shape,
            dtype=dtype,
            owner_pid=os.getpid(),
            device_index=int(device_index),
            cuda_handle=bytes(cuda_handle),
            storage_size_bytes=int(size_bytes),
            storage_offset_bytes=int(offset_bytes),
            ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset),
            event_handle=bytes(event_handle or b""),
            event_sync_required=bool(event_sync),
        )
        return cls(handle, is_owner=True, tensor=tensor)

    @classmethod
    def open(cls, handle: KVCacheHandle) -> KVCache:
        """Map the memory another process allocated (never removes it)."""
        if handle.kind == "cuda":
            return cls(handle, is_owner=False, tensor=_open_cuda(handle))
        nbytes = _numel(handle.shape) * DTYPE_SIZES[handle.dtype]
        if not os.path.basename(handle.name).startswith(SHM_PREFIX):
            raise ValueError(f"{handle.name!r} is not a kvdrain KV cache segment")
        try:
            size = os.stat(handle.name).st_size
        except FileNotFoundError:
            raise ValueError(f"KV cache {handle.name!r} no longer exists") from None
        if size != nbytes:
            raise ValueError(f"KV cache {handle.name!r} holds {size} bytes, handle says {nbytes}")
        return cls(handle, is_owner=False, pages=_map_pages(handle))

    @property
    def pages(self) -> np.ndarray | None:
        """shm: the segment as uint8 [num_layers * 2, num_blocks, bytes per layer-block]
        (block b of layer l, K or V, is pages[2 * l + kv, b]); None for CUDA memory."""
        if self._pages is None and self.handle.kind == "shm" and not self._closed:
            self._pages = _map_pages(self.handle)
        return self._pages

    @property
    def tensor(self) -> torch.Tensor:
        """The torch view [num_layers, 2, num_blocks, ...] (shm: the same pages; torch is
        imported on first use)."""
        if self._tensor is None:
            if self.pages is None:
                raise ValueError("the KV cache is closed")
            import torch

            flat = torch.from_numpy(self.pages.reshape(-1))
            self._tensor = flat.view(getattr(torch, self.handle.dtype)).view(self.handle.shape)
        return self._tensor

    @property
    def num_blocks(self) -> int:
        return self.handle.shape[2]

    @property
    def nbytes(self) -> int:
        """Bytes of the whole cache (torch's tensor.nbytes, without torch)."""
        return _numel(self.handle.shape) * DTYPE_SIZES[self.handle.dtype]

    @property
    def num_bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V."""
        return _numel(self.handle.shape) // self.num_blocks * DTYPE_SIZES[self.handle.dtype]

    def gather_blocks(self, block_ids: list[int]) -> np.ndarray:
        """The blocks' contents as one contiguous uint8 array in host memory, block-major,
        in one copy (advanced indexing of the block-major view gathers straight into it)."""
        index = self._block_index(block_ids)
        if self.pages is not None:
            return self.pages.transpose(1, 0, 2)[index].reshape(-1)
        import torch

        blocks = self.tensor.permute(2, 0, 1, 3, 4, 5)[
            torch.from_numpy(index).to(self.tensor.device)
        ]
        return blocks.view(torch.uint8).reshape(-1).cpu().numpy()

    def read_blocks(self, block_ids: list[int]) -> bytes:
        """The blocks' contents as bytes, block-major (see the class docstring)."""
        return self.gather_blocks(block_ids).tobytes()

    def write_blocks(self, block_ids: list[int], data: bytes | bytearray | memoryview) -> None:
        """Overwrite the blocks with read_blocks() bytes of a cache of the same layout.

        Returns once the data is in place, visible to every process mapping this memory.
        """
        index = self._block_index(block_ids, distinct=True)
        expected = len(block_ids) * self.num_bytes_per_block
        if memoryview(data).nbytes != expected:
            raise ValueError(
                f"{len(block_ids)} blocks need {expected} bytes, got {memoryview(data).nbytes}"
            )
        if not block_ids:
            return
        if self.pages is not None:
            import numpy as np

            raw = np.frombuffer(data, dtype=np.uint8)
            num_pages, _, page_bytes = self.pages.shape
            self.pages[:, index] = raw.reshape(len(block_ids), num_pages, page_bytes).transpose(
                1, 0, 2
            )
            return
        import torch

        shape = [self.handle.shape[i] for i in (0, 1, 3, 4, 5)]
        with warnings.catch_warnings():  # read-only bytes: we only read from the view
            warnings.simplefilter("ignore", UserWarning)
            blocks = torch.frombuffer(data, dtype=torch.uint8)
        blocks = blocks.view(self.tensor.dtype).view(len(block_ids), *shape)
        self.tensor.index_copy_(
            2,
            torch.from_numpy(index).to(self.tensor.device),
            blocks.permute(1, 2, 0, 3, 4, 5).to(self.tensor.device),
        )
        self._synchronize()

    def copy_blocks_from(self, other: KVCache, src_ids: list[int], dst_ids: list[int]) -> None:
        """Same-host copy of other's blocks src_ids into this cache's dst_ids (synchronous)."""
        if len(src_ids) != len(dst_ids):
            raise ValueError(f"{len(src_ids)} source blocks but {len(dst_ids)} destinations")
        if other.handle.dtype != self.handle.dtype or (
            [s for i, s in enumerate(other.handle.shape) if i != 2]
            != [s for i, s in enumerate(self.handle.shape) if i != 2]
        ):
            raise ValueError(
                f"KV layouts differ: {other.handle.shape} {other.handle.dtype} vs "
                f"{self.handle.shape} {self.handle.dtype}"
            )
        src = other._block_index(src_ids)
        dst = self._block_index(dst_ids, distinct=True)
        if self.pages is not None and other.pages is not None:
            self.pages[:, dst] = other.pages[:, src]
            return
        import torch

        blocks = other.tensor.index_select(2, torch.from_numpy(src).to(other.tensor.device))
        self.tensor.index_copy_(
            2, torch.from_numpy(dst).to(self.tensor.device), blocks.to(self.tensor.device)
        )
        self._synchronize()

    def close(self) -> None:
        """Drop the mapping; the owner also removes the shared memory. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()
        self._pages = self._tensor = None
        self._closed = True  # never mapped again

    def _synchronize(self) -> None:
        # A CUDA copy is queued on this process's stream: finish it before anyone is told
        # the blocks are ready (another process reads them on its own stream).
        if self._tensor is not None and self._tensor.is_cuda:
            import torch

            torch.cuda.synchronize(self._tensor.device)

    def _block_index(self, block_ids: list[int], distinct: bool = False) -> np.ndarray:
        for block_id in block_ids:
            if not 0 < block_id < self.num_blocks:
                raise ValueError(
                    f"block id {block_id} outside 1..{self.num_blocks - 1} "
                    "(block 0 is the null block)"
                )
        if distinct and len(set(block_ids)) != len(block_ids):
            raise ValueError(f"duplicate destination block ids in {block_ids}")
        import numpy as np

        return np.array(block_ids, dtype=np.int64)


def _map_pages(handle: KVCacheHandle) -> np.ndarray:
    """The shm segment mapped read-write, as uint8 [num_layers * 2, num_blocks, page bytes]."""
    import numpy as np

    layers, kv, num_blocks = handle.shape[:3]
    page_bytes = _numel(handle.shape[3:]) * DTYPE_SIZES[handle.dtype]
    pages = np.memmap(
        handle.name, dtype=np.uint8, mode="r+", shape=(layers * kv, num_blocks, page_bytes)
    )
    return pages.view(np.ndarray)  # a plain array (the mapping lives as long as it does)


def _open_cuda(handle: KVCacheHandle) -> torch.Tensor:
    """Rebuild the owner's CUDA tensor from its IPC handle (another process only)."""
    import torch

    dtype = getattr(torch, handle.dtype)
    if not torch.cuda.is_available():
        raise ValueError("a CUDA KV cache handle needs CUDA in this process")
    if handle.owner_pid == os.getpid():
        raise ValueError("CUDA IPC memory cannot be opened by the process that exported it")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        handle.device_index,
        handle.cuda_handle,
        handle.storage_size_bytes,
        handle.storage_offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle or None,
        handle.event_sync_required,
    )
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


def _dtype_name(dtype: torch.dtype | str) -> str:
    name = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise ValueError(f"KV cache dtype {name!r}: use one of {', '.join(DTYPES)}")
    return name
