"""A plain DeepSeek-V4.1 vision tower for parity tests, written from the model's description (v41
facts, "Vision") with explicit loops where the layout matters: the 2D RoPE pairs, the 3x3 cell
order and the span layout. Reads the official tensors itself; float32. ``span(patches, nh, nw)``
-> ``[rows * (cols + 1) + 2, hidden]``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open


class PlainVision:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        self.v = json.loads((model_dir / "config.json").read_text())["vision_config"]
        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            self.w = {k: f.get_tensor(k).float() for k in f.keys()
                      if k.startswith(("vision.", "aligner.", "image_"))}

    def _rms(self, x, weight):
        return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6) * weight

    def _rope(self, x, nh, nw):
        """x [N, heads, hd]: channel d < hd/2 pairs with d + hd/2; the first quarter turns with the
        patch row, the second with the column, frequency theta^(-2i / (hd / 2))."""
        n, heads, hd = x.shape
        half, quarter = hd // 2, hd // 4
        out = x.clone()
        for p in range(n):
            row, col = divmod(p, nw)
            for d in range(half):
                i = d if d < quarter else d - quarter
                angle = (row if d < quarter else col) * self.v["rope_theta"] ** (-2 * i / half)
                a, b = x[p, :, d], x[p, :, d + half]
                out[p, :, d] = a * math.cos(angle) - b * math.sin(angle)
                out[p, :, d + half] = b * math.cos(angle) + a * math.sin(angle)
        return out

    def _vit(self, patches, nh, nw):
        w, heads = self.w, self.v["num_attention_heads"]
        x = patches.float() @ w["vision.patch_embed.proj.weight"].T + w["vision.patch_embed.proj.bias"]
        n, dim = x.shape
        hd = dim // heads
        for b in range(self.v["num_hidden_layers"]):
            p = f"vision.blocks.{b}."
            h = self._rms(x, w[p + "norm1.weight"])
            qkv = h @ w[p + "attn.wqkv.weight"].T + w[p + "attn.wqkv.bias"]
            q, k, v = (t.reshape(n, heads, hd) for t in qkv.split(dim, dim=-1))
            q, k = self._rope(q, nh, nw), self._rope(k, nh, nw)
            scores = torch.einsum("phd,qhd->hpq", q, k) / math.sqrt(hd)  # every patch sees every patch
            o = torch.einsum("hpq,qhd->phd", scores.softmax(-1), v).reshape(n, dim)
            x = x + o @ w[p + "attn.wo.weight"].T + w[p + "attn.wo.bias"]
            h = self._rms(x, w[p + "norm2.weight"])
            inter = self.v["intermediate_size"]
            gu = h @ w[p + "mlp.w1.weight"].T
            x = x + (F.silu(gu[:, :inter]) * gu[:, inter:]) @ w[p + "mlp.w2.weight"].T
        return self._rms(x, w["vision.norm.weight"])

    def span(self, patches, nh, nw):
        w, r = self.w, self.v["downsample_ratio"]
        grid = self._vit(patches, nh, nw).reshape(nh, nw, -1)
        dim = grid.shape[-1]
        rows, cols = -(-nh // r), -(-nw // r)
        cells = []
        for ci in range(rows):
            for cj in range(cols):
                vec = torch.zeros(dim, r, r)  # channel-major, then kernel row, kernel column
                for ki in range(r):
                    for kj in range(r):
                        y, x = ci * r + ki, cj * r + kj
                        if y < nh and x < nw:
                            vec[:, ki, kj] = grid[y, x]
                cells.append(vec.reshape(-1))
        cells = torch.stack(cells)
        out = F.gelu(cells @ w["aligner.w1.weight"].T + w["aligner.w1.bias"]) @ w["aligner.w2.weight"].T \
            + w["aligner.w2.bias"]
        span = [w["image_start"]]
        for ci in range(rows):
            span += [out[ci * cols + cj] for cj in range(cols)] + [w["image_newline"]]
        span.append(w["image_end"])
        return torch.stack(span)
