"""The offline LLM API end to end on a tiny checkpoint directory (make-tiny-model's writer)."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.api.llm import LLMError
from deepinfer.engine.models.deepseek_v4.tiny_model import write_tiny_model

PROMPT_IDS = [5, 6, 7, 8, 9, 40, 41, 300, 301, 302, 17]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_v4")
    write_tiny_model(path, seed=3, layers="WCHC")
    return path


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=512, max_num_seqs=4)


def test_greedy_and_prompt_logprobs_match_transformers_on_the_same_directory(llm, model_dir):
    from transformers import DeepseekV4ForCausalLM

    hf = DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    prompts = ["The quick brown fox jumps over the lazy dog", {"prompt_token_ids": PROMPT_IDS}]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    outs = llm.generate(prompts, params)
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            logits = hf(ids).logits[0].float()
            expected = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()
        theirs = torch.log_softmax(logits[:-1], -1).gather(1, ids[0, 1:, None])[:, 0]
        ours = torch.tensor([pl[t].logprob for pl, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])])
        assert (ours - theirs).abs().max() <= 1e-4
    assert outs[0].prompt == prompts[0] and outs[0].prompt_token_ids == llm.get_tokenizer().encode(prompts[0])


def test_logprob_shapes_follow_vllm(llm):
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=5, temperature=0.0, logprobs=3, prompt_logprobs=2))[0]
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(PROMPT_IDS)
    for token, entry in zip(PROMPT_IDS[1:], out.prompt_logprobs[1:]):
        assert token in entry and len(entry) <= 3
        assert {1, 2} <= {lp.rank for lp in entry.values()}  # the top-2 are always listed
        assert all(lp.logprob <= 0 for lp in entry.values())
    gen = out.outputs[0]
    assert len(gen.logprobs) == len(gen.token_ids) == 5 and gen.finish_reason == "length"
    for token, entry in zip(gen.token_ids, gen.logprobs):
        assert entry[token].rank == 1  # greedy picks the most likely token
        assert len(entry) == 3 and entry[token].decoded_token is not None
    assert gen.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(gen.token_ids, gen.logprobs)))
    assert gen.text == llm.get_tokenizer().decode(gen.token_ids)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=200, seed=7, ignore_eos=True)
    alone = llm.generate({"prompt_token_ids": PROMPT_IDS}, params)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [9, 8, 7]}, "another prompt of some length", {"prompt_token_ids": PROMPT_IDS[:4]}]
    together = llm.generate([others[0], {"prompt_token_ids": PROMPT_IDS}, *others[1:]], params)
    assert together[1].outputs[0].token_ids == alone
    reseeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, top_k=200, seed=8, ignore_eos=True)
    assert llm.generate({"prompt_token_ids": PROMPT_IDS}, reseeded)[0].outputs[0].token_ids != alone
    samples = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=1))[0]
    assert [o.index for o in samples.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in samples.outputs}) > 1


def test_chunked_prefill_in_the_loop_gives_the_same_outputs(model_dir, llm):
    small = LLM(model=str(model_dir), dtype="float32", device="cpu", max_model_len=512, max_num_batched_tokens=7)
    params = SamplingParams(max_tokens=6, temperature=0.0, prompt_logprobs=1, ignore_eos=True)
    prompts = [{"prompt_token_ids": PROMPT_IDS * 3}, "a short one"]
    for a, b in zip(small.generate(prompts, params), llm.generate(prompts, params)):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.prompt_logprobs == b.prompt_logprobs


def test_stop_conditions(llm):
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    base = llm.generate({"prompt_token_ids": PROMPT_IDS}, greedy)[0].outputs[0]
    assert base.finish_reason == "length" and len(base.token_ids) == 10

    stop_tok = base.token_ids[3]
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_tok]))[0].outputs[0]
    first = base.token_ids.index(stop_tok)
    assert out.token_ids == base.token_ids[: first + 1] and (out.finish_reason, out.stop_reason) == ("stop", stop_tok)

    later = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[stop_tok], min_tokens=first + 2, ignore_eos=True))[0].outputs[0]
    assert stop_tok not in later.token_ids[: first + 2]  # min_tokens bans stop tokens until then

    stop_text = base.text[len(base.text) // 2 : len(base.text) // 2 + 3]
    assert stop_text.strip()
    out = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=10, temperature=0.0, stop=[stop_text]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_text
    assert out.text == base.text[: base.text.index(stop_text)]
    keep = SamplingParams(max_tokens=10, temperature=0.0, stop=[stop_text], include_stop_str_in_output=True)
    assert llm.generate({"prompt_token_ids": PROMPT_IDS}, keep)[0].outputs[0].text.endswith(stop_text)

    saved = llm.eos_token_ids
    try:  # treat the greedy third token as EOS: generation stops there unless ignore_eos
        llm.eos_token_ids = (base.token_ids[2],)
        out = llm.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0]
        assert out.token_ids == base.token_ids[:3] and (out.finish_reason, out.stop_reason) == ("stop", None)
        assert len(llm.generate({"prompt_token_ids": PROMPT_IDS}, greedy)[0].outputs[0].token_ids) == 10
    finally:
        llm.eos_token_ids = saved


def test_skip_tokenizer_init_runs_from_token_ids(model_dir):
    bare = LLM(model=str(model_dir), dtype="float32", device="cpu", skip_tokenizer_init=True, max_model_len=256)
    out = bare.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].text == ""
    with pytest.raises(LLMError, match="tokenizer was skipped"):
        bare.generate("text", SamplingParams(max_tokens=2))
    with pytest.raises(LLMError, match="stop strings need a tokenizer"):
        bare.generate({"prompt_token_ids": PROMPT_IDS}, SamplingParams(max_tokens=2, stop=["x"]))


def test_bad_arguments_fail_with_a_message(llm, tmp_path):
    with pytest.raises(LLMError, match="outside"):
        llm.generate({"prompt_token_ids": [1, 10**6]})
    with pytest.raises(LLMError, match="max_model_len"):
        llm.generate({"prompt_token_ids": [1] * 600})
    with pytest.raises(LLMError, match="2 prompts but 1 sampling params"):
        llm.generate(["a", "b"], [SamplingParams()])
    with pytest.raises(LLMError, match="device must be"):
        LLM(model=str(tmp_path), device="tpu")
