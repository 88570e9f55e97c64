"""What a storage node's repair and scrub ask of its FragmentStore (mixed into it: same lock, index).

    scrub(key)          re-verify one fragment's checksums without serving it; a damaged one is
                        deleted, a vanished file forgotten, both remembered as *lost*
    take_lost()         keys lost since the last call (damage found by reads or the scrub): the
                        repair has their objects' leaders rebuild them
    holding(key)        (index, write id, payload crc) of the held fragment: HasFragments answers
    write_age_s(key)    seconds since the fragment was written: the audit leaves young keys for
                        later (a write's other fragments may still be on their way)
    record_of / read_fragment   a fragment's record and payload for a move or a rebuild
    was_evicted(key)    LRU GC deleted it lately: repair leaves such objects to age out
"""

from __future__ import annotations

from deepinfer.cache.store import fragment_file as ff
from deepinfer.transport.protocol import FragmentStatus

MAX_LOST_KEYS = 65_536  # lost and evicted keys remembered; past this the periodic audit finds them


class FragmentChecks:
    """Needs the host's ``_lock``, ``_lru``, ``_frag_dir``, ``_lost``, ``_evicted``, ``_stats``,
    ``_db``, ``_delete`` and ``_forget``."""

    def was_evicted(self, key: bytes) -> bool:
        """LRU GC deleted this key's fragment lately (the object is on its way out of the cache)."""
        with self._lock:
            return key in self._evicted

    def write_age_s(self, key: bytes) -> float | None:
        """Seconds since this key's fragment was written here, or None if not held."""
        with self._lock:
            entry = self._lru.get(key)
            return None if entry is None else self.clock() - entry.written_at

    def holding(self, key: bytes) -> tuple[int, int, int] | None:
        """(fragment index, write id, payload crc) of the fragment held for ``key``, or None."""
        with self._lock:
            entry = self._lru.get(key)
            if entry is None:
                return None
            if entry.index >= 0:
                return entry.index, entry.write_id, entry.payload_crc
        record = self.record_of(key)  # restarted since this fragment was written: its file's header says
        with self._lock:
            entry = self._lru.get(key)
            if entry is None or record is None:
                return None
            entry.index, entry.write_id, entry.payload_crc = record.header.index, record.write_id, record.header.payload_crc
            return entry.index, entry.write_id, entry.payload_crc

    def record_of(self, key: bytes) -> ff.FragmentRecord | None:
        """The stored fragment's record (header, write id, class, expiry), from its file's header."""
        try:
            record = ff.read_prefix(ff.fragment_path(self._frag_dir, key))
        except (OSError, ff.CorruptFragment):
            return None  # the scrub or the next read deals with the file
        return record if record.key == key else None

    def read_fragment(self, key: bytes) -> tuple[ff.FragmentRecord, memoryview] | None:
        """The fragment with its record (traffic class, expiry), checksums verified; for repair
        (no recency, no read counters). A damaged one is deleted and remembered as lost."""
        if self.scrub(key)[0] != FragmentStatus.OK:
            return None
        try:
            record, payload = ff.parse(ff.read_file(ff.fragment_path(self._frag_dir, key)))
        except (OSError, ff.CorruptFragment):
            return None
        return (record, payload) if record.key == key else None

    def scrub(self, key: bytes) -> tuple[FragmentStatus | None, int]:
        """Verify one stored fragment's checksums: (OK | CORRUPT (deleted) | NOT_FOUND (its file
        vanished; forgotten), file bytes). Damage is remembered as lost, for repair. (None, 0)
        when the key is not held, or was replaced or deleted meanwhile (not damage)."""
        with self._lock:
            entry = self._lru.get(key)
        if entry is None:
            return None, 0
        path = ff.fragment_path(self._frag_dir, key)
        try:
            record, _ = ff.parse(ff.read_file(path))
            if record.key != key:
                raise ff.CorruptFragment(f"file for {key.hex()} holds {record.key.hex()}")
        except FileNotFoundError:
            with self._lock:
                if self._lru.get(key) is not entry or path.exists():
                    return None, 0
                self._forget_lost(key)
            return FragmentStatus.NOT_FOUND, 0
        except ff.CorruptFragment:
            with self._lock:
                self._stats.num_corrupt += 1
                if self._lru.get(key) is entry:
                    self._delete(key)
                    self._lost.append(key)
            return FragmentStatus.CORRUPT, entry.num_bytes
        return FragmentStatus.OK, entry.num_bytes

    def _forget_lost(self, key: bytes) -> None:
        self._forget(key)
        self._db.execute("DELETE FROM fragments WHERE key = ?", (key,))
        self._lost.append(key)

    def take_lost(self) -> list[bytes]:
        """Keys whose fragment was found damaged or missing since the last call."""
        with self._lock:
            keys = list(self._lost)
            self._lost.clear()
            return keys
