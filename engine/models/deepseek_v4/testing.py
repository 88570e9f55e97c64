"""Reference-model helpers for parity tests and benchmarks (needs ``transformers``, a test extra).

``hf_reference(...)`` builds a transformers ``DeepseekV4ForCausalLM`` with weights that exercise
every path (non-zero sinks, position biases, router correction biases, a random hash table,
O(1) activations) and the matching ``ModelConfig`` + canonical state dict for our runner.
``SeqDriver`` runs sequences through a ``ModelRunner`` with naive slot/block bookkeeping.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import torch

from deepinfer.engine.core.batch import ForwardBatch, SeqStep
from deepinfer.engine.models.deepseek_v4.config import ModelConfig

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"

TINY_DEFAULTS = dict(
    vocab_size=512, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
    head_dim=32, q_lora_rank=32, partial_rotary_factor=0.25, n_routed_experts=8, num_experts_per_tok=2,
    sliding_window=16, o_groups=2, o_lora_rank=16, index_n_heads=16, index_head_dim=16, index_topk=4,
    hc_mult=2, layer_types=[SLIDING, CSA, HCA, CSA],
    compress_rates={CSA: 4, HCA: 16}, mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    max_position_embeddings=4096,
)  # fmt: skip

# the four parity configs of tests/engine/test_v4_parity.py (CPU) and test_v4_device.py (CUDA)
PARITY_CONFIGS = {
    "mixed_hc2": dict(layer_types=[SLIDING, CSA, HCA, CSA], hc_mult=2),
    "hc4_yarn_2hash": dict(
        layer_types=[CSA, HCA, CSA, HCA, SLIDING],
        mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe"],
        hc_mult=4,
        index_topk=8,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    ),
    "hc1_hca8_window8": dict(
        layer_types=[SLIDING, HCA, SLIDING, HCA],
        compress_rates={CSA: 4, HCA: 8},
        sliding_window=8,
        hc_mult=1,
    ),
    "hc3_csa2_wide": dict(
        layer_types=[CSA, SLIDING, CSA],
        compress_rates={CSA: 2, HCA: 16},
        sliding_window=12,
        hc_mult=3,
        num_attention_heads=8,
        o_groups=4,
        n_routed_experts=16,
        num_experts_per_tok=4,
        index_topk=6,
    ),
}
PARITY_PROMPT_LENGTHS = {"mixed_hc2": 300, "hc4_yarn_2hash": 260, "hc1_hca8_window8": 400, "hc3_csa2_wide": 220}


def random_overrides(rng: random.Random) -> dict:
    """A tiny ``hf_config`` override set drawn from ``rng``: every size a multiple of 4 (the
    grouped matmuls of transformers' experts need it) but otherwise off the native kernels'
    8/16 granules, o_lora_rank / o_groups / heads / head and rope dims / experts / routing /
    layer kinds (window-only, CSA 4, HCA 128 or less) / hash layers / window / hc_mult varied.
    At least 12 indexer heads: with fewer, many index scores are exactly 0 after the ReLU and the
    top-k order of ties is implementation-defined."""
    num_layers = rng.randint(1, 4)
    heads = rng.choice((1, 2, 3, 4, 6, 8))
    head_dim = rng.choice((8, 12, 16, 20, 24, 32))
    rope_dim = rng.choice([r for r in (4, 8) if r <= head_dim])
    o_groups = rng.choice([g for g in (1, 2, 3, 4) if heads % g == 0])
    experts = rng.randint(2, 12)
    ratio_hca = rng.choice((8, 16, 128))
    num_hash = rng.randint(0, num_layers)
    yarn = rng.choice((None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}))
    return dict(
        vocab_size=rng.randrange(384, 641, 4),
        hidden_size=rng.randrange(12, 65, 4),
        moe_intermediate_size=rng.randrange(4, 41, 4),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        head_dim=head_dim,
        partial_rotary_factor=rope_dim / head_dim,  # for these sizes int(head_dim * factor) == rope_dim
        q_lora_rank=rng.randrange(4, 49, 4),
        o_groups=o_groups,
        o_lora_rank=rng.randrange(4, 41, 4),
        n_routed_experts=experts,
        num_experts_per_tok=rng.randint(1, min(4, experts)),
        scoring_func=rng.choice(("sqrtsoftplus", "sigmoid")),
        routed_scaling_factor=rng.choice((1.0, 1.5, 2.5)),
        swiglu_limit=rng.choice((1.0, 10.0)),
        sliding_window=rng.choice((4, 8, 12, 16, 20)),
        index_n_heads=rng.choice((12, 16, 20)),
        index_head_dim=rng.choice([d for d in (8, 12, 16, 20) if d >= rope_dim]),
        index_topk=rng.randint(1, 8),
        hc_mult=rng.randint(1, 4),
        layer_types=[rng.choice((SLIDING, CSA, HCA)) for _ in range(num_layers)],
        compress_rates={CSA: 4, HCA: ratio_hca},
        mlp_layer_types=["hash_moe"] * num_hash + ["moe"] * (num_layers - num_hash),
        rope_parameters=yarn,
    )


def hf_config(**overrides):
    from transformers import DeepseekV4Config

    kwargs = {**TINY_DEFAULTS, **overrides}
    if "layer_types" in overrides and "num_hidden_layers" not in overrides:
        kwargs["num_hidden_layers"] = len(kwargs["layer_types"])
    if len(kwargs["mlp_layer_types"]) != kwargs["num_hidden_layers"]:
        kwargs["mlp_layer_types"] = ["hash_moe"] + ["moe"] * (kwargs["num_hidden_layers"] - 1)
    return DeepseekV4Config(**kwargs)


def randomize_(model, seed: int) -> None:
    """Fill every tensor of an HF V4 model with values that keep all paths non-trivial."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config

    def randn(shape):
        return torch.randn(shape, generator=g)

    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("tid2eid"):
                perms = [torch.randperm(cfg.n_routed_experts, generator=g)[: cfg.num_experts_per_tok] for _ in range(t.shape[0])]
                t.copy_(torch.stack(perms))
            elif name.endswith(("norm.weight", "layernorm.weight")):
                t.copy_(1 + 0.1 * randn(t.shape))
            elif name.endswith("sinks"):
                t.copy_(randn(t.shape))
            elif name.endswith("position_bias"):
                t.copy_(0.5 * randn(t.shape))
            elif name.endswith("e_score_correction_bias"):
                t.copy_(0.2 * randn(t.shape))
            elif name.endswith((".scale", "hc_scale")):
                t.copy_(1 + 0.2 * randn(t.shape))
            elif name.endswith((".base", "hc_base")):
                t.copy_(0.2 * randn(t.shape))
            elif t.is_floating_point():
                t.copy_(randn(t.shape) / math.sqrt(t.shape[-1]))


def canonical_state_dict(hf_model) -> dict[str, torch.Tensor]:
    return {k.removeprefix("model."): v.detach().clone() for k, v in hf_model.state_dict().items()}


@dataclass(slots=True)
class Reference:
    hf_model: object
    config: ModelConfig
    state_dict: dict[str, torch.Tensor]


def hf_reference(seed: int = 0, **overrides) -> Reference:
    from transformers import DeepseekV4ForCausalLM

    hc = hf_config(**overrides)
    model = DeepseekV4ForCausalLM(hc).eval()
    randomize_(model, seed)
    return Reference(model, ModelConfig.from_dict(hc.to_dict()), canonical_state_dict(model))


def hf_prompt_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """log p(ids[i+1] | ids[:i+1]) for every i, one transformers forward."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits[:-1], -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def hf_greedy(hf_model, ids: list[int], num_new: int) -> list[int]:
    """``num_new`` greedy tokens after ``ids`` from transformers' ``generate``."""
    x = torch.tensor([ids])
    with torch.no_grad():  # explicit mask: a prompt token equal to pad_token_id is not padding
        out = hf_model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=num_new, do_sample=False,
                                pad_token_id=0)  # fmt: skip
    return out[0, len(ids) :].tolist()


@dataclass(slots=True)
class SeqState:
    slot: int
    blocks: list[int]
    tokens: list[int]
    num_computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


class SeqDriver:
    """Drive sequences through a runner: slot i and a private range of blocks per sequence."""

    def __init__(self, runner, blocks_per_seq: int):
        self.runner = runner
        self.blocks_per_seq = blocks_per_seq
        self.seqs: dict[int, SeqState] = {}

    def add(self, seq_id: int, tokens: list[int], slot: int | None = None) -> SeqState:
        slot = len(self.seqs) if slot is None else slot
        first = slot * self.blocks_per_seq
        state = SeqState(slot, list(range(first, first + self.blocks_per_seq)), list(tokens))
        self.seqs[seq_id] = state
        return state

    def step(self, plan: dict[int, tuple[int, int]]) -> dict[int, torch.Tensor]:
        """One forward: seq_id -> (num new tokens from its pending tokens, num_logits)."""
        steps = []
        for seq_id, (n, num_logits) in plan.items():
            s = self.seqs[seq_id]
            toks = s.tokens[s.num_computed : s.num_computed + n]
            steps.append(SeqStep(seq_id, s.slot, s.blocks, s.num_computed, toks, num_logits=num_logits))
        logits = self.runner.execute(ForwardBatch(steps))
        out, row = {}, 0
        for st in steps:
            self.seqs[st.seq_id].num_computed += st.num_tokens
            out[st.seq_id] = logits[row : row + st.num_logits]
            row += st.num_logits
        return out

    def prefill(self, seq_ids: list[int], chunk: int | None = None, all_logits: bool = True) -> dict[int, torch.Tensor]:
        """Run every pending token of ``seq_ids`` (in chunks of at most ``chunk``), batched together."""
        got: dict[int, list[torch.Tensor]] = {i: [] for i in seq_ids}
        while True:
            plan = {}
            for i in seq_ids:
                s = self.seqs[i]
                left = len(s.tokens) - s.num_computed
                if left:
                    n = left if chunk is None else min(chunk, left)
                    plan[i] = (n, n if all_logits else int(n == left))
            if not plan:
                return {i: torch.cat(v) for i, v in got.items()}
            for i, lg in self.step(plan).items():
                got[i].append(lg)

    def greedy(self, seq_ids: list[int], num_tokens: int, first_logits: dict[int, torch.Tensor]):
        """Greedy decode ``num_tokens`` per sequence in one batch; returns (tokens, logprob rows)."""
        last = {i: first_logits[i][-1] for i in seq_ids}
        toks: dict[int, list[int]] = {i: [] for i in seq_ids}
        rows: dict[int, list[torch.Tensor]] = {i: [] for i in seq_ids}
        for k in range(num_tokens):
            for i in seq_ids:
                t = int(last[i].argmax())
                toks[i].append(t)
                rows[i].append(torch.log_softmax(last[i], -1))
                self.seqs[i].tokens.append(t)
            if k + 1 < num_tokens:
                last = {i: lg[-1] for i, lg in self.step({i: (1, 1) for i in seq_ids}).items()}
        return toks, {i: torch.stack(v) for i, v in rows.items()}
