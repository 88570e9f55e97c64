"""Fused Gumbel-max sampling on NVIDIA GPUs (Triton): ``argmax(logits / T + G)`` in one pass.

The sampler's temperature-only draw (engine/sample/sampler.py, ``noisy_argmax``) written as torch ops
on a GPU is ~20 elementwise kernels over ``[B, V]`` (the counter hash of kernels/counter_rng.py in
int64, two logs, divide, add) plus the argmax, and ~0.4 ms of launches on the engine's device
thread at 256 x 4096, all of it between two forwards. Here one program per row streams the row's
logits once, hashes ``(row key, token)`` to the same 24-bit uniform, takes the same two logs,
divides and adds with IEEE rounding and keeps the first maximum: the same token as the torch
form, bit for bit (``tests/kernels/test_gpu_sampling.py`` checks it on the GPU machine).

Rounding: ``u = min(((h >> 8) + 0.5) * 2^-24, U_MAX)`` in float32 as counter_rng does; ``libdevice.log`` is
the CUDA math library's ``logf`` that torch's CUDA ``log`` compiles to; ``div_rn`` is the IEEE
divide (Triton's ``/`` on float32 is an approximate one). A row containing NaN picks its first
NaN, as ``torch.argmax`` does.

Without Triton or a CUDA tensor, ``available`` is False and callers use the torch form.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.kernels import counter_rng

_BLOCK = 1024


@functools.cache
def _kernel():
    """The Triton kernel (kernels/gpu_sampling_kernel.py), None without Triton. Imported on first
    use: CPU processes never load Triton (its import costs time and its bindings complain at exit)."""
    try:
        from deepinfer.kernels.gpu_sampling_kernel import gumbel_argmax_kernel
    except Exception:  # noqa: BLE001 - any import failure means "use the torch form"
        return None
    return gumbel_argmax_kernel


def available(logits: torch.Tensor) -> bool:
    """True when ``gumbel_argmax`` can run on ``logits`` (float32 CUDA rows, Triton present)."""
    return (logits.is_cuda and logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
            and logits.shape[1] > 0 and _kernel() is not None)


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
    _kernel()[(b,)](logits, logits.stride(0), temperature.to(torch.float32).contiguous(), keys.contiguous(),
                    token_hash, out, v, MUL_A=counter_rng.MUL_A, MUL_B=counter_rng.MUL_B, BLOCK=_BLOCK)
    return out
