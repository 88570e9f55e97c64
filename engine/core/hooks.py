"""The optional parts an ``EngineCore`` is built with, given at construction and never patched in.

    core = EngineCore(runner, config, hooks=EngineHooks(swa_slots=manager, kv_offload=offload))

Each part is built before the core by its own builder (``kv/swa_slots.build_swa_slots``,
``kv/offload.KVOffload.build``) and reaches the components that call it through their
constructors: the scheduler (admission: restore or replay, KV still being read), the KV manager
(prefix lookup through the tiers, snapshot at release, blocks kept out of the prefix cache), the
step (device copies before a forward), the step's calls (DSpark: verify lengths before
scheduling, drafts after sampling, counters at commit; engine/spec/decoding.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deepinfer.engine.kv.offload import KVOffload
    from deepinfer.engine.kv.swa_slots import SwaSlotManager
    from deepinfer.engine.spec.decoding import SpecDecoding


@dataclass(frozen=True, slots=True)
class EngineHooks:
    # SWA slots: restore a stored slot at a prefix hit instead of replaying, save a finished
    # sequence's slot, keep blocks computed over an approximate (bounded-replay) state uncached
    swa_slots: SwaSlotManager | None = None
    # KV tiers: prefix blocks from host memory / the KV store, new blocks written behind
    kv_offload: KVOffload | None = None
    # DSpark speculative decoding: the drafter over the target's features and the length policy
    spec: SpecDecoding | None = None
