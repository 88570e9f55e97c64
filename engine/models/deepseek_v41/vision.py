"""The DeepSeek-V4.1 vision tower: ViT over one image's patches, 3x3 aligner, the prompt span.

    patches [nh * nw, 3 * 14 * 14]
      -> patch_embed (linear + bias) -> [nh * nw, D]
      -> L x pre-norm block: x += attn(norm1(x)); x += mlp(norm2(x))
           attention: wqkv (+bias) -> heads, 2D RoPE on q and k, bidirectional over the image,
                      scale head_dim^-0.5, wo (+bias)
           mlp: w1 -> [gate | up], w2(silu(gate) * up)   (no biases)
      -> norm -> grid [nh, nw, D]
      -> aligner: zero-pad bottom/right to multiples of 3; each 3x3 cell flattened channel-major,
                  then kernel row, kernel column (torch's unfold order) -> [rows * cols, 9D]
                  -> w1 (+bias) -> exact GELU -> w2 (+bias) -> [rows * cols, hidden]
      -> span [START, row 0 cells.., NEWLINE, row 1 cells.., NEWLINE, ..., END]

2D RoPE: each head's first half pairs with its second half (rotate-half); of the half's channels
the first quarter of the head turns with the patch row, the second quarter with the patch column,
at frequencies ``theta^(-2i / (head_dim / 2))``. RMSNorms use eps 1e-6 (the text model's 1e-20
does not apply here). Module and parameter names are the official tensor names (``vision.*``,
``aligner.*``, ``image_start``/``image_newline``/``image_end``), so a state dict loads as stored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.engine.mm.inputs import ImageInputError, PreparedImage
from deepinfer.engine.models.deepseek_v41.vision_config import VisionConfig
from deepinfer.kernels import ops


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, device, dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype),
                                 requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor, batch_invariant: bool) -> torch.Tensor:
        y = ops.linear(x, self.weight, batch_invariant)
        return y if self.bias is None else y + self.bias


class _Norm(nn.Module):
    def __init__(self, dim: int, eps: float, device):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rope_2d(nh: int, nw: int, head_dim: int, theta: float, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin ``[nh * nw, 1, head_dim / 2]``: row angles then column angles, patches row-major."""
    half = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, half, 2, dtype=torch.float32, device=device) / half))
    rows = torch.arange(nh, device=device, dtype=torch.float32).repeat_interleave(nw)
    cols = torch.arange(nw, device=device, dtype=torch.float32).repeat(nh)
    angles = torch.cat([rows[:, None] * inv_freq, cols[:, None] * inv_freq], dim=-1)
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, vc: VisionConfig, device, dtype):
        super().__init__()
        self.num_heads, self.head_dim = vc.num_attention_heads, vc.head_dim
        self.wqkv = _Linear(vc.hidden_size, 3 * vc.hidden_size, True, device, dtype)
        self.wo = _Linear(vc.hidden_size, vc.hidden_size, True, device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bi: bool) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.reshape(n, self.num_heads, self.head_dim) for t in self.wqkv(x, bi).chunk(3, dim=-1))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(o.transpose(0, 1).reshape(n, -1), bi)


class _MLP(nn.Module):
    def __init__(self, vc: VisionConfig, device, dtype):
        super().__init__()
        self.w1 = _Linear(vc.hidden_size, 2 * vc.intermediate_size, False, device, dtype)
        self.w2 = _Linear(vc.intermediate_size, vc.hidden_size, False, device, dtype)

    def forward(self, x: torch.Tensor, bi: bool) -> torch.Tensor:
        gate, up = self.w1(x, bi).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up, bi)


class _Block(nn.Module):
    def __init__(self, vc: VisionConfig, device, dtype):
        super().__init__()
        self.norm1 = _Norm(vc.hidden_size, vc.norm_eps, device)
        self.attn = _Attention(vc, device, dtype)
        self.norm2 = _Norm(vc.hidden_size, vc.norm_eps, device)
        self.mlp = _MLP(vc, device, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bi: bool) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, bi)
        return x + self.mlp(self.norm2(x), bi)


class _ViT(nn.Module):
    def __init__(self, vc: VisionConfig, device, dtype):
        super().__init__()
        self.patch_embed = nn.Module()
        self.patch_embed.proj = _Linear(vc.patch_width, vc.hidden_size, True, device, dtype)
        self.blocks = nn.ModuleList([_Block(vc, device, dtype) for _ in range(vc.num_hidden_layers)])
        self.norm = _Norm(vc.hidden_size, vc.norm_eps, device)


class _Aligner(nn.Module):
    def __init__(self, vc: VisionConfig, hidden: int, device, dtype):
        super().__init__()
        self.ratio = vc.downsample_ratio
        self.w1 = _Linear(vc.cell_width, hidden, True, device, dtype)
        self.w2 = _Linear(hidden, hidden, True, device, dtype)

    def cells(self, grid: torch.Tensor) -> torch.Tensor:
        """``[nh, nw, D]`` -> ``[rows * cols, 9D]`` (3x3 pixel-unshuffle, cells row-major)."""
        r = self.ratio
        nh, nw, _ = grid.shape
        x = F.pad(grid.permute(2, 0, 1), (0, -nw % r, 0, -nh % r))
        return F.unfold(x[None], r, stride=r)[0].transpose(0, 1)

    def forward(self, grid: torch.Tensor, bi: bool) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(self.cells(grid).contiguous(), bi)), bi)


class V41VisionTower(nn.Module):
    """``encode(prepared image) -> [num_tokens, hidden]``: the embeddings of its whole prompt span."""

    def __init__(self, vc: VisionConfig, hidden_size: int, device=None, dtype=torch.float32,
                 batch_invariant: bool = True):
        super().__init__()
        self.config, self.hidden_size, self.dtype = vc, hidden_size, dtype
        self.batch_invariant = batch_invariant
        self.vision = _ViT(vc, device, dtype)
        self.aligner = _Aligner(vc, hidden_size, device, dtype)
        for name in ("image_start", "image_end", "image_newline"):
            setattr(self, name, nn.Parameter(torch.empty(hidden_size, device=device, dtype=dtype), requires_grad=False))

    @property
    def device(self) -> torch.device:
        return self.image_start.device

    @torch.inference_mode()
    def encode(self, image: PreparedImage) -> torch.Tensor:
        vc, bi = self.config, self.batch_invariant
        nh, nw = image.grid
        if image.pixels.shape != (nh * nw, vc.patch_width):
            raise ImageInputError(f"prepared pixels have shape {tuple(image.pixels.shape)}, the tower expects "
                                  f"({nh * nw}, {vc.patch_width}) for a {nh}x{nw} patch grid")
        x = self.vision.patch_embed.proj(image.pixels.to(self.device, self.dtype), bi)
        cos, sin = rope_2d(nh, nw, vc.head_dim, vc.rope_theta, self.device)
        for block in self.vision.blocks:
            x = block(x, cos, sin, bi)
        cells = self.aligner(self.vision.norm(x).reshape(nh, nw, -1), bi)
        return self._span(cells, -(-nh // vc.downsample_ratio), -(-nw // vc.downsample_ratio), image.num_tokens)

    def _span(self, cells: torch.Tensor, rows: int, cols: int, num_tokens: int) -> torch.Tensor:
        """``[START] + ([cell] * cols + [NEWLINE]) * rows + [END]`` as rows of one tensor."""
        if rows * (cols + 1) + 2 != num_tokens:
            raise ImageInputError(f"a {rows}x{cols} cell grid spans {rows * (cols + 1) + 2} tokens, the prepared "
                                  f"image says {num_tokens}")
        body = torch.cat([cells.reshape(rows, cols, -1), self.image_newline.expand(rows, 1, -1)], dim=1)
        return torch.cat([self.image_start[None], body.reshape(-1, self.hidden_size), self.image_end[None]])
