"""Identities: rollout ids, attempts, episode ids, capture keys, checkpoint ids.

A rollout is the logical unit a training controller schedules; an attempt is one physical
execution of it. ``EpisodeId`` names an attempt, and its capture key is the string form used in
URLs, blocker lists and ledger file names: ``<rollout>`` for attempt 0, ``<rollout>-a<N>`` after.
Rollout ids may not end in ``-a<N>`` themselves, so the key always inverts.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Annotated, Any, Final, Self, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

from ._errors import InvalidRolloutIdError

SAFE_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
_SAFE_NAME = re.compile(SAFE_NAME_PATTERN)
_ATTEMPT_SUFFIX = re.compile(r"-a([1-9][0-9]*)$")
MAX_CHECKPOINT_ID_LENGTH: Final = 128
MAX_ROLLOUT_ID_LENGTH: Final = 200
"""Longest rollout id: its capture key (``-a<N>`` added) plus a ledger suffix must stay a legal
file name (255 bytes on every common file system)."""
MAX_ATTEMPT: Final = 9_999
"""Highest attempt number. Retiring attempt N fences every attempt 0..N of its rollout (a late
write of any of them must stay refused), so N bounds the work of one retire as well as the
length of a capture key."""


def validate_rollout_id(rollout_id: object) -> str:
    """Check one rollout id and return it.

    A rollout id starts with an ASCII letter or digit, continues with letters, digits, ``.``,
    ``_`` or ``-``, and does not end in the reserved attempt suffix ``-a<N>`` (N ≥ 1, no leading
    zero), which would make its capture key ambiguous.

    Raises:
        InvalidRolloutIdError: The id is not a string or breaks a rule.
    """
    if not isinstance(rollout_id, str):
        raise InvalidRolloutIdError(
            f"a rollout id must be a string, not {type(rollout_id).__name__}"
        )
    if not _SAFE_NAME.fullmatch(rollout_id):
        raise InvalidRolloutIdError(
            f"invalid rollout id {rollout_id[:200]!r}: use letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    if len(rollout_id) > MAX_ROLLOUT_ID_LENGTH:
        raise InvalidRolloutIdError(
            f"invalid rollout id {rollout_id[:40]!r}...: longer than {MAX_ROLLOUT_ID_LENGTH} characters"
        )
    if _ATTEMPT_SUFFIX.search(rollout_id):
        raise InvalidRolloutIdError(
            f"invalid rollout id {rollout_id!r}: the suffix -a<N> is reserved for capture keys"
        )
    return rollout_id


def validate_rollout_ids(rollout_ids: Iterable[str]) -> list[str]:
    """Check a whole batch of rollout ids before anything acts on any of them.

    Returns:
        The ids de-duplicated, first occurrence kept.

    Raises:
        TypeError: A bare string was passed where a sequence of rollout ids was expected.
        InvalidRolloutIdError: Any id breaks a rule; the whole batch is refused.
    """
    if isinstance(rollout_ids, str | bytes):
        raise TypeError("expected a sequence of rollout ids, got a bare string")
    checked = [validate_rollout_id(rollout_id) for rollout_id in rollout_ids]
    return list(dict.fromkeys(checked))


def validate_safe_name(value: str, *, what: str) -> str:
    """Check a name that becomes a path component (an instance, a kind, a checkpoint id).

    Raises:
        ValueError: The name could escape its directory or is empty.
    """
    if not _SAFE_NAME.fullmatch(value):
        raise ValueError(
            f"{what} {value[:200]!r} is not a safe name: use letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return value


def validate_checkpoint_id(checkpoint_id: str) -> str:
    """Check a checkpoint id: a safe name of 1 to 128 characters.

    Raises:
        ValueError: The id is too long or not a safe name.
    """
    if len(checkpoint_id) > MAX_CHECKPOINT_ID_LENGTH:
        raise ValueError(f"checkpoint id longer than {MAX_CHECKPOINT_ID_LENGTH} characters")
    return validate_safe_name(checkpoint_id, what="checkpoint id")


_FIRST, _NEXT = "[A-Za-z0-9]", "[A-Za-z0-9._-]"
ROLLOUT_ID_PATTERN: Final = (
    "^(?:"
    + "|".join(
        (
            # It ends in a letter, '.', '_' or '-' (or is one character): no suffix to refuse.
            f"{_FIRST}(?:{_NEXT}*[A-Za-z._-])?",
            # It ends in digits. Digits alone, or after anything but an 'a', are no suffix.
            "[0-9]+",
            "[A-Zb-z][0-9]+",
            f"{_FIRST}{_NEXT}*[A-Zb-z._-][0-9]+",
            # Digits after an 'a' that is first or follows anything but '-': no suffix.
            "a[0-9]+",
            f"{_FIRST}a[0-9]+",
            f"{_FIRST}{_NEXT}*[A-Za-z0-9._]a[0-9]+",
            # After '-a', only digits with a leading zero: -a<N> has none.
            f"{_FIRST}{_NEXT}*-a0[0-9]*",
        )
    )
    + ")$"
)
"""The rules of :func:`validate_rollout_id` but the length, as one regular expression without
look-around, so that pydantic-core checks it itself (D436): a safe name that does not end in
``-a<N>``, spelled out case by case of how the id ends."""
ROLLOUT_ID_RULE: Final = (
    "invalid rollout id: use letters, digits, '.', '_' or '-', start with a letter or digit, "
    f"stay within {MAX_ROLLOUT_ID_LENGTH} characters, and do not end in -a<N> (N >= 1), which "
    "is reserved for capture keys"
)


class _RolloutIdSchema:
    """A wire model's rollout id, checked inside pydantic-core: no Python call per id.

    A restore's request names every rollout it continues, and a cut round's inventory, receipt
    and acks name every call's rollout: a Python validator cost about half a microsecond per id,
    tens of thousands of times per checkpoint (D436). The error names the whole rule; the
    OpenAPI schema stays a plain string, as it always was.
    """

    def __get_pydantic_core_schema__(
        self, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.custom_error_schema(
            core_schema.str_schema(pattern=ROLLOUT_ID_PATTERN, max_length=MAX_ROLLOUT_ID_LENGTH),
            custom_error_type="invalid_rollout_id",
            custom_error_message=ROLLOUT_ID_RULE,
        )

    def __get_pydantic_json_schema__(
        self, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return handler(core_schema.str_schema())


RolloutId = Annotated[str, _RolloutIdSchema()]
"""A rollout id inside a wire model; a bad one fails model validation."""

CheckpointId = Annotated[str, AfterValidator(validate_checkpoint_id)]
"""A checkpoint id inside a wire model."""

InstanceName = Annotated[str, AfterValidator(lambda v: validate_safe_name(v, what="instance"))]
"""A participant instance name; it is a path component of the checkpoint layout."""


class EpisodeId(BaseModel):
    """One physical attempt of a rollout.

    Attributes:
        rollout_id: The logical rollout, stable across retries and restores.
        attempt: Which execution of the rollout this is; 0 for the first.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    rollout_id: RolloutId
    attempt: int = Field(default=0, ge=0, le=MAX_ATTEMPT)

    @property
    def capture_key(self) -> str:
        """``<rollout>`` for attempt 0, ``<rollout>-a<N>`` otherwise."""
        return self.rollout_id if self.attempt == 0 else f"{self.rollout_id}-a{self.attempt}"

    @classmethod
    def from_capture_key(cls, capture_key: str) -> Self:
        """Invert :attr:`capture_key`.

        Raises:
            InvalidRolloutIdError: The key is malformed.
        """
        if not isinstance(capture_key, str) or not _SAFE_NAME.fullmatch(capture_key):
            raise InvalidRolloutIdError(f"invalid capture key {str(capture_key)[:200]!r}")
        match = _ATTEMPT_SUFFIX.search(capture_key)
        if match is None:
            return cls(rollout_id=validate_rollout_id(capture_key), attempt=0)
        rollout_id = capture_key[: match.start()]
        validate_rollout_id(rollout_id)
        if len(match.group(1)) > len(str(MAX_ATTEMPT)):
            raise InvalidRolloutIdError(
                f"invalid capture key {capture_key[:200]!r}: attempt too high"
            )
        return cls(rollout_id=rollout_id, attempt=int(match.group(1)))

    def next_attempt(self) -> Self:
        """The same rollout, one attempt later: what a restore installs a record under.

        Raises:
            pydantic.ValidationError: This is attempt ``MAX_ATTEMPT``, which has no next one.
        """
        if self.attempt >= MAX_ATTEMPT:
            return type(self)(rollout_id=self.rollout_id, attempt=self.attempt + 1)  # refused
        # The rollout id was validated when this episode was, and the attempt is in range: a
        # restore builds one per rollout on every participant, and validating them again was
        # the largest single step of restoring 16,000 rollouts (D376). ``model_construct`` is
        # slower still than validating (D391), so the instance is filled in directly.
        return _trusted(type(self), self.rollout_id, self.attempt + 1)

    def covers(self, other: EpisodeId) -> bool:
        """Whether retiring this attempt also retires ``other``.

        Retiring attempt N of a rollout discards every attempt of it up to and including N.
        """
        return other.rollout_id == self.rollout_id and other.attempt <= self.attempt

    def __str__(self) -> str:
        return self.capture_key


_E = TypeVar("_E", bound=EpisodeId)
_new = object.__new__
_set = object.__setattr__


def _trusted(cls: type[_E], rollout_id: str, attempt: int) -> _E:
    """An episode of fields already known valid, as ``model_construct`` would build it.

    ``model_construct`` runs about 4 µs of Python per call; this is about 1 µs. The instance
    holds what a validated one holds (equal, same hash, same dump and fields set), which
    ``tests/protocols/test_ids.py`` checks against the installed pydantic (D391).
    """
    episode = _new(cls)
    _set(episode, "__dict__", {"rollout_id": rollout_id, "attempt": attempt})
    _set(episode, "__pydantic_fields_set__", {"rollout_id", "attempt"})
    _set(episode, "__pydantic_extra__", None)
    _set(episode, "__pydantic_private__", None)
    return episode


def refuse_unrestorable(episode_ids: Iterable[EpisodeId]) -> None:
    """Refuse a restore scope that no restore can carry out (D361, D365).

    A restore installs attempt N + 1 of every episode it names and fences attempts 0..N of its
    rollout. So attempt ``MAX_ATTEMPT``, which has no next attempt, cannot be named, and neither
    can two attempts of one rollout: the later one's fence would refuse what the earlier one
    installs. The same attempt named twice is one episode, as everywhere else.

    Raises:
        ValueError: Naming the first such episode.
    """
    named: dict[str, EpisodeId] = {}
    for episode in episode_ids:
        # Anything but an episode is left to the model's own validation.
        if not isinstance(episode, EpisodeId):
            continue
        if episode.attempt >= MAX_ATTEMPT:
            raise ValueError(
                f"{episode.capture_key} is attempt {MAX_ATTEMPT}, the last an attempt may be: a "
                "restore has no next attempt to install it under; rerun the rollout from its "
                "input under a new rollout id"
            )
        first = named.setdefault(episode.rollout_id, episode)
        if first.attempt != episode.attempt:
            raise ValueError(
                f"the scope names two attempts of rollout {episode.rollout_id!r} "
                f"({first.capture_key} and {episode.capture_key}): a restore continues one "
                "attempt per rollout, and the later one's fence would refuse what the earlier "
                "one installs"
            )


def capture_key(rollout_id: str, attempt: int = 0) -> str:
    """The capture key of ``(rollout_id, attempt)``, validating both."""
    return EpisodeId(rollout_id=rollout_id, attempt=attempt).capture_key


def sorted_capture_keys(episode_ids: Iterable[EpisodeId]) -> list[str]:
    """The sorted, de-duplicated capture keys of some episodes (a model share's order)."""
    return sorted({episode.capture_key for episode in episode_ids})


def attempts_through(retired: Iterable[EpisodeId]) -> dict[str, int]:
    """Rollout id → the highest attempt of it that ``retired`` names.

    Retiring every episode of ``retired`` covers attempt ``a`` of rollout ``r`` exactly when
    ``a <= attempts_through(retired).get(r, -1)``: one dictionary lookup per thing checked,
    however many episodes a retire names (D389).
    """
    through: dict[str, int] = {}
    for episode in retired:
        through[episode.rollout_id] = max(episode.attempt, through.get(episode.rollout_id, 0))
    return through


def keys_covered_by(keys: Iterable[str], retired: Iterable[EpisodeId]) -> list[str]:
    """The capture keys among ``keys`` that retiring every episode of ``retired`` covers.

    ``[k for k in keys if any(e.covers(EpisodeId.from_capture_key(k)) for e in retired)]``,
    in one pass over each: a retire of thousands of attempts, checked against the thousands a
    server tracks, cost a key parse per pair: 21 s for 653 retires against 3,165 keys (D389).
    ``keys`` are capture keys the server made itself, so each is split, not validated again: a
    key of a rollout ``retired`` does not name is never covered, whatever its form.
    """
    through = attempts_through(retired)
    covered = []
    for key in keys:
        head, dash, tail = key.rpartition("-a")
        if dash and tail.isdigit() and tail[0] != "0" and tail.isascii():
            rollout, attempt = head, int(tail)
        else:
            rollout, attempt = key, 0
        if attempt <= through.get(rollout, -1):
            covered.append(key)
    return covered
