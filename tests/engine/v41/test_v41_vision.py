"""V4.1's vision path on the tiny checkpoint (two-layer tower, float32 CPU): preprocessing numbers,
the tower against a plain one, and images through the engine (plain-forward parity, the image's
hash in the prefix-cache keys, chunking through a span, the checks at arrival)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps

from deepinfer import SamplingParams
from deepinfer.engine.core.factory import build_engine
from deepinfer.engine.core.options import EngineOptions
from deepinfer.engine.mm.inputs import ImageInputError, MultiModalInput
from deepinfer.engine.mm.prompt import ImagePrompt
from deepinfer.engine.models.deepseek_v41.image_processor import plan_grid
from deepinfer.engine.models.deepseek_v41.vision_config import VisionConfig
from tests.conftest import load_test_helper

plain = load_test_helper("engine/v41/plain_v41")
plain_vision = load_test_helper("engine/v41/plain_vision")
pd = load_test_helper("runtime/pd_core_helpers")

OPTIONS = dict(dtype="float32", device="cpu", max_model_len=1024, block_size=16, max_num_seqs=4)
REAL = VisionConfig()


def picture(seed: int, size=(150, 110)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def parts(tiny_dir):
    return build_engine(tiny_dir, EngineOptions(**OPTIONS))


@pytest.mark.parametrize("size, grid, tokens", [
    ((1024, 768), (770, 1036), 19 * 26 + 2),  # rounded up to patches: 55 x 74 patches, 19 x 25 cells
    ((100, 100), (546, 546), 13 * 14 + 2),  # below min_pixels: scaled to 544 x 544 first
    ((4000, 3000), (1134, 1512), 27 * 37 + 2),  # over 1024 tokens: the largest 3:4 grid that fits
    ((60000, 30), (42, 42 * 1021), 1 * 1022 + 2),  # too wide for two rows: a single row of cells
])
def test_real_config_grid_plans(size, grid, tokens):
    plan = plan_grid(*size, REAL)
    assert (plan.height, plan.width) == grid
    assert plan.num_tokens == tokens <= REAL.max_image_tokens


def test_every_aspect_fits_the_token_budget():
    for w, h in [(1, 1), (14, 20000), (20000, 14), (3000, 3000), (5000, 2000), (777, 13)]:
        plan = plan_grid(w, h, REAL)
        assert 4 <= plan.num_tokens <= 1024 and plan.height % 14 == 0 and plan.width % 14 == 0


def test_patches_are_the_padded_image_channel_major(parts):
    image = picture(1, (150, 110))
    prepared = parts.vision.prepare(image)
    nh, nw = prepared.grid
    padded = np.asarray(ImageOps.pad(image, (nw * 14, nh * 14), color=(127, 127, 127)), dtype=np.float32)
    expect = torch.from_numpy((padded / 255 - 0.5) / 0.5).to(torch.bfloat16).float()  # [H, W, 3]
    i, j = 3, 5
    patch = prepared.pixels[i * nw + j].float().view(3, 14, 14)
    assert torch.equal(patch, expect[i * 14:(i + 1) * 14, j * 14:(j + 1) * 14].permute(2, 0, 1))
    assert prepared.num_tokens == math.ceil(nh / 3) * (math.ceil(nw / 3) + 1) + 2


def test_tower_matches_plain_tower(parts, tiny_dir):
    reference = plain_vision.PlainVision(tiny_dir)
    for seed, size in [(2, (150, 110)), (3, (60, 200))]:
        prepared = parts.vision.prepare(picture(seed, size))
        got = parts.vision.encode(prepared)
        want = reference.span(prepared.pixels, *prepared.grid)
        assert got.shape == want.shape == (prepared.num_tokens, 64)
        assert (got - want).abs().max().item() < 1e-4


def _run(core, rid, ids, params, mm_inputs=()):
    core.add_request(rid, ids, params, mm_inputs=mm_inputs)
    return pd.run_to_end(core)[rid]


def _image_request(parts, text_ids, images):
    prompt = ImagePrompt.build(parts.vision, text_ids, images)
    return prompt.token_ids, prompt.inputs([parts.vision.encode(p) for p in prompt.images])


def test_engine_with_an_image_matches_plain_forward(parts, tiny_dir):
    """Teacher-forced: the engine's prompt and greedy logprobs equal one plain pass with the span's
    embeddings put in (image tokens routed with bias_vl, dead for Engram), chunked through the span."""
    image_id = parts.vision.image_token_id
    text = [5, 17, 230, 41, image_id, 99, 120, 7, 300]
    ids, mm = _image_request(parts, text, [picture(4)])
    core = build_engine(tiny_dir, EngineOptions(**{**OPTIONS, "max_num_batched_tokens": 16})).core  # chunks of 16
    out = _run(core, "img", ids, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0,
                                                prompt_logprobs=0), mm)
    gen = out.outputs[0]
    seq = ids + gen.token_ids
    embeds = {mm[0].start + k: mm[0].embeds[k] for k in range(mm[0].span.length)}
    ref = torch.log_softmax(plain.PlainV41(tiny_dir).logits(seq, embeds)[:-1], -1)
    realised = ref.gather(1, torch.tensor(seq[1:])[:, None])[:, 0]
    served = [pl[t].logprob for pl, t in zip(out.prompt_logprobs[1:], ids[1:])]
    served += [lp[t].logprob for lp, t in zip(gen.logprobs, gen.token_ids)]
    assert (torch.tensor(served) - realised).abs().max().item() < 1e-3
    assert gen.token_ids == ref[len(ids) - 1:].argmax(-1).tolist()


def test_image_changes_the_output_and_salts_the_prefix_cache(parts):
    """The same text with another image never hits and answers differently; the same image twice hits."""
    core, image_id = parts.core, parts.vision.image_token_id
    text = [5, 9, image_id] + list(range(40, 80))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    ids_a, mm_a = _image_request(parts, text, [picture(10)])
    ids_b, mm_b = _image_request(parts, text, [picture(11)])
    assert ids_a == ids_b and mm_a[0].span.content_hash != mm_b[0].span.content_hash
    first = _run(core, "a1", ids_a, params, mm_a)
    again = _run(core, "a2", ids_a, params, mm_a)
    other = _run(core, "b1", ids_b, params, mm_b)
    text_only = _run(core, "t1", [t for t in text if t != image_id], params)
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == len(ids_a) // 16 * 16 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert other.num_cached_tokens == 0  # block 0 holds the image: another image shares nothing
    assert other.outputs[0].token_ids != first.outputs[0].token_ids
    assert text_only.outputs[0].token_ids != first.outputs[0].token_ids


def test_arrival_checks_are_one_line_errors(parts):
    core, vision = parts.core, parts.vision
    image_id = vision.image_token_id
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ImageInputError, match="holds the image token .* but no image"):
        core.add_request("x1", [5, image_id, 6], params)
    ids, mm = _image_request(parts, [5, image_id, 6], [picture(5)])
    with pytest.raises(ImageInputError, match="holds tokens other than the image token"):
        core.add_request("x2", [5, 6] + ids[2:], params, mm_inputs=mm)
    bad = [MultiModalInput(mm[0].span, mm[0].embeds[:, :10])]
    with pytest.raises(ImageInputError, match="embeddings have shape"):
        core.add_request("x3", ids, params, mm_inputs=bad)
    with pytest.raises(ImageInputError, match=r"1 image placeholder\(s\) .* for 2 image\(s\)"):
        ImagePrompt.build(vision, [5, image_id, 6], [picture(1), picture(2)])
    assert not core.has_unfinished_requests()


def test_make_tiny_model_writes_the_two_layer_tower(tmp_path, capsys):
    from deepinfer.bin.cli import main
    from deepinfer.engine.mm.encoder import VisionEncoder
    from deepinfer.engine.models.registry import read_model_config

    assert main(["make-tiny-model", str(tmp_path / "m"), "--arch", "deepseek_v41"]) == 0
    assert "a 2-layer vision tower" in capsys.readouterr().out
    cfg = read_model_config(tmp_path / "m")
    vision = VisionEncoder.load(tmp_path / "m", cfg, dtype=torch.float32, device="cpu")
    assert len(vision.tower.vision.blocks) == 2
    prepared = vision.prepare(picture(6))
    embeds = vision.encode(prepared)
    assert embeds.shape == (prepared.num_tokens, cfg.hidden_size) and torch.isfinite(embeds).all()
