"""Field types and base models shared by the staging and generation-cut wire models.

Every staging wire model forbids unknown fields, takes no coercion (an int is not a float, a string
is not an int), refuses non-finite floats, and is frozen. Identifiers need at least one character;
digests are 64 lowercase hex characters.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from ._records import SHA256_HEX_PATTERN

STAGING_SCHEMA_VERSION: Final = 2
STAGING_DIGEST_VERSION: Final = 2
EXTRAS_DIGEST_VERSION: Final = 1


def _exact_float(value: object) -> object:
    # pydantic's strict mode still accepts an int for a float field; the staging contract does not,
    # because the digests encode floats and ints differently.
    if type(value) is not float:
        raise ValueError(f"expected a float, got {type(value).__name__}")
    return value


EXACT_FLOAT_TYPES: Final = frozenset({float})
"""What ``set(map(type, column))`` of an all-float column is a subset of."""


def _exact_floats(value: object) -> object:
    # One pass over the whole list: a per-item validator costs a Python call per token, and a
    # staged record carries two float lists as long as its token delta.
    if type(value) is list and not EXACT_FLOAT_TYPES.issuperset(map(type, value)):
        for index, item in enumerate(value):
            if type(item) is not float:
                raise ValueError(f"item {index}: expected a float, got {type(item).__name__}")
    return value


Identifier = Annotated[str, Field(min_length=1)]
"""A non-empty identifier (rollout id, capture key, model call id, staging key)."""

NonNegativeInt = Annotated[int, Field(ge=0)]
"""An exact non-negative integer."""

DigestHex = Annotated[str, Field(pattern=SHA256_HEX_PATTERN)]
"""A SHA-256 digest as 64 lowercase hex characters."""

ExactFloat = Annotated[float, BeforeValidator(_exact_float)]
"""A finite float that arrived as a float (never an int)."""

ExactFloats = Annotated[list[float], BeforeValidator(_exact_floats)]
"""A list of finite floats, each of which arrived as a float (checked in one pass)."""


class StrictWireModel(BaseModel):
    """Base of the staging and cut wire models: strict, closed, frozen, finite."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class StagingWireModel(StrictWireModel):
    """A staging wire model: carries ``schema_version`` 2."""

    schema_version: Literal[2] = STAGING_SCHEMA_VERSION


class DigestWireModel(StagingWireModel):
    """A staging wire model that carries a digest: also ``digest_version`` and ``extras_digest_version``."""

    digest_version: Literal[2] = STAGING_DIGEST_VERSION
    extras_digest_version: Literal[1] = EXTRAS_DIGEST_VERSION
