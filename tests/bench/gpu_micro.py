"""Kernel microbenchmarks of `deepinfer bench gpu --kernels`: each Triton kernel next to its
torch form at V4-Flash decode shapes (1 and 64 tokens), and the indexer's scores at a prefill
shape (2048 tokens x 2048 candidates); median time per call of back-to-back launches
(``triton.testing.do_bench``: launch cost included, as a decode step pays it), and the bytes the
call must move over that time."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.kernels import gpu_attention, gpu_indexer, gpu_mhc, gpu_moe, gpu_norm, torch_ref

HIDDEN, HEADS, HEAD_DIM, ROPE, HC = 4096, 64, 512, 64, 4
EXPERTS, TOP_K, INTER = 64, 6, 2048
WINDOW, PICKED = 128, 512
INDEX_HEADS, INDEX_DIM, INDEX_TOKENS, CANDIDATES = 64, 128, 2048, 2048


@dataclass(slots=True)
class Timing:
    name: str
    tokens: int
    ours_us: float
    torch_us: float
    bytes: int

    @property
    def gbps(self) -> float:
        return self.bytes / (self.ours_us * 1e-6) / 1e9


def _median_us(fn: Callable) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median") * 1e3


def _nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _cases(t: int, g: torch.Generator):
    bf = dict(device="cuda", dtype=torch.bfloat16)
    f32 = dict(device="cuda", dtype=torch.float32)

    def rn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g, device="cuda") * scale).to(dtype)

    streams = rn(t, HC, HIDDEN, dtype=torch.bfloat16)
    fn = rn((2 + HC) * HC, HC * HIDDEN, scale=(HC * HIDDEN) ** -0.5)
    sc, base, cb = 1 + 0.2 * rn(2 * HC), 0.2 * rn(2 * HC), 0.2 * rn(HC, HC)
    kw = dict(norm_eps=1e-6, hc_eps=1e-6, sinkhorn_iters=20)
    yield ("hc_pre", lambda: gpu_mhc.hc_pre(streams, fn, sc, base, 1.0, cb, **kw),
           lambda: torch_ref.hc_pre(streams, fn, sc, base, 1.0, cb, **kw), _nbytes(streams, fn) + t * HIDDEN * 2)
    post, comb, out = rn(t, HC), rn(t, HC, HC), rn(t, HIDDEN, dtype=torch.bfloat16)
    yield ("hc_post", lambda: gpu_mhc.hc_post(out, streams, post, comb),
           lambda: torch_ref.hc_post(out, streams, post, comb), 2 * _nbytes(streams) + _nbytes(out))
    q = rn(t, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    cos, sin = torch_ref.rope_tables(torch.arange(t, device="cuda") + 1000,
                                     1.0 / (10000 ** (torch.arange(0, ROPE, 2, device="cuda").float() / ROPE)))
    yield ("rms_norm_rope q", lambda: gpu_norm.rms_norm_rope(q, None, 1e-6, cos, sin),
           lambda: torch_ref.rms_norm_rope(q, None, 1e-6, cos, sin), 2 * _nbytes(q))
    pool = rn(t * WINDOW + 1, HEAD_DIM, dtype=torch.bfloat16)
    rows = torch.randint(0, t * WINDOW, (t, WINDOW + 1), generator=g, device="cuda")
    rows[:, -1] = t * WINDOW
    pbias = torch.zeros(t, 1, WINDOW + 1, **f32)
    extra = rn(4096, HEAD_DIM, dtype=torch.bfloat16)
    erows = torch.randint(0, 4096, (t, PICKED), generator=g, device="cuda")
    ebias = torch.zeros(t, 1, PICKED, **f32)
    sinks = rn(HEADS)
    args = (q, pool, rows, pbias, extra, erows, ebias, sinks, HEAD_DIM**-0.5)
    yield ("gathered_attention", lambda: gpu_attention.gathered_attention(*args),
           lambda: torch_ref.gathered_attention(*args), 2 * _nbytes(q) + t * (WINDOW + PICKED) * HEAD_DIM * 2)
    logits = rn(t, EXPERTS, dtype=torch.bfloat16)
    bias = 0.2 * rn(EXPERTS)
    yield ("moe_route", lambda: gpu_moe.moe_route(logits, bias, None, TOP_K, "sqrtsoftplus", 1.5),
           lambda: torch_ref.moe_route(logits, bias, None, TOP_K, "sqrtsoftplus", 1.5), _nbytes(logits))
    x = rn(t, HIDDEN, dtype=torch.bfloat16)
    gate_up = rn(EXPERTS, 2 * INTER, HIDDEN, scale=HIDDEN**-0.5, dtype=torch.bfloat16)
    down = rn(EXPERTS, HIDDEN, INTER, scale=INTER**-0.5, dtype=torch.bfloat16)
    ids, weights = gpu_moe.moe_route(logits, bias, None, TOP_K, "sqrtsoftplus", 1.5)
    acc = torch.zeros(t, HIDDEN, **bf)
    used = ids.unique().numel()

    def dense():  # the model's torch path off the CPU: every expert on a dense [E, T, H] layout
        rows = x[None].expand(EXPERTS, t, HIDDEN)
        hidden = torch.bmm(rows, gate_up.transpose(1, 2))
        act = torch_ref.swiglu_clamped(hidden.view(-1, 2 * INTER), 10.0)
        return torch.bmm(act.view(EXPERTS, t, INTER), down.transpose(1, 2))

    yield ("moe_experts_", lambda: gpu_moe.moe_experts_(acc, x, ids, weights, gate_up, down, 10.0), dense,
           used * (_nbytes(gate_up) + _nbytes(down)) // EXPERTS)


MOE_PREFILL_TOKENS = 16384  # the routed experts of a prefill forward (the slice's b64 forward has 32K)


def _moe_prefill_case(g: torch.Generator):
    """The routed experts of a prefill forward, bf16: ``moe_experts_`` through torch's grouped
    GEMM (the default where it exists) in the "ours" column, through the Triton tiles in the
    "torch" column; bytes: the routed experts' weights."""
    t = MOE_PREFILL_TOKENS
    x = torch.randn(t, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
    gate_up = (torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g, device="cuda") * HIDDEN**-0.5).to(torch.bfloat16)
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=g, device="cuda") * INTER**-0.5).to(torch.bfloat16)
    logits = torch.randn(t, EXPERTS, generator=g, device="cuda")
    ids, weights = gpu_moe.moe_route(logits, torch.zeros(EXPERTS, device="cuda"), None, TOP_K, "sqrtsoftplus", 1.5)
    acc = torch.zeros(t, HIDDEN, dtype=torch.bfloat16, device="cuda")

    def experts(grouped: bool):
        def call():
            default, gpu_moe.GROUPED_MM = gpu_moe.GROUPED_MM, grouped
            try:
                return gpu_moe.moe_experts_(acc, x, ids, weights, gate_up, down, 10.0)
            finally:
                gpu_moe.GROUPED_MM = default

        return call

    yield (t, "moe_experts_ prefill (ours: grouped GEMM, torch: Triton tiles)", experts(gpu_moe.GROUPED_MM),
           experts(False), _nbytes(gate_up, down))


def _prefill_cases(g: torch.Generator):
    """The CSA indexer's scores of a prefill chunk: every token's own candidate keys (the torch
    form materialises [T, H, B] float32: 1 GiB here); the routed experts of a prefill forward."""
    yield from _moe_prefill_case(g)
    t = INDEX_TOKENS
    q = torch.randn(t, INDEX_HEADS, INDEX_DIM, generator=g, device="cuda").to(torch.bfloat16)
    keys = torch.randn(t, CANDIDATES, INDEX_DIM, generator=g, device="cuda").to(torch.bfloat16)
    weights = torch.randn(t, INDEX_HEADS, generator=g, device="cuda") * INDEX_HEADS**-0.5
    valid = torch.rand(t, CANDIDATES, generator=g, device="cuda") < 0.9
    args = (q, weights, keys, valid)
    yield (t, "index_scores", lambda: gpu_indexer.index_scores(*args), lambda: torch_ref.index_scores(*args),
           _nbytes(*args) + t * CANDIDATES * 4)


def run(token_counts=(1, 64), seed: int = 0) -> list[Timing]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    out = []
    decode = ((t, *case) for t in token_counts for case in _cases(t, g))
    for t, name, ours, ref, nbytes in itertools.chain(decode, _prefill_cases(g)):
        ours()
        ref()
        out.append(Timing(name, t, _median_us(ours), _median_us(ref), nbytes))
    return out
