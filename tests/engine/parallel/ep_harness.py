"""Shared by the EP tests and their rank processes: the tiny models, the prompts and one lockstep
greedy loop that the single-process reference and every EP rank run alike.

Attention is data-parallel: prompt i belongs to rank ``i % size``. Every rank runs the same
number of steps (``total_steps``): a rank whose sequences have finished, or that has none, runs
idle steps so that every MoE layer's exchanges see every rank.
"""

from __future__ import annotations

import functools
import random
import socket
from dataclasses import dataclass

import torch

from deepinfer.engine.core.model_runner import ModelRunner
from deepinfer.engine.models.deepseek_v4.testing import SeqDriver

BLOCK_SIZE = 128  # a multiple of every compress ratio (HCA: 128)


@dataclass(frozen=True, slots=True)
class Workload:
    prompts: list[list[int]]
    gen_lens: list[int]  # greedy tokens per prompt

    @property
    def total_steps(self) -> int:
        return 1 + max(self.gen_lens)  # one prefill forward, then one decode per step

    @property
    def blocks_per_seq(self) -> int:
        return blocks_for(self.prompts and max(map(len, self.prompts)), max(self.gen_lens))

    def owned(self, rank: int, size: int) -> list[int]:
        return [i for i in range(len(self.prompts)) if i % size == rank]


def blocks_for(prompt_len: int, gen_len: int) -> int:
    return -(-(prompt_len + gen_len) // BLOCK_SIZE)


DEFAULT_LENGTHS = (9, 23, 40, 17, 31, 5, 28, 12)
DEFAULT_GENS = (12, 9, 12, 3, 12, 7, 10, 2)  # with EP 4, rank 3 (prompts 3, 7) idles from step 4


def workload(vocab: int, lengths=DEFAULT_LENGTHS, gens=DEFAULT_GENS, seed: int = 5) -> Workload:
    rng = random.Random(seed)
    return Workload([[rng.randrange(3, vocab) for _ in range(n)] for n in lengths], list(gens))


@functools.cache
def _v4_weights(seed: int, layers: str, num_hash: int):
    from deepinfer.engine.models.deepseek_v4.tiny_model import init_weights, tiny_config

    cfg = tiny_config(layers, num_hash)
    return cfg, init_weights(cfg, seed)


@functools.cache
def _v41_weights(model_dir: str):
    from deepinfer.engine.models.deepseek_v41.loader import load_v41_checkpoint

    loaded = load_v41_checkpoint(model_dir)
    return loaded.config, loaded.tensors


def v4_runner(num_seqs: int, seed: int = 3, layers: str = "WCH", num_hash: int = 1, blocks_per_seq: int = 1):
    """The tiny V4 (tiny_model.tiny_config; by default three layers: window-only with a
    hash-routed MoE, CSA, HCA; 16 experts top-4, hidden 256), random weights of ``seed`` (drawn
    once per process; the runner copies them)."""
    cfg, weights = _v4_weights(seed, layers, num_hash)
    return ModelRunner(cfg, weights, num_blocks=num_seqs * blocks_per_seq, num_slots=num_seqs, block_size=BLOCK_SIZE)


def v41_runner(model_dir, num_seqs: int, blocks_per_seq: int = 1) -> ModelRunner:
    cfg, weights = _v41_weights(str(model_dir))
    return ModelRunner(cfg, weights, num_blocks=num_seqs * blocks_per_seq, num_slots=num_seqs, block_size=BLOCK_SIZE)


def run_lockstep(runner: ModelRunner, work: Workload, ids: list[int], before_step=None, idle_step=None):
    """Prefill ``ids`` in one forward, then greedy-decode each to its length, one token per step,
    for ``work.total_steps`` steps. ``before_step()`` runs before every step; ``idle_step()``
    runs a step with nothing to compute (None: skip it). Returns {id: (tokens, logprob rows)}."""
    driver = SeqDriver(runner, blocks_per_seq=work.blocks_per_seq)
    for slot, i in enumerate(ids):
        driver.add(i, work.prompts[i], slot=slot)
    tokens = {i: [] for i in ids}
    rows = {i: [] for i in ids}
    last: dict[int, torch.Tensor] = {}
    for step in range(work.total_steps):
        if before_step is not None:
            before_step()
        if step == 0:
            plan = {i: (len(work.prompts[i]), 1) for i in ids}
        else:
            plan = {}
            for i in ids:
                if len(tokens[i]) < work.gen_lens[i]:
                    lp = torch.log_softmax(last[i], -1)
                    tokens[i].append(int(lp.argmax()))
                    rows[i].append(lp)
                    driver.seqs[i].tokens.append(tokens[i][-1])
                    if len(tokens[i]) < work.gen_lens[i]:
                        plan[i] = (1, 1)
        if plan:
            for i, logits in driver.step(plan).items():
                last[i] = logits[-1]
        elif idle_step is not None:
            idle_step()
    return {i: (tokens[i], torch.stack(rows[i])) for i in ids}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
