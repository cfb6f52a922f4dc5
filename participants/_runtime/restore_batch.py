"""Checking a restore's records as one batch: the scope as an index, one validation per list.

A restore request's ``episode_ids`` are validated when the request is parsed. Every record of the
checkpoint names its episode again, and a restore used to validate that name through pydantic at
each step that looked at it (selecting the records in scope, listing the restored keys, each
participant's install), then build the next attempt through pydantic again: about twenty
``EpisodeId`` validations per rollout across the four participants, the largest single cost of a
restore at thousands of rollouts (``docs/performance.md``, "Restore"; D264).

:class:`RestoreScope` is the scope itself (a sequence of episodes, so it passes wherever a scope
does) with an index by ``(rollout_id, attempt)``: a record whose ``episode_id`` is a plain JSON
object naming a scoped attempt *is* that attempt, already validated, and is looked up; anything
else goes through ``EpisodeId.model_validate`` exactly as before, so a malformed record is refused
with the same error. Next attempts are built once per episode and shared, and a step that needs
only a next attempt's capture key gets the key without the episode.

:func:`validate_batch` validates a whole list through one ``TypeAdapter`` call instead of one
``model_validate`` per record, and names the first record that failed, as the per-record loop did.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from operator import attrgetter
from typing import Any, TypeVar, overload

from pydantic import TypeAdapter, ValidationError

from protocols import MAX_ATTEMPT, EpisodeId, InvalidCheckpointStateError

T = TypeVar("T")


class RestoreScope(Sequence[EpisodeId]):
    """The episodes a restore continues, indexed for the records that name them.

    Args:
        episodes: The scope, as the restore request gave it (order kept, repeats kept).
    """

    __slots__ = ("_episodes", "_index", "_next", "_next_keys")

    def __init__(self, episodes: Iterable[EpisodeId]) -> None:
        self._episodes = list(episodes)
        self._index = {(e.rollout_id, e.attempt): e for e in self._episodes}
        self._next: dict[tuple[str, int], EpisodeId] = {}
        self._next_keys: dict[tuple[str, int], str] = {}

    @classmethod
    def of(cls, scope: Sequence[EpisodeId]) -> RestoreScope:
        """``scope`` itself when it is indexed already, else an index over it."""
        return scope if isinstance(scope, RestoreScope) else cls(scope)

    @overload
    def __getitem__(self, index: int) -> EpisodeId: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[EpisodeId]: ...

    def __getitem__(self, index: int | slice) -> EpisodeId | Sequence[EpisodeId]:
        return self._episodes[index]

    def __len__(self) -> int:
        return len(self._episodes)

    def __iter__(self) -> Iterator[EpisodeId]:
        return iter(self._episodes)

    def __contains__(self, value: object) -> bool:
        if not isinstance(value, EpisodeId):
            return False
        return (value.rollout_id, value.attempt) in self._index

    def identity(self) -> frozenset[tuple[str, int]]:
        """The scope as a set of attempts: what a retry must name again to be the same call.

        Equal for two scopes exactly when their sorted, de-duplicated capture keys are (a
        capture key names one ``(rollout_id, attempt)``, as no rollout id ends in ``-a<N>``),
        built from the index in a twentieth of the time the keys take (D449).
        """
        return frozenset(self._index)

    def lookup(self, raw: object) -> EpisodeId | None:
        """The scoped episode ``raw`` names, if it is a plain JSON object naming one.

        ``raw`` must be exactly what ``EpisodeId`` accepts in strict mode and nothing more: a
        ``dict`` with a ``str`` ``rollout_id``, an ``int`` (not ``bool``) ``attempt`` that may be
        left out, and no other key. Anything else, or an attempt outside the scope, is ``None``:
        the caller validates it in full.
        """
        if type(raw) is not dict:
            return None
        size = len(raw)  # two keys, or the rollout id alone; an extra key is EpisodeId's to refuse
        if size == 2:
            attempt = raw.get("attempt")
        elif size == 1:
            attempt = 0
        else:
            return None
        rollout_id = raw.get("rollout_id")
        if type(rollout_id) is not str or type(attempt) is not int:
            return None
        return self._index.get((rollout_id, attempt))

    def episode(self, raw: Any) -> EpisodeId:
        """``raw`` as an episode: looked up when it names a scoped attempt, else validated.

        Raises:
            pydantic.ValidationError: ``raw`` is not a valid episode id.
        """
        found = self.lookup(raw)
        return found if found is not None else EpisodeId.model_validate(raw)

    def in_scope(self, raw: Any) -> bool:
        """Whether ``raw`` names an attempt of the scope.

        Raises:
            pydantic.ValidationError: ``raw`` is not a valid episode id.
        """
        return self.lookup(raw) is not None or self.episode(raw) in self

    def next_attempt(self, episode: EpisodeId) -> EpisodeId:
        """``episode.next_attempt()``, built once per episode of this restore."""
        key = (episode.rollout_id, episode.attempt)
        found = self._next.get(key)
        if found is None:
            found = self._next[key] = episode.next_attempt()
        return found

    def next_key(self, episode: EpisodeId) -> str:
        """``self.next_attempt(episode).capture_key``, without building the next attempt.

        Where a step needs only the key (the restored keys of a reply, a model's ledgers), the
        key is formatted as ``EpisodeId.capture_key`` formats it, once per episode (D432): a
        next attempt is always attempt 1 or later. The last attempt, which has none, goes
        through :meth:`next_attempt` and is refused there.
        """
        key = (episode.rollout_id, episode.attempt)
        found = self._next_keys.get(key)
        if found is None:
            if episode.attempt >= MAX_ATTEMPT:
                return self.next_attempt(episode).capture_key  # raises
            found = self._next_keys[key] = f"{episode.rollout_id}-a{episode.attempt + 1}"
        return found

    def next_keys(self, episodes: Sequence[EpisodeId]) -> list[str]:
        """``[self.next_key(e) for e in episodes]``, formatted in one pass.

        One call per restore instead of one per record (D439). When any episode is the last
        attempt, each goes through :meth:`next_key`, which refuses it.
        """
        if episodes and max(map(_attempt_of, episodes)) >= MAX_ATTEMPT:
            return [self.next_key(episode) for episode in episodes]
        return [f"{episode.rollout_id}-a{episode.attempt + 1}" for episode in episodes]


_attempt_of = attrgetter("attempt")


def scope_identity(episodes: Iterable[EpisodeId]) -> frozenset[tuple[str, int]]:
    """:meth:`RestoreScope.identity` of a scope that has no index: each attempt, once."""
    return frozenset((e.rollout_id, e.attempt) for e in episodes)


def validate_batch(adapter: TypeAdapter[list[T]], items: Sequence[Any], what: str) -> list[T]:
    """Validate every item at once; refuse the batch naming the first item that failed.

    Args:
        adapter: A ``TypeAdapter`` over a list of the item type (built once, at import).
        items: The items, in record order.
        what: How the message names an item (``"environment record"``).

    Raises:
        InvalidCheckpointStateError: ``{what} {index} is malformed: <its first three errors>``.
    """
    try:
        return adapter.validate_python(items)
    except ValidationError as exc:
        errors = exc.errors()
        first = errors[0]["loc"][0] if errors and errors[0]["loc"] else 0
        own = [{**e, "loc": e["loc"][1:]} for e in errors if e["loc"][:1] == (first,)]
        raise InvalidCheckpointStateError(f"{what} {first} is malformed: {own[:3]}") from exc
