"""One object's hedged read, as plain bookkeeping (no sockets, no clock).

    ask k+1 nodes ─┬─ answers arrive ── k good fragments of one write? ──> decode (HIT)
                   │                          (first k win; the slowest node is never waited on)
                   ├─ a node answers "not here" / corrupt / fails, so the pending asks can no
                   │  longer reach k ─────────────────────────────────> ask the rest now
                   └─ hedge delay passes with fewer than k ──────────> ask the rest
    every node asked and answered, still fewer than k ─────────────────> MISS, or UNAVAILABLE
                                                                          when the nodes that
                                                                          failed or were skipped
                                                                          could have made up k

Fragments are grouped by ``write_id``: two writes of one key are never decoded together.
``skipped``: nodes of the key's ranking the client did not ask because they are unusable (down,
unreachable); ``failed``: asked nodes whose request failed (no answer, connection lost).
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.cache.store.ec import Fragment


class KeyRead:
    __slots__ = ("key", "k", "first_wave", "reserve", "pending", "write2index2fragment", "num_bad", "is_hedged",
                 "skipped", "failed", "absent", "lowest_holder", "_lowest_index")  # fmt: skip

    def __init__(self, key: bytes, k: int, read_order: Sequence[str], first_wave_size: int, skipped: Sequence[str] = ()):
        self.key = key
        self.skipped = list(skipped)
        self.failed: list[str] = []
        self.absent: list[str] = []  # answered without a usable fragment
        self.lowest_holder = ""  # node that sent the lowest fragment index (repair hints go there)
        self._lowest_index = 1 << 30
        self.k = k
        self.first_wave = list(read_order[:first_wave_size])
        self.reserve = list(read_order[first_wave_size:])  # asked only when the first wave falls short
        self.pending: set[str] = set()
        self.write2index2fragment: dict[int, dict[int, Fragment]] = {}
        self.num_bad = 0
        self.is_hedged = False

    # ---- what to ask --------------------------------------------------------------------
    def start(self) -> list[str]:
        """Nodes to ask now (the first wave)."""
        self.pending.update(self.first_wave)
        return list(self.first_wave)

    def hedge(self) -> list[str]:
        """Nodes to ask on top of the first wave (empty once hedged or done)."""
        if self.is_hedged or self.is_ready:
            return []
        self.is_hedged = True
        nodes, self.reserve = self.reserve, []
        self.pending.update(nodes)
        return nodes

    # ---- what came back -----------------------------------------------------------------
    def on_fragment(self, node: str, fragment: Fragment, write_id: int) -> None:
        self.pending.discard(node)
        if fragment.header.key != self.key or fragment.header.k != self.k:
            self.num_bad += 1
            return
        self.write2index2fragment.setdefault(write_id, {})[fragment.header.index] = fragment
        if fragment.header.index < self._lowest_index:
            self._lowest_index, self.lowest_holder = fragment.header.index, node

    def on_absent(self, node: str) -> None:
        """The node answered without a usable fragment (not stored, corrupt, expired)."""
        if node in self.pending:
            self.pending.discard(node)
            self.num_bad += 1
            self.absent.append(node)

    def on_failed(self, node: str) -> None:
        """The node's request failed: no answer (timeout, connection lost) or an error reply."""
        if node in self.pending:
            self.pending.discard(node)
            self.num_bad += 1
            self.failed.append(node)

    # ---- state --------------------------------------------------------------------------
    @property
    def num_best(self) -> int:
        return max((len(f) for f in self.write2index2fragment.values()), default=0)

    @property
    def is_ready(self) -> bool:
        return self.num_best >= self.k

    @property
    def must_hedge_now(self) -> bool:
        """True when the answers still pending cannot bring the count to k."""
        return not self.is_ready and not self.is_hedged and self.num_best + len(self.pending) < self.k

    @property
    def is_hopeless(self) -> bool:
        """Short of k whatever the nodes still asked answer (the reserve spent), and those answers
        cannot change the verdict: a "not here" from them could turn UNAVAILABLE into MISS (an
        object whose write never reached quorum is absent on every usable node), so while they
        could, the read waits for them (usable nodes answer in milliseconds)."""
        if self.is_ready or not self.is_hedged or self.num_best + len(self.pending) >= self.k:
            return False
        unheard = len(self.failed) + len(self.skipped)  # the nodes that could still hold fragments
        return not self.pending or self.num_best + unheard >= self.k or \
            self.num_best + unheard + len(self.pending) < self.k

    @property
    def is_unavailable(self) -> bool:
        """Short of k, but the nodes not heard from (failed or skipped) could have made it up."""
        return not self.is_ready and self.num_best + len(self.pending) + len(self.failed) + len(self.skipped) >= self.k

    def unavailable_nodes(self) -> list[str]:
        return [*self.skipped, *self.failed]

    def fragments(self) -> list[Fragment]:
        """k fragments of the most complete write (call when ``is_ready``)."""
        best = max(self.write2index2fragment.values(), key=len)
        return [best[i] for i in sorted(best)][: self.k]
