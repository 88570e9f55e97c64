"""Host buffers for the data plane: raw byte views of tensors/arrays, typed views back, a pool.

``as_send_view(obj)`` turns bytes, bytearray, memoryview, a contiguous numpy array or a
contiguous CPU torch tensor into ``(memoryview of its bytes, BufferSpec)`` without copying.
``typed_view(buffer, spec)`` is the inverse on the receiving side (numpy array, or a torch
tensor when ``spec.dtype`` is ``torch.*``), again without copying. torch is imported only when
a tensor is involved, so storage-only processes never load it.

``BufferPool`` keeps freed receive buffers by power-of-two size class so steady-state transfers
allocate nothing; it is the data plane's default allocator when one is given to the receiver.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from typing import Any

import numpy as np

from deepinfer.transport.protocol import BufferSpec

_MIN_CLASS_BYTES = 64 * 1024


def as_send_view(obj: Any) -> tuple[memoryview, BufferSpec]:
    if isinstance(obj, (bytes, bytearray, memoryview)):
        view = memoryview(obj)
        if not view.c_contiguous:
            raise ValueError("memoryview is not contiguous; copy it into a contiguous buffer first")
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        return view, BufferSpec(num_bytes=view.nbytes)
    if isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise ValueError(f"numpy array of shape {obj.shape} is not C-contiguous; use np.ascontiguousarray")
        raw = obj.reshape(-1).view(np.uint8) if obj.size else np.empty(0, np.uint8)
        return memoryview(raw), BufferSpec(num_bytes=obj.nbytes, dtype=obj.dtype.str, shape=tuple(obj.shape))
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cpu":
            raise ValueError(f"tensor is on {obj.device}; the host data plane sends CPU memory (stage it with .cpu())")
        if not obj.is_contiguous():
            raise ValueError(f"tensor of shape {tuple(obj.shape)} is not contiguous; call .contiguous() first")
        raw = obj.detach().reshape(-1).view(torch.uint8).numpy()
        spec = BufferSpec(num_bytes=raw.nbytes, dtype=f"torch.{str(obj.dtype).removeprefix('torch.')}",
                          shape=tuple(obj.shape))
        return memoryview(raw), spec
    raise TypeError(f"cannot send {type(obj).__name__}: pass bytes, a memoryview, a numpy array or a CPU tensor")


def typed_view(buffer: Any, spec: BufferSpec) -> Any:
    """View the first ``spec.num_bytes`` of ``buffer`` with the spec's dtype and shape."""
    raw = np.frombuffer(buffer, dtype=np.uint8, count=spec.num_bytes)
    if spec.dtype.startswith("torch."):
        import torch

        dtype = getattr(torch, spec.dtype.removeprefix("torch."))
        shape = (-1,) if spec.shape is None else spec.shape
        if spec.num_bytes == 0:
            return torch.empty(shape if spec.shape is not None else (0,), dtype=dtype)
        return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape)
    typed = raw.view(np.dtype(spec.dtype))
    return typed if spec.shape is None else typed.reshape(spec.shape)


def _size_class(num_bytes: int) -> int:
    return max(_MIN_CLASS_BYTES, 1 << max(0, num_bytes - 1).bit_length())


class BufferPool:
    """Receive buffers reused by power-of-two size class; keeps at most ``max_kept_bytes`` idle.

    ``acquire(n)`` returns a writable ``np.uint8`` array of exactly ``n`` bytes (a view of a pooled
    block); ``release(array)`` gives its block back. Not thread-safe: use from one event loop.
    """

    def __init__(self, max_kept_bytes: int = 1 << 30):
        self.max_kept_bytes = max_kept_bytes
        self.num_kept_bytes = 0
        self.num_allocations = 0
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)

    def acquire(self, num_bytes: int) -> np.ndarray:
        size = _size_class(num_bytes)
        free = self._free[size]
        if free:
            block = free.pop()
            self.num_kept_bytes -= size
        else:
            block = np.empty(size, dtype=np.uint8)
            self.num_allocations += 1
        return block[:num_bytes]

    def release(self, array: np.ndarray) -> None:
        block = array.base if array.base is not None else array
        size = block.nbytes
        if size != _size_class(size) or self.num_kept_bytes + size > self.max_kept_bytes:
            return  # not one of ours, or the pool is full: let it be garbage collected
        self._free[size].append(block)
        self.num_kept_bytes += size

    def allocate(self, specs: list[BufferSpec]) -> list[np.ndarray]:
        """Allocator for ``BulkReceiver``: one pooled buffer per spec."""
        return [self.acquire(spec.num_bytes) for spec in specs]

    def release_all(self, buffers: list[np.ndarray]) -> None:
        for buffer in buffers:
            self.release(buffer)
