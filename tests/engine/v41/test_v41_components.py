"""V4.1 parts on their own: Engram vocabulary and hashing, the candidate pool, numerics grids, names."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.engine.models.deepseek_v41 import checkpoint_names as names
from deepinfer.engine.models.deepseek_v41.attention import candidate_pool
from deepinfer.engine.models.deepseek_v41.config import V41Config
from deepinfer.engine.models.deepseek_v41.engram import (
    compressed_token_map,
    digits_to_ids,
    hash_multipliers,
    hash_primes,
    ids_to_digits,
)
from deepinfer.engine.models.deepseek_v41.numerics import e2m1_round, fp4_qdq, fp8_qdq


def test_compressed_vocabulary_collapses_normalisation_variants():
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"the": 0, "The": 1, "THE": 2, " the": 3, "café": 4, "cafe": 5, "x": 6, "  ": 7, " ": 8, "ﬁ": 9, "fi": 10}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="x"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    lookup, size = compressed_token_map(tok, 12)
    assert lookup[0] == lookup[1] == lookup[2] == lookup[3]  # case and surrounding space
    assert lookup[4] == lookup[5]  # accents stripped
    assert lookup[9] == lookup[10]  # NFKC ligature
    assert lookup[7] == lookup[8] != lookup[0]  # whitespace runs collapse to one kept space
    assert size == len(set(lookup[:11])) == 5


def test_hash_layout_of_the_released_config():
    primes = hash_primes(2, 4, 8, 16_000_000)
    assert [sum(p) for p in primes] == [384006168, 384016682]  # engram_num_embeddings of V4.1-Flash
    flat = [p for layer in primes for p in layer]
    assert len(set(flat)) == 48 and all(p > 16_000_000 for p in flat) and primes[0][0] == 16_000_057
    m = hash_multipliers((1, 14), 4, 99092)
    assert m.dtype == np.int64 and (m % 2 == 1).all() and int(m.max()) * 99092 < np.iinfo(np.int64).max


def test_history_digits_round_trip_exactly_in_bfloat16():
    ids = torch.tensor([-1, 0, 1, 255, 256, 99091, 129279, 16_777_214])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(digits_to_ids(ids_to_digits(ids, dtype)), ids)


def _pool_by_hand(score, n, top_blocks, block):
    """Brute force: newest reachable block plus the best other reachable blocks by their max."""
    nb = -(-n // block)
    best = sorted(range(nb - 1), key=lambda b: -float(score[b * block : (b + 1) * block].max()))[: top_blocks - 1]
    keep = torch.zeros(len(score), dtype=torch.bool)
    for b in [nb - 1, *best] if n else []:
        keep[b * block : min((b + 1) * block, n)] = True
    return keep


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 24, 33, 61])
def test_candidate_pool_matches_brute_force(n):
    g = torch.Generator().manual_seed(n)
    width = 64
    total = torch.randn(3, width, generator=g)
    valid = torch.arange(width)[None, :].expand(3, -1) < n
    total = total.masked_fill(~valid, float("-inf"))
    got = candidate_pool(total, valid, top_blocks=3, block_size=8)
    for row in range(3):
        want = _pool_by_hand(total[row], n, 3, 8)
        assert torch.equal(got[row] & valid[row], want), (n, row)
        assert not (got[row] & ~valid[row]).any() or n % 8  # only the newest block's unreached tail
    if n > 3 * 8:
        assert got[0].sum() < n  # the pool bites


def test_numerics_grids():
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0)) * 3
    q = fp8_qdq(x)
    again = fp8_qdq(q)
    assert torch.equal(q, again) and (q - x).abs().max() < x.abs().max() / 8  # idempotent, 3-bit mantissa
    assert torch.equal(e2m1_round(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, 7.0])),
                       torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, 6.0]))
    grid = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])
    for block, e4m3 in ((16, True), (32, False)):
        q4 = fp4_qdq(x, block, e4m3)
        assert torch.equal(fp4_qdq(q4, block, e4m3), q4)
        amax = x.view(4, -1, block).abs().amax(-1, keepdim=True)
        if e4m3:
            scale = (amax / 6).to(torch.float8_e4m3fn).float()
        else:
            scale = torch.exp2(torch.ceil(torch.log2(amax / 6)))
        ratio = (q4.view(4, -1, block) / scale).abs()
        assert torch.isin(ratio, grid).all()  # every value is an e2m1 value times its group's scale
        assert ((q4 - x).abs() <= scale.repeat_interleave(block, -1).view(4, -1)).all()  # within one grid step


def test_official_names_map_both_ways():
    for official, canonical in [
        ("layers.3.attn.wq_a.weight", "layers.3.self_attn.q_a_proj.weight"),
        ("layers.20.attn.indexer.wk.weight", "layers.20.self_attn.indexer.k_proj.weight"),
        ("layers.14.engram.embed.weight", "layers.14.engram.embed"),
        ("layers.2.attn.compressor.wgate.weight", "layers.2.self_attn.compressor.gate_proj.weight"),
        ("mtp.1.hc_ffn_base", "mtp.1.ffn_hc.base"),
        ("mtp.0.main_proj.weight", "mtp.0.main_proj.weight"),
        ("head.weight", "lm_head.weight"),
    ]:
        assert names.to_canonical(official) == canonical
        assert names.to_official(canonical) == official
    expert = names.to_canonical("mtp.1.ffn.experts.3.w2.weight")
    assert (expert.target, expert.expert, expert.part) == ("mtp.1.mlp.experts.down_proj", 3, "down")
    assert names.to_canonical("layers.5.ffn.gate.bias_vl") == "layers.5.mlp.gate.bias_vl"  # the text model's
    assert names.to_official("layers.5.mlp.gate.bias_vl") == "layers.5.ffn.gate.bias_vl"
    assert names.is_vision("aligner.w1.bias") and names.is_vision("image_newline")
    assert names.is_vision("mtp.1.ffn.gate.bias_vl")  # drafts are text: recognised, unused
    assert not names.is_vision("layers.5.ffn.gate.bias_vl", V41Config()) and names.is_vision("layers.5.ffn.gate.bias_vl")
    assert not names.is_vision("layers.5.ffn.gate.bias")
