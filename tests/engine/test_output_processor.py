from __future__ import annotations

import pytest
import torch

from deepinfer.engine.api.sampling_params import SamplingParams
from deepinfer.engine.sample.sampler import LogprobsTensors
from deepinfer.engine.text.output_processor import OutputProcessor, format_logprobs, merge_output

WORDS = {1: "<eos>", 2: "Hel", 3: "lo", 4: " wor", 5: "ld", 6: "!", 7: " ST", 8: "OP", 9: " x"}


class WordDetok:
    def __init__(self, skip_special: bool = True):
        self.skip = skip_special

    def step(self, token_id: int) -> str:
        return "" if token_id == 1 and self.skip else WORDS[token_id]


def make(params: SamplingParams, rid="r", n=1, index=0):
    op = OutputProcessor(lambda prompt, p: WordDetok(p.skip_special_tokens), decode_token=WORDS.get)
    op.add_request(rid, rid, index, n, "prompt", [9, 9], params, arrival_time=1.0)
    return op


def test_text_deltas_and_finish():
    op = make(SamplingParams(max_tokens=10))
    r1 = op.process("r", [2, 3], None, None, None, now=2.0).output
    assert (r1.outputs[0].text, r1.outputs[0].token_ids, r1.finished) == ("Hello", [2, 3], False)
    r2 = op.process("r", [4, 5, 1], None, "stop", None, now=3.0).output
    assert (r2.outputs[0].text, r2.outputs[0].token_ids, r2.finished) == (" world", [4, 5, 1], True)
    assert r2.outputs[0].finish_reason == "stop"
    assert r2.metrics.first_token_time == 2.0 and r2.metrics.finished_time == 3.0
    assert not op.has_request("r")


def test_stop_string_truncates_and_holds_back_prefix():
    op = make(SamplingParams(max_tokens=10, stop=[" STOP"]))
    r = op.process("r", [2, 3], None, None, None, now=0).output
    # " STOP" is 5 chars: the last 4 characters are held back while streaming
    assert r.outputs[0].text == "H"
    p = op.process("r", [7, 8, 4, 5], None, None, None, now=0)
    assert p.stop_string == " STOP" and p.num_kept_tokens == 2
    out = p.output.outputs[0]
    assert out.text == "ello" and out.token_ids == [7, 8]
    assert (out.finish_reason, out.stop_reason) == ("stop", " STOP")


def test_stop_string_included_and_split_across_tokens():
    op = make(SamplingParams(max_tokens=10, stop=["lo wo"], include_stop_str_in_output=True))
    acc = merge_output(None, op.process("r", [2], None, None, None, now=0).output)
    p = op.process("r", [3, 4, 5], None, None, None, now=0)
    acc = merge_output(acc, p.output)
    assert acc.outputs[0].text == "Hello wo" and p.num_kept_tokens == 2


def test_stop_strings_wait_for_min_tokens():
    op = make(SamplingParams(max_tokens=10, min_tokens=3, stop=["lo"]))
    p = op.process("r", [2, 3], None, None, None, now=0)
    assert p.stop_string is None
    p = op.process("r", [2, 3], None, None, None, now=0)
    assert p.stop_string == "lo" and p.output.outputs[0].finish_reason == "stop"


def test_stop_strings_need_a_tokenizer():
    with pytest.raises(ValueError, match="tokenizer"):
        OutputProcessor().add_request("r", "r", 0, 1, None, [1], SamplingParams(stop=["x"]), 0.0)


def _lp(rows):
    v = torch.tensor(rows, dtype=torch.float32).log_softmax(-1)
    top_lp, top_ids = v.topk(2, dim=-1)
    tok = torch.tensor([5] * len(rows))
    tok_lp = v.gather(1, tok.unsqueeze(1)).squeeze(1)
    ranks = (v > tok_lp.unsqueeze(1)).sum(-1) + 1
    return LogprobsTensors(top_ids, top_lp, tok, tok_lp, ranks)


def test_logprobs_format_and_cumulative():
    lp = _lp([[0, 1, 2, 3, 4, 5, 0, 0, 0, 0], [9, 0, 0, 0, 0, 3, 0, 0, 0, 0]])
    pos = format_logprobs(lp, range(0, 2), 1, WORDS.get)
    assert list(pos[0]) == [5] and pos[0][5].rank == 1 and pos[0][5].decoded_token == "ld"
    assert list(pos[1]) == [0, 5] and pos[1][5].rank == 2 and pos[1][0].rank == 1
    op = make(SamplingParams(max_tokens=10, logprobs=1))
    out = op.process("r", [5, 5], pos, None, None, now=0).output.outputs[0]
    assert out.logprobs == pos
    assert out.cumulative_logprob == pytest.approx(pos[0][5].logprob + pos[1][5].logprob)


def test_prompt_logprobs_sent_once_with_first_token():
    op = make(SamplingParams(max_tokens=10, prompt_logprobs=1))
    op.add_prompt_logprobs("r", _lp([[0] * 10]), range(0, 1), 1)
    assert op.process("r", [], None, None, None, now=0).output is None  # middle chunk: nothing new
    r = op.process("r", [2], None, None, None, now=0).output
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == 2
    assert op.process("r", [3], None, None, None, now=0).output.prompt_logprobs is None


def test_parallel_children_share_the_parent_and_finish_together():
    op = OutputProcessor()
    for i in range(2):
        op.add_request(f"p#{i}", "p", i, 2, None, [1], SamplingParams(max_tokens=5), 0.0)
    a = op.process("p#1", [3], None, "length", None, now=0).output
    assert a.request_id == "p" and a.outputs[0].index == 1 and not a.finished
    b = op.process("p#0", [4], None, "length", None, now=0).output
    assert b.finished
    acc = merge_output(merge_output(None, a), b)
    assert [c.token_ids for c in acc.outputs] == [[4], [3]]


def test_abort_emits_final_output():
    op = make(SamplingParams())
    op.process("r", [2], None, None, None, now=0)
    out = op.abort("r", now=5.0)
    assert out.finished and out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert op.abort("r", now=6.0) is None


def test_flush_on_finish_appends_held_back_text():
    class Holding:
        def __init__(self):
            self.pending = ""

        def step(self, token_id):
            out, self.pending = self.pending, WORDS[token_id]
            return out

        def flush(self):
            out, self.pending = self.pending, ""
            return out

    op = OutputProcessor(lambda prompt, p: Holding())
    op.add_request("r", "r", 0, 1, None, [1], SamplingParams(max_tokens=2), 0.0)
    acc = merge_output(None, op.process("r", [2], None, None, None, now=0).output)
    acc = merge_output(acc, op.process("r", [3], None, "length", None, now=0).output)
    assert acc.outputs[0].text == "Hello"
