"""A bounded LRU cache of ledger rows, bounded both by rollouts and by rows.

Without a bound each process caches every rollout it ever served, and a retire only frees the
copy of the process that served it. Each entry remembers the file it was read from (inode) and
how far (byte offset), so a read only parses the tail another process appended since.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final, Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

DEFAULT_MAX_CACHED_ROLLOUTS: Final = 65_536
"""Ledgers the cache may hold: a policy server carries tens of thousands of rollouts in flight, and
a checkpoint exports every one of them (D269); the row bound below is what bounds memory."""
DEFAULT_MAX_CACHED_ROWS: Final = 262_144


@dataclass
class CachedLedger:
    """The rows of one ledger as far as ``offset`` of file ``inode``."""

    inode: int
    offset: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    by_call_id: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    weight: int = 0

    def add(self, row: dict[str, Any]) -> None:
        """Append one row and index it by call id."""
        self.rows.append(row)
        self.by_call_id.setdefault(str(row.get("model_call_id")), []).append(row)


class RowCache:
    """LRU over ledgers; evicts the least recently used until both bounds hold.

    The only entry is never evicted for its size (a single huge ledger still caches).

    Args:
        max_rollouts: Most ledgers kept (at least 1).
        max_rows: Most rows kept over all ledgers (at least 1).
    """

    def __init__(
        self,
        max_rollouts: int = DEFAULT_MAX_CACHED_ROLLOUTS,
        max_rows: int = DEFAULT_MAX_CACHED_ROWS,
    ) -> None:
        if max_rollouts < 1 or max_rows < 1:
            raise ValueError("cache bounds must be at least 1")
        self.max_rollouts = max_rollouts
        self.max_rows = max_rows
        self._entries: OrderedDict[str, CachedLedger] = OrderedDict()
        self._rows = 0
        self._guard = threading.Lock()

    def __contains__(self, key: object) -> bool:
        """Whether ``key`` has an entry (without marking it used)."""
        with self._guard:
            return key in self._entries

    def get(self, key: str) -> CachedLedger | None:
        """The entry of ``key`` (marked recently used), or ``None``."""
        with self._guard:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def store(self, key: str, entry: CachedLedger) -> None:
        """Insert or refresh ``entry`` after its rows changed, then enforce the bounds."""
        with self._guard:
            previous = self._entries.get(key)
            if previous is not None:
                self._rows -= previous.weight
            entry.weight = len(entry.rows)
            self._entries[key] = entry
            self._entries.move_to_end(key)
            self._rows += entry.weight
            while len(self._entries) > 1 and (
                len(self._entries) > self.max_rollouts or self._rows > self.max_rows
            ):
                _, evicted = self._entries.popitem(last=False)
                self._rows -= evicted.weight

    def pop(self, key: str) -> None:
        """Drop the rows of ``key``."""
        self.pop_many((key,))

    def pop_many(self, keys: Iterable[str]) -> None:
        """Drop the rows of every key of ``keys``, under one hold of the lock."""
        with self._guard:
            pop = self._entries.pop
            for key in keys:
                entry = pop(key, None)
                if entry is not None:
                    self._rows -= entry.weight

    def clear(self) -> None:
        """Drop everything."""
        with self._guard:
            self._entries.clear()
            self._rows = 0

    def sizes(self) -> dict[str, int]:
        """``{"ledger_rollouts": n, "ledger_rows": m}``: what the cache-size metric reports."""
        with self._guard:
            return {"ledger_rollouts": len(self._entries), "ledger_rows": self._rows}


class CacheSizeSource(Protocol):
    """Anything that reports ``cache_sizes()`` (both ledgers do)."""

    def cache_sizes(self) -> dict[str, int]:
        """Cache name → current size."""


class LedgerCacheCollector(Collector):
    """Exports a ledger's cache sizes as the gauge ``midflight_capture_ledger_cache_size``.

    Register one per ledger on the server's registry; the values are read at scrape time.
    """

    def __init__(self, ledger: CacheSizeSource) -> None:
        self._ledger = ledger

    def collect(self) -> Iterator[Metric]:
        """One sample per cache (``ledger_rollouts``, ``ledger_rows``)."""
        family = GaugeMetricFamily(
            "midflight_capture_ledger_cache_size",
            "Entries held by the capture ledger's row cache",
            labels=["cache"],
        )
        for name, size in sorted(self._ledger.cache_sizes().items()):
            family.add_metric([name], size)
        yield family
