"""`deepinfer bench model`: greedy generation tokens/s of our V4 ModelRunner next to transformers.

Same random weights in both (transformers' DeepseekV4ForCausalLM is the reference), the tiny
default shape (vocab 4096, hidden 256, 8 layers WWCHCHCH, 16 experts top-4 with 2 hash layers,
window 128, hc_mult 4; ~18M parameters). Each batch size runs B prompts of ``--prompt-len``
tokens and generates ``--new-tokens`` greedily; tokens/s = B * new_tokens / wall time of the
whole generate (prefill included), measured side by side in one process (with ``--repeats N``
both run N times interleaved and the best time of each counts, which damps noise from other
load on the machine). Our greedy tokens are checked against transformers' ``generate`` for
every sequence (``same_tokens``); where they differ, ``same_as_forward`` says whether ours match
transformers' own no-cache forward (its cached decode can drift from it on near ties).
Defaults are issue 4's peer comparison: a 256-token prompt, 64 new tokens, batch 1 and 8.
"""

from __future__ import annotations

import time

import torch
from deepinfer_bench.report import Report, base_parser

from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import CSA, HCA, SLIDING, SeqDriver, hf_reference

BENCH_SHAPE = dict(
    vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=8, head_dim=64,
    partial_rotary_factor=0.25, q_lora_rank=64, o_groups=2, o_lora_rank=64, sliding_window=128,
    layer_types=[SLIDING, SLIDING, CSA, HCA, CSA, HCA, CSA, HCA], compress_rates={CSA: 4, HCA: 128},
    mlp_layer_types=["hash_moe", "hash_moe"] + ["moe"] * 6, index_n_heads=4, index_head_dim=32,
    index_topk=64, hc_mult=4, n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=128,
    max_position_embeddings=16384,
)  # fmt: skip


def hf_generate(ref, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = ref.hf_model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
    return time.perf_counter() - t0, out[:, ids.shape[1] :].tolist()


def forward_greedy(ref, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens from transformers' full forward at every step (no cache)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            ids.append(int(ref.hf_model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def our_generate(runner, prompts: list[list[int]], new_tokens: int, blocks_per_seq: int):
    driver = SeqDriver(runner, blocks_per_seq)
    ids = list(range(len(prompts)))
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        driver.add(i, p)
    first = driver.prefill(ids, all_logits=False)
    tokens, _ = driver.greedy(ids, new_tokens, first)
    return time.perf_counter() - t0, [tokens[i] for i in ids]


def main(argv=None) -> int:
    p = base_parser("model", __doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1, help="interleaved runs of each; the best time counts")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads for both (0: leave as is)")
    p.add_argument("--no-batch-invariant", action="store_true", help="our fastest mode instead of the invariant one")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    ref = hf_reference(seed=args.seed, **BENCH_SHAPE)
    ref.hf_model.generation_config.eos_token_id = None
    num_params = sum(t.numel() for t in ref.state_dict.values())
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    blocks_per_seq = -(-(args.prompt_len + args.new_tokens) // 128)
    runner = ModelRunner(
        ref.config, ref.state_dict, num_blocks=max(sizes) * blocks_per_seq, num_slots=max(sizes),
        block_size=128, batch_invariant=not args.no_batch_invariant,
    )  # fmt: skip
    report = Report(
        f"V4 greedy generate, {num_params / 1e6:.1f}M params, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {torch.get_num_threads()} thread(s), batch_invariant={runner.batch_invariant}"
    )
    g = torch.Generator().manual_seed(args.seed + 1)
    for b in sizes:
        prompts = [torch.randint(0, ref.config.vocab_size, (args.prompt_len,), generator=g).tolist() for _ in range(b)]
        our_generate(runner, prompts[:1], 2, blocks_per_seq)  # warm-up
        hf_s = our_s = float("inf")
        for _ in range(max(1, args.repeats)):
            took, hf_tokens = hf_generate(ref, prompts, args.new_tokens)
            hf_s = min(hf_s, took)
            took, our_tokens = our_generate(runner, prompts, args.new_tokens, blocks_per_seq)
            our_s = min(our_s, took)
        hf_tps, our_tps = b * args.new_tokens / hf_s, b * args.new_tokens / our_s
        same = sum(a == h for a, h in zip(our_tokens, hf_tokens))
        forward_same = sum(
            a == h or a == forward_greedy(ref, p, len(a)) for a, h, p in zip(our_tokens, hf_tokens, prompts)
        )
        report.row(batch=b, hf_tok_s=hf_tps, ours_tok_s=our_tps, speedup=our_tps / hf_tps, same_tokens=f"{same}/{b}",
                   same_as_forward=f"{forward_same}/{b}")  # fmt: skip
        report.figure(f"b{b}_hf_tok_s", hf_tps)
        report.figure(f"b{b}_ours_tok_s", our_tps)
        report.figure(f"b{b}_speedup", our_tps / hf_tps)
        report.figure(f"b{b}_same_as_forward", forward_same / b)
    report.finish(args.json)
    return 0
