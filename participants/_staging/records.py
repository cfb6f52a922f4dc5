"""One admitted call, and the staged records and commit coordinates built from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from protocols import CaptureAdmission, CommitCoords, StagedCallRecord


class CaptureAdapter(Protocol):
    """Pulls capture material out of an engine's native response."""

    def extract_prompt_ids(self, response: Any) -> list[int]:
        """The exact prompt ids the engine decoded from."""

    def extract_generation(self, response: Any) -> tuple[list[int], list[float]]:
        """The generated ids and their log-probs."""

    def extract_extras(self, response: Any) -> dict[str, Any] | None:
        """Optional extras to stage with the record."""


@dataclass
class ActiveCall:
    """One admitted call.

    Attributes:
        admission: The model server's contract for the call.
        weight_version: The policy version generating now.
        prefix_token_ids: The exact token prefix the engine prompt must start with (empty for a
            text root).
        generation_cut: The staged prefix this call continues, validated by ``begin_call``.
        completed: Whether completion was claimed (once only).
    """

    admission: CaptureAdmission
    weight_version: int
    prefix_token_ids: list[int] = field(default_factory=list)
    generation_cut: StagedCallRecord | None = None
    completed: bool = field(default=False, init=False)

    @property
    def rollout_id(self) -> str:
        """The capture key the call stages under."""
        return self.admission.rollout_id

    @property
    def model_call_id(self) -> str:
        """The call."""
        return self.admission.model_call_id

    @property
    def oldest_weight_version(self) -> int:
        """The oldest policy version among the call's tokens: a continued prefix may be older."""
        if self.generation_cut is None:
            return self.weight_version
        return min(self.generation_cut.weight_version, self.weight_version)


def record_of(
    admission: CaptureAdmission,
    *,
    weight_version: int,
    tokens: list[int],
    masks: list[float],
    log_probs: list[float],
    chain_hash: str,
    cumulative_hash: str,
    extras: dict[str, Any] | None = None,
) -> StagedCallRecord:
    """A record under the admission's identity; its digest computed once."""
    return StagedCallRecord.from_components(
        rollout_id=admission.rollout_id,
        model_call_id=admission.model_call_id,
        parent_call_id=admission.parent_call_id,
        mode=admission.mode,
        prev_len=admission.prev_len,
        weight_version=weight_version,
        token_ids_delta=tokens,
        token_mask_delta=masks,
        generation_log_probs_delta=log_probs,
        chain_hash=chain_hash,
        cumulative_hash=cumulative_hash,
        extras=extras,
    )


def failed_coords(call: ActiveCall) -> CommitCoords:
    admission = call.admission
    return CommitCoords(
        rollout_id=admission.rollout_id,
        model_call_id=admission.model_call_id,
        parent_call_id=admission.parent_call_id,
        prev_len=admission.prev_len,
        delta_len=0,
        cum_len=admission.prev_len,
        weight_version=call.oldest_weight_version,
        disposition="capture_failed",
    )
