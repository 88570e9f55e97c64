"""Fused Gumbel-max sampling on NVIDIA GPUs (Triton): ``argmax(logits / T + G)`` in one pass.

The sampler's temperature-only draw (engine/sampler.py, ``noisy_argmax``) written as torch ops
on a GPU is ~20 elementwise kernels over ``[B, V]`` (the counter hash of engine/counter_rng.py in
int64, two logs, divide, add) plus the argmax, and ~0.4 ms of launches on the engine's device
thread at 256 x 4096, all of it between two forwards. Here one program per row streams the row's
logits once, hashes ``(row key, token)`` to the same 24-bit uniform, takes the same two logs,
divides and adds with IEEE rounding and keeps the first maximum: the same token as the torch
form, bit for bit (``tests/kernels/test_gpu_sampling.py`` checks it on the GPU machine).

Rounding: ``u = ((h >> 8) + 0.5) * 2^-24`` in float32 as counter_rng does; ``libdevice.log`` is
the CUDA math library's ``logf`` that torch's CUDA ``log`` compiles to; ``div_rn`` is the IEEE
divide (Triton's ``/`` on float32 is an approximate one). A row containing NaN picks its first
NaN, as ``torch.argmax`` does.

Without Triton or a CUDA tensor, ``available`` is False and callers use the torch form.
"""

from __future__ import annotations

import torch

from deepinfer.engine.counter_rng import _MUL_A, _MUL_B

try:  # CPU machines have no Triton (or a Triton without a GPU driver)
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except Exception:  # noqa: BLE001 - any import failure means "use the torch form"
    triton = None

_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _gumbel_argmax_kernel(logits_ptr, row_stride, temp_ptr, keys_ptr, token_hash_ptr, out_ptr, vocab,
                              MUL_A: tl.constexpr, MUL_B: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        t = tl.load(temp_ptr + row)
        key = tl.load(keys_ptr + row).to(tl.uint32)  # int64 key in [0, 2^32): its low 32 bits
        best_val = -float("inf")
        best_idx = 0
        nan_idx = vocab  # first NaN seen (vocab: none)
        base = logits_ptr + row.to(tl.int64) * row_stride
        for start in range(0, vocab, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            live = offs < vocab
            x = tl.load(base + offs, mask=live, other=0.0)
            h = key ^ tl.load(token_hash_ptr + offs, mask=live, other=0).to(tl.uint32, bitcast=True)
            h = h ^ (h >> 16)
            h = h * MUL_A
            h = h ^ (h >> 15)
            h = h * MUL_B
            h = h ^ (h >> 16)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            g = -libdevice.log(-libdevice.log(u))
            y = tl.math.div_rn(x, t) + g
            nan_idx = tl.minimum(nan_idx, tl.min(tl.where(live & (y != y), offs, vocab), 0))
            y = tl.where(live & (y == y), y, -float("inf"))
            m, i = tl.max(y, 0, return_indices=True, return_indices_tie_break_left=True)
            better = m > best_val  # strict: an equal maximum in a later block is not the first
            best_idx = tl.where(better, start + i, best_idx)
            best_val = tl.where(better, m, best_val)
        tl.store(out_ptr + row, tl.where(nan_idx < vocab, nan_idx, best_idx).to(tl.int64))


def available(logits: torch.Tensor) -> bool:
    """True when ``gumbel_argmax`` can run on ``logits`` (float32 CUDA rows, Triton present)."""
    return (triton is not None and logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2
            and logits.stride(1) == 1 and logits.shape[1] > 0)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  token_hash: torch.Tensor) -> torch.Tensor:
    """``argmax(logits / temperature[:, None] + gumbel(keys), dim=-1)`` as int64 ``[B]``.

    ``keys`` are the rows' 32-bit counter keys (int64 ``[B]``), ``token_hash`` the vocabulary's
    hashed token ids as int32 bit patterns (``GumbelNoise.token_hash32``, ``[V]``); all on one GPU."""
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    if token_hash.dtype != torch.int32 or token_hash.numel() != v:
        raise ValueError(f"gumbel_argmax: token_hash must be int32 [{v}], got {token_hash.dtype} "
                         f"{tuple(token_hash.shape)}")
    _gumbel_argmax_kernel[(b,)](logits, logits.stride(0), temperature.to(torch.float32).contiguous(),
                                keys.contiguous(), token_hash, out, v, MUL_A=_MUL_A, MUL_B=_MUL_B, BLOCK=_BLOCK)
    return out
