"""Typed inputs and decisions of every balancer: what a gateway hands a policy, what it gets back.

Engines are named by small non-negative ints (the gateway maps node names to them): the prefix
index keeps one bit per engine, so ids index bit masks. Block hashes are whatever the engines
publish in their cache events: 16-byte digests in production (``deepinfer.cache.block_hash``),
plain ints in the simulator. A policy only hashes and compares them.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

BlockHash = Hashable


@dataclass(frozen=True, slots=True)
class RequestInfo:
    """One request as the router sees it at arrival.

    ``block_hashes`` are the chain hashes of the prompt's *full* blocks, in order:

        prompt tokens:  [0, bs) [bs, 2bs) ... [(k-1)bs, k*bs) [k*bs, num_prompt_tokens)
        block_hashes:    h0      h1          h(k-1)            (partial block: no hash)

    ``image_tokens`` lists, per image that still needs encoding, its vision-token count.
    """

    request_id: int | str
    num_prompt_tokens: int
    block_hashes: Sequence[BlockHash] = ()
    block_size: int = 1
    image_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: num_prompt_tokens must be >= 1, got {self.num_prompt_tokens}")
        if self.block_size < 1:
            raise ValueError(f"request {self.request_id!r}: block_size must be >= 1, got {self.block_size}")
        if len(self.block_hashes) * self.block_size > self.num_prompt_tokens:
            raise ValueError(
                f"request {self.request_id!r}: {len(self.block_hashes)} full blocks of {self.block_size} "
                f"tokens do not fit in {self.num_prompt_tokens} prompt tokens"
            )

    def num_cached_tokens(self, num_hit_blocks: int) -> int:
        """Tokens a prefix hit of ``num_hit_blocks`` saves; at least one token is always computed
        because the first output token is sampled from the last prompt position."""
        return min(num_hit_blocks * self.block_size, self.num_prompt_tokens - 1)


class PrefillLoad(NamedTuple):
    """A prefill engine's load: what its heartbeat reports plus what the gateway routed since.

    Load snapshots are NamedTuples: a gateway builds one per engine per routed request."""

    engine_id: int
    num_requests: int  # queued + running prefills
    backlog_s: float  # predicted seconds of prefill compute queued, including the running remainder


class DecodeLoad(NamedTuple):
    """A decode engine's load in both dimensions the decode balancer weighs.

    Counts include requests already assigned to this engine that are still in prefill or in
    transfer ("incoming"): they will land here, so a balancer must see them now.
    """

    engine_id: int
    num_requests: int  # running + waiting for a slot + incoming
    num_kv_tokens: int  # KV length of those same requests (prompt + generated so far)
    max_requests: int = 1 << 30
    kv_capacity_tokens: int = 1 << 62


class VELoad(NamedTuple):
    """A vision-encoder instance's queued work."""

    engine_id: int
    num_pending_image_tokens: int


@dataclass(frozen=True, slots=True)
class PrefillChoice:
    """Where a request prefills, and why."""

    engine_id: int
    tier: int  # context-length tier (-1: the policy does not tier)
    num_cached_tokens: int  # the router's estimate of the prefix hit on that engine
    predicted_s: float  # predicted prefill compute seconds on that engine (0 if the policy has no cost model)
    is_affinity: bool  # True when the prefix hit, not load, decided the engine


@dataclass(frozen=True, slots=True)
class DecodeChoice:
    """The decode engine a request hands off to (chosen when the request is routed)."""

    engine_id: int
    is_over_capacity: bool  # every engine was full; this one is the least over


@dataclass(frozen=True, slots=True)
class VEPlan:
    """Per image (in the request's order), the vision-encoder instance that encodes it."""

    image2engine: tuple[int, ...]
