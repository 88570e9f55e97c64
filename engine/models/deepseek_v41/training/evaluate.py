"""Held-out evaluation of the trained target: loss, expert loads and a routing trace, completions.

    heldout_lm      mean next-token NLL over the test stream's tokens 1 .. L-1 (windows of
                    ``seq_len`` at stride ``seq_len // 2``; a window scores the tokens the previous
                    one did not, so every scored token has >= seq_len / 2 of context once past the
                    start), the experts every scored token was routed to (loads per layer), and the
                    routing trace: one step per window, ``[steps, layers, experts]`` token counts
    greedy          batched greedy continuation with the cache-free forward (right padding is
                    safe: every position only reads earlier ones)
    parse_rate      completions of held-out function headers, prompted as written in the file
                    (``def name(args):`` and its newline) and without the newline (where a user
                    stops typing): the function is the header line (as completed) plus the lines
                    after it up to the first non-empty one back at column 0, or to EOS; a last line
                    cut off by the token limit is dropped. It parses with ``ast`` and has a body
"""

from __future__ import annotations

import ast
import math

import numpy as np
import torch

from deepinfer.engine.models.deepseek_v41.dense_forward import dense_forward, logits

# with and without the newline a user may or may not type (the tokenizer keeps a newline apart
# from the next line's indentation, so both end on a token boundary seen in training)
SAMPLE_PROMPTS = ("def fibonacci(n):\n", "def fibonacci(n):", "class Stack:\n", "import os\n\n\ndef ",
                  'def is_prime(n):\n    """Return True if n is a prime number."""\n')
PROMPT_FORMS = {"as_written": "", "no_newline": "\n"}  # form -> what is cut off the header's end


@torch.no_grad()
def heldout_lm(model, stream: np.ndarray, seq_len: int, batch: int) -> dict:
    device = model.embed_tokens.weight.device
    c = model.config
    x = torch.from_numpy(stream.astype(np.int64))
    stride = seq_len // 2
    last = max(0, len(x) - 1 - seq_len)  # the last full window ends at the last token
    starts = sorted(set(range(0, last, stride)) | {last})
    total_nll, scored = 0.0, 0
    loads = torch.zeros(c.num_hidden_layers, c.n_routed_experts, dtype=torch.float64)
    trace = []
    covered = 0  # targets with index <= covered are scored already
    for lo in range(0, len(starts), batch):
        group = starts[lo : lo + batch]
        n = min(seq_len, len(x) - 1 - group[-1])
        ids = torch.stack([x[s : s + n + 1] for s in group]).to(device)
        out = dense_forward(model, ids[:, :-1])
        logp = torch.log_softmax(logits(model, out.hidden), dim=-1)
        nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]  # [b, n]: target index s + 1 + j
        keep = torch.zeros_like(nll, dtype=torch.bool)
        for i, s in enumerate(group):
            first = max(0, covered - s)  # j with s + 1 + j > covered
            keep[i, first:] = True
            covered = s + n
        total_nll += float(nll[keep].sum())
        scored += int(keep.sum())
        for layer, ids_l in enumerate(out.expert_ids):
            per_tok = ids_l.view(len(group), n, -1)
            counts = torch.nn.functional.one_hot(per_tok, c.n_routed_experts).sum(2)  # [b, n, E]
            loads[layer] += counts[keep].sum(0).double().cpu()
            trace.append(counts.sum(1).float().cpu())  # one step per window
    steps = _trace(trace, c.num_hidden_layers)
    mean_nll = total_nll / max(scored, 1)
    skew = (loads.max(-1).values / loads.mean(-1)).tolist()
    return {"nll": mean_nll, "ppl": math.exp(mean_nll), "tokens": scored, "loads": loads.tolist(),
            "max_over_mean": skew, "min_over_mean": (loads.min(-1).values / loads.mean(-1)).tolist(),
            "trace": steps.numpy()}


def _trace(chunks: list[torch.Tensor], num_layers: int) -> torch.Tensor:
    """Per-batch, per-layer window counts -> ``[windows, layers, E]``."""
    out = []
    for i in range(0, len(chunks), num_layers):
        out.append(torch.stack(chunks[i : i + num_layers], dim=1))  # [b, layers, E]
    return torch.cat(out)


@torch.no_grad()
def greedy(model, prompts: list[list[int]], max_new: int, stop_ids: tuple[int, ...] = ()) -> list[list[int]]:
    """Greedy continuations (up to ``max_new`` tokens, ending at a stop id, which is kept)."""
    device = model.embed_tokens.weight.device
    seqs = [list(p) for p in prompts]
    new: list[list[int]] = [[] for _ in prompts]
    done = [False] * len(prompts)
    for _ in range(max_new):
        live = [i for i, d in enumerate(done) if not d]
        if not live:
            break
        width = max(len(seqs[i]) for i in live)
        ids = torch.zeros(len(live), width, dtype=torch.long)
        for row, i in enumerate(live):
            ids[row, : len(seqs[i])] = torch.tensor(seqs[i])
        hidden = dense_forward(model, ids.to(device)).hidden
        last = torch.tensor([len(seqs[i]) - 1 for i in live], device=device)
        picked = logits(model, hidden[torch.arange(len(live), device=device), last]).argmax(-1).tolist()
        for i, tok in zip(live, picked):
            seqs[i].append(tok)
            new[i].append(tok)
            done[i] = tok in stop_ids
    return new


def function_source(prompt: str, completion: str, cut_off: bool) -> str:
    """The header line (the prompt's first line as completed) and the lines after it up to the
    first non-empty line back at column 0; with ``cut_off`` (the token limit hit, no EOS) the last
    line, which may be partial, is dropped unless a column-0 line ended the function first."""
    lines = (prompt + completion).split("\n")
    kept = lines[:1]
    for line in lines[1:]:
        if line.strip() and not line[:1].isspace():
            return "\n".join(kept) + "\n"
        kept.append(line)
    if cut_off and len(kept) > 1:
        kept = kept[:-1]
    return "\n".join(kept) + "\n"


def parses(source: str) -> bool:
    """``source`` is one function definition with a non-empty body, valid Python."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return len(tree.body) == 1 and isinstance(tree.body[0], (ast.FunctionDef, ast.AsyncFunctionDef))


def parse_rate(generate, tokenizer, headers: list[dict], max_new: int, stop_ids: tuple[int, ...]) -> dict:
    """``generate(prompts, max_new, stop_ids)`` -> new tokens of each prompt (``greedy`` or the
    engine); the rate of each prompt form (PROMPT_FORMS), the first form's being ``rate``."""
    report: dict = {}
    for form, cut in PROMPT_FORMS.items():
        prompts = [h["header"][: len(h["header"]) - len(cut)] if cut and h["header"].endswith(cut) else h["header"]
                   for h in headers]
        outs = generate([tokenizer.encode(p).ids for p in prompts], max_new, stop_ids)
        results = []
        for h, prompt, toks in zip(headers, prompts, outs):
            stopped = bool(toks) and toks[-1] in stop_ids
            text = tokenizer.decode(toks[:-1] if stopped else toks)
            ok = parses(function_source(prompt, text, cut_off=not stopped))
            results.append({"file": h["file"], "prompt": prompt, "completion": text, "eos": stopped, "parses": ok})
        report[form] = {"rate": sum(r["parses"] for r in results) / max(len(results), 1), "num": len(results),
                        "results": results}
    first = report[next(iter(PROMPT_FORMS))]
    return {"rate": first["rate"], "num": first["num"], "max_new_tokens": max_new,
            "rates": {form: r["rate"] for form, r in report.items()}, "forms": report}


def samples(generate, tokenizer, max_new: int, stop_ids: tuple[int, ...]) -> list[dict]:
    outs = generate([tokenizer.encode(p).ids for p in SAMPLE_PROMPTS], max_new, stop_ids)
    return [{"prompt": p, "completion": tokenizer.decode([t for t in toks if t not in stop_ids])}
            for p, toks in zip(SAMPLE_PROMPTS, outs)]
