"""A plain, cache-free DeepSeek-V4.1 forward over one whole sequence, for parity tests.

Written from the model's public description (v41 facts), independent of the serving path: it
reads the official checkpoint itself (official tensor names, FP8/FP4 dequantised with the
project's dequant functions), builds the Engram vocabulary and hashes with its own loops, and
computes every position in one pass with explicit per-token loops where that is clearer.
float32 throughout. ``logits(ids)`` -> ``[T, vocab]``; ``logits(ids, embeds={position: vector})``
puts image embeddings at those positions (positions holding the image token are image-span
tokens: they route with ``gate.bias_vl`` and are dead for Engram, their gate 0).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import safe_open

from deepinfer.engine.loader.dequant import dequant_fp4, dequant_fp8, scale_to_float


def _rms(x, w, eps):
    x = x.float()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


def _rope(x, pos, inv_freq, inverse=False):
    """Rotate adjacent pairs of the trailing len(2*inv_freq) dims of x [T, ..., D] at positions pos [T]."""
    rd = 2 * inv_freq.numel()
    ang = pos.double()[:, None] * inv_freq.double()[None, :]
    if inverse:
        ang = -ang
    cos, sin = ang.cos(), ang.sin()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
    cos, sin = cos.view(shape).float(), sin.view(shape).float()
    out = x.clone()
    a, b = x[..., -rd::2], x[..., -rd + 1 :: 2]
    out[..., -rd::2] = a * cos - b * sin
    out[..., -rd + 1 :: 2] = b * cos + a * sin
    return out


def _inv_freq(dim, theta, yarn):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None:
        return freqs
    orig, factor, fast, slow = yarn

    def corr(n):
        return dim * math.log(orig / (n * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(0, 1)
    return freqs / factor * ramp + freqs * (1 - ramp)


def _is_prime(n):
    if n < 2:
        return False
    i = 2
    while i * i <= n:
        if n % i == 0:
            return False
        i += 1
    return True


class PlainV41:
    def __init__(self, model_dir: str | Path):
        model_dir = Path(model_dir)
        raw = json.loads((model_dir / "config.json").read_text())
        self.c = c = raw["text_config"]
        block = tuple((raw.get("quantization_config") or {}).get("weight_block_size", (32, 32)))
        self.w = {}
        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            for k in keys:
                if k.endswith(".scale") and k[:-5] + "weight" in keys:
                    continue
                t = f.get_tensor(k)
                sk = k[:-6] + "scale" if k.endswith(".weight") else None
                if sk in keys and k.endswith("engram.embed.weight"):
                    s = scale_to_float(f.get_tensor(sk))
                    t = (t.float().view(t.shape[0], -1, 32) * s[:, :, None]).view(t.shape[0], -1)
                elif sk in keys and t.dtype in (torch.int8, torch.uint8):
                    t = dequant_fp4(t, f.get_tensor(sk), torch.float32)
                elif sk in keys:
                    t = dequant_fp8(t, f.get_tensor(sk), block, torch.float32)
                self.w[k] = t.float()
        self.layers = c["num_hidden_layers"]
        self.image_token_id = raw.get("image_token_id") if raw.get("vision_config") is not None else None
        self.ratios = c["compress_ratios"][: self.layers]
        self.eps = c["rms_norm_eps"]
        rd = c["qk_rope_head_dim"]
        rs = c.get("rope_scaling")
        yarn = None if rs is None else (rs["original_max_position_embeddings"], rs["factor"], rs["beta_fast"], rs["beta_slow"])
        self.freq_main = _inv_freq(rd, c["rope_theta"], None)
        self.freq_comp = _inv_freq(rd, c["compress_rope_theta"], yarn)
        self._engram_setup(model_dir)

    # ---- Engram ---------------------------------------------------------------------------
    def _engram_setup(self, model_dir):
        c = self.c
        self.engram_layers = list(c.get("engram_layer_ids") or [])
        if not self.engram_layers:
            return
        from tokenizers import Regex, Tokenizer, normalizers

        tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        norm = normalizers.Sequence([
            normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), "\ue000"),
            normalizers.Strip(), normalizers.Replace("\ue000", " "),
        ])
        keys, cmap = {}, []
        n_tok = tok.get_vocab_size(with_added_tokens=True)
        for i in range(n_tok):
            text = tok.decode([i], skip_special_tokens=False)
            key = tok.id_to_token(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
            if key not in keys:
                keys[key] = len(keys)
            cmap.append(keys[key])
        assert len(keys) == c["engram_compressed_vocab_size"]
        pad = cmap[c["engram_pad_token_id"]]
        self.cmap = cmap + [pad] * (c["vocab_size"] - n_tok)
        self.pad = pad
        n, heads, start = c["engram_max_ngram_size"], c["engram_n_heads"], c["engram_vocab_size"]
        used, self.primes = set(), []
        for _ in self.engram_layers:
            cols = []
            for _ in range(n - 1):
                p = start - 1
                for _ in range(heads):
                    p += 1
                    while not _is_prime(p) or p in used:
                        p += 1
                    used.add(p)
                    cols.append(p)
            self.primes.append(cols)
        bound = max(1, (np.iinfo(np.int64).max // len(keys)) // 2)
        self.mult = [[int(v) * 2 + 1 for v in np.random.default_rng(10007 * lid).integers(0, bound, size=(n,), dtype=np.int64)]
                     for lid in self.engram_layers]

    def _engram_rows(self, ids, li):
        n = self.c["engram_max_ngram_size"]
        primes, mult = self.primes[li], self.mult[li]
        offsets = np.cumsum([0] + primes[:-1])
        heads = self.c["engram_n_heads"]
        out = []
        for p in range(len(ids)):
            toks, blocked = [], False
            for s in range(n):  # history before the sequence or at an image token: the pad, from there on
                blocked = blocked or p - s < 0 or ids[p - s] == self.image_token_id
                toks.append(self.pad if blocked else self.cmap[ids[p - s]])
            rolling = toks[0] * mult[0]
            row = []
            for order in range(1, n):
                rolling ^= toks[order] * mult[order]
                for h in range(heads):
                    col = (order - 1) * heads + h
                    row.append(rolling % primes[col] + int(offsets[col]))
            out.append(row)
        return torch.tensor(out)

    def _engram(self, R, ids, layer):
        c, w, d, hc = self.c, self.w, self.c["hidden_size"], self.c["hc_mult"]
        li = self.engram_layers.index(layer)
        p = f"layers.{layer}.engram."
        rows = self._engram_rows(ids, li)
        e = w[p + "embed.weight"][rows].reshape(len(ids), -1)
        kv = e @ w[p + "wkv.weight"].T
        key, value = kv[:, : hc * d].view(-1, hc, d), kv[:, hc * d :]
        wt = w[p + "q_weight"] * w[p + "k_weight"]
        rstd = torch.rsqrt(R.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (R * wt * key).sum(-1) * rstd / math.sqrt(d)
        gate = torch.sigmoid(torch.sign(dot) * dot.abs().clamp_min(1e-6).sqrt())
        image = torch.tensor([t == self.image_token_id for t in ids])
        gate = torch.where(image[:, None], 0.0, gate)
        return R + gate[..., None] * value[:, None, :]

    # ---- mHC ------------------------------------------------------------------------------
    def _mixes(self, R, prefix):
        hc, w = self.c["hc_mult"], self.w
        flat = R.reshape(R.shape[0], -1)
        m = (flat @ w[prefix + "_fn"].T) * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.eps)
        s, b = w[prefix + "_scale"], w[prefix + "_base"]
        pre = torch.sigmoid(m[:, :hc] * s[0] + b[:hc]) + self.c["hc_eps"]
        post = 2 * torch.sigmoid(m[:, hc : 2 * hc] * s[1] + b[hc : 2 * hc])
        comb = torch.softmax((m[:, 2 * hc :] * s[2] + b[2 * hc :]).view(-1, hc, hc), -1) + self.c["hc_eps"]
        e = self.c["hc_eps"]
        comb = comb / (comb.sum(-2, keepdim=True) + e)
        for _ in range(self.c["hc_sinkhorn_iters"] - 1):
            comb = comb / (comb.sum(-1, keepdim=True) + e)
            comb = comb / (comb.sum(-2, keepdim=True) + e)
        return pre, post, comb

    # ---- attention ------------------------------------------------------------------------
    def _attention(self, x, layer, pos, state):
        c, w = self.c, self.w
        p = f"layers.{layer}.attn."
        T, nh, hd, rd = x.shape[0], c["num_attention_heads"], c["head_dim"], c["qk_rope_head_dim"]
        r = self.ratios[layer]
        freq = self.freq_comp if r else self.freq_main
        qr = _rms(x @ w[p + "wq_a.weight"].T, w[p + "q_norm.weight"], self.eps)
        q = _rope((qr @ w[p + "wq_b.weight"].T).view(T, nh, hd), pos, freq)
        kv = _rope(_rms(x @ w[p + "wkv.weight"].T, w[p + "kv_norm.weight"], self.eps), pos, freq)
        W = c["sliding_window"]
        selected = [[] for _ in range(T)]  # compressed rows attended per query
        comp_rows = None
        if r:
            kv_src = max(s for s in c["kv_source_layer_ids"] if s <= layer)
            ix_src = max(s for s in c["index_source_layer_ids"] if s <= layer)
            if layer == kv_src:
                self._compress(x, layer, r, state)
            comp_rows = state[("rows", kv_src)]
            if layer == ix_src:
                state[("picks", layer)] = self._index(x, qr, layer, r, pos, state[("keys", kv_src)], state)
            selected = state[("picks", ix_src)]
        out = torch.zeros(T, nh, hd)
        sink = w[p + "attn_sink"]
        for t in range(T):
            keys = kv[max(0, t - W + 1) : t + 1]
            if selected[t]:
                keys = torch.cat([keys, comp_rows[selected[t]]])
            logits = (q[t] @ keys.T) / math.sqrt(hd)  # [nh, K]
            logits = torch.cat([logits, sink[:, None]], dim=1)
            probs = torch.softmax(logits, -1)[:, :-1]
            out[t] = probs @ keys
        out = _rope(out, pos, freq, inverse=True)
        g = c["o_groups"]
        wo_a = w[p + "wo_a.weight"].view(g, c["o_lora_rank"], -1)
        mixed = torch.einsum("tgd,grd->tgr", out.view(T, g, -1), wo_a).reshape(T, -1)
        return mixed @ w[p + "wo_b.weight"].T

    def _compress(self, x, layer, r, state):
        w, p = self.w, f"layers.{layer}.attn."
        kv = x @ w[p + "compressor.wkv.weight"].T
        n = x.shape[0] // r
        if r == 1:
            latent = kv
        else:
            score = x @ w[p + "compressor.wgate.weight"].T
            latent = torch.stack([(kv[g * r : (g + 1) * r] * torch.softmax(score[g * r : (g + 1) * r], 0)).sum(0)
                                  for g in range(n)]) if n else kv[:0]
        latent = _rms(latent, w[p + "compressor.norm.weight"], self.eps)
        first = torch.arange(n) * r
        state[("rows", layer)] = _rope(latent, first, self.freq_comp)
        k = _rms(latent @ w[p + "indexer.wk.weight"].T, w[p + "indexer.k_norm.weight"], self.eps)
        state[("keys", layer)] = _rope(k, first, self.freq_comp)

    def _index(self, x, qr, layer, r, pos, keys, state):
        c, w, p = self.c, self.w, f"layers.{layer}.attn.indexer."
        H, D = c["index_n_heads"], c["index_head_dim"]
        q = _rope((qr @ w[p + "wq_b.weight"].T).view(-1, H, D), pos, self.freq_comp)
        hw = (x @ w[p + "weights_proj.weight"].T) / math.sqrt(D) / math.sqrt(H)
        cand_src = c.get("candidate_source_layer_id", -1)
        K, B = c.get("candidate_topk_blocks", 0), c.get("candidate_block_size", 0)
        picks, pools = [], []
        for t in range(x.shape[0]):
            n = (t + 1) // r
            if n == 0:
                picks.append([])
                pools.append(None)
                continue
            score = (torch.relu(q[t] @ keys[:n].T) * hw[t][:, None]).sum(0)  # [n]
            if 0 <= cand_src < layer:
                score = torch.where(state[("pool", cand_src)][t][:n], score, torch.tensor(float("-inf")))
            if layer == cand_src:
                nb = -(-n // B)
                block_best = [score[b * B : (b + 1) * B].max() for b in range(nb)]
                order = sorted(range(nb - 1), key=lambda b: -float(block_best[b]))[: K - 1]
                keep = torch.zeros(n, dtype=torch.bool)
                for b in [nb - 1, *order]:
                    keep[b * B : (b + 1) * B] = True
                pools.append(keep)
            k = min(c["index_topk"], n)
            picks.append(sorted(torch.topk(score, k).indices.tolist()))
        if layer == cand_src:
            state[("pool", layer)] = pools
        return picks

    # ---- MoE ------------------------------------------------------------------------------
    def _moe(self, x, prefix, ids):
        c, w = self.c, self.w
        p = prefix + "ffn."
        lim = c["swiglu_limit"]
        scores = torch.sqrt(F.softplus(x @ w[p + "gate.weight"].T))
        k = c["num_experts_per_tok"]
        bias = w[p + "gate.bias"].expand(len(ids), -1)
        if self.image_token_id is not None:
            image = torch.tensor([t == self.image_token_id for t in ids])
            bias = torch.where(image[:, None], w[p + "gate.bias_vl"], bias)
        idx = torch.topk(scores + bias, k, dim=-1).indices
        weights = scores.gather(1, idx)
        weights = weights / weights.sum(-1, keepdim=True) * c["routed_scaling_factor"]

        def expert(e, v):
            gate = (v @ w[e + "w1.weight"].T).clamp(max=lim)
            up = (v @ w[e + "w3.weight"].T).clamp(-lim, lim)
            return (F.silu(gate) * up) @ w[e + "w2.weight"].T

        y = expert(p + "shared_experts.", x)
        every = torch.stack([expert(f"{p}experts.{e}.", x) for e in range(w[p + "gate.weight"].shape[0])])  # [E, T, D]
        for j in range(k):
            y = y + weights[:, j : j + 1] * every[idx[:, j], torch.arange(x.shape[0])]
        return y

    # ---- whole forward ----------------------------------------------------------------------
    @torch.no_grad()
    def logits(self, ids: list[int], embeds: dict[int, torch.Tensor] | None = None) -> torch.Tensor:
        c, w = self.c, self.w
        hc = c["hc_mult"]
        T = len(ids)
        pos = torch.arange(T)
        x0 = w["embed.weight"][torch.tensor(ids)].clone()
        for position, vector in (embeds or {}).items():
            x0[position] = vector.float()
        R = x0[:, None, :].repeat(1, hc, 1)
        pre = torch.zeros(T, hc)
        pre[:, 0] = 1
        state = {}
        for layer in range(self.layers):
            p = f"layers.{layer}."
            if layer in self.engram_layers:
                R = self._engram(R, ids, layer)
            attn_pre, post, comb = self._mixes(R, p + "hc_attn")
            x = _rms((pre[:, :, None] * R).sum(1), w[p + "attn_norm.weight"], self.eps)
            out = self._attention(x, layer, pos, state)
            R = post[:, :, None] * out[:, None, :] + torch.einsum("tij,tid->tjd", comb, R)
            ffn_pre, post, comb = self._mixes(R, p + "hc_ffn")
            x = _rms((attn_pre[:, :, None] * R).sum(1), w[p + "ffn_norm.weight"], self.eps)
            out = self._moe(x, p, ids)
            R = post[:, :, None] * out[:, None, :] + torch.einsum("tij,tid->tjd", comb, R)
            pre = ffn_pre
        h = _rms((pre[:, :, None] * R).sum(1), w["norm.weight"], self.eps)
        return h @ w["head.weight"].T
