"""What a shard process's participant may offer beyond :class:`~participants.Participant`.

A :class:`~participants.FanoutShard` checks these once, when it is made, instead of probing for
attributes at each message: a participant that has the capability gets the shard's hooks or
answers the messages that need it; one that has not refuses those messages with a typed error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from protocols import EpisodeId

from .._runtime.participant import Record


@runtime_checkable
class ClaimsRestored(Protocol):
    """Restored state that lives inside one request: the shard that runs it claims it first.

    The shard sets ``claim_restored``; the participant awaits it before using a restored record
    (the environment's episodes, which a replacement ``/run`` may bring to any shard).
    """

    claim_restored: Callable[[str], Awaitable[bool]] | None


@runtime_checkable
class ClaimsCuts(Protocol):
    """Restored generation cuts that the fan-out keeps until a call claims one (the model's)."""

    claim_cut: Callable[[str, str], Awaitable[dict[str, Any] | None]] | None
    return_cut: Callable[[str, dict[str, Any]], Awaitable[None]] | None


@runtime_checkable
class ExportsShares(Protocol):
    """A commit share and a restore part that the fan-out merges and splits (the model's).

    A shard whose participant has these answers ``export_share`` and ``install_share``.
    """

    async def export_share(self, episode_ids: Sequence[EpisodeId] | None) -> dict[str, Any]:
        """This shard's share of a commit (see ``ModelShare``)."""
        ...

    async def install_share(
        self, records: Sequence[Record], scope: Sequence[EpisodeId], options: dict[str, Any]
    ) -> None:
        """This shard's part of a restore (``options``: ``import``, ``targets``, ``cut_keys``)."""
        ...
