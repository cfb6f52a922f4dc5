"""The inference worker's staging helpers: admit a call, snapshot it, complete it.

A worker calls :meth:`RolloutTokenCapture.begin_call` when a call arrives, which resolves the exact
token prefix the call must start with and, for a call that continues a generation cut, proves that
the staged prefix belongs to this call: the right keys, the right source call and digest, the same
lineage, the same generated-token count, a policy version not newer than the current one, and —
the check that stops a prefix built on other parent tokens with the same parent id and length —
chain and cumulative hashes recomputed from this call's own parent.

:meth:`~RolloutTokenCapture.build_prefix_record` snapshots a live call without completing it (a
cut stages that while decoding goes on); :meth:`~RolloutTokenCapture.build_generation_chunk_record`
stages only what was generated since (``prefix`` rebuilds a cut's records into one snapshot and
holds the checks ``begin_call`` runs). :meth:`~RolloutTokenCapture.complete_call` builds, claims completion, stages and
answers commit coordinates; a capture failure never fails the completion itself. Every record's
digest is computed once.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from protocols import (
    CaptureAdmission,
    CommitCoords,
    StagedCallRecord,
    StagedEntry,
    StagedPrefix,
    TokenStagingStore,
    compute_chain_hash,
    hash_token_ids,
    root_call_hashes,
    staging_key,
)

from .cut_records import build_cut, check_prefix_of, chunk_columns, extend, first_columns
from .errors import CaptureError, StreamingUnsupportedError
from .prefix import check_generation_cut, resolve_prefix
from .records import ActiveCall, CaptureAdapter, failed_coords, record_of

_log = logging.getLogger(__name__)


class RolloutTokenCapture:
    """Admit, snapshot, stage and acknowledge one worker's calls.

    Args:
        store: Where records are staged (durable before ``put`` returns).
        weight_version_fn: The policy version generating now; ``begin_call`` may be given the
            engine's version instead.
        adapter: Extracts capture material from engine responses, for
            :meth:`complete_call_from_response`.
    """

    def __init__(
        self,
        store: TokenStagingStore,
        *,
        weight_version_fn: Callable[[], int] = lambda: 0,
        adapter: CaptureAdapter | None = None,
    ) -> None:
        self._store = store
        self._weight_version_fn = weight_version_fn
        self._adapter = adapter
        # Guards only the claim of completion; staging itself runs unlocked so that concurrent
        # calls never queue behind one store round trip.
        self._completion_lock = threading.Lock()

    def begin_call(
        self,
        admission: CaptureAdmission,
        *,
        prefix_token_ids: Sequence[int] | None = None,
        generation_cut: StagedCallRecord | None = None,
        generation_cut_staging_keys: Sequence[str] | None = None,
        stream: bool = False,
        weight_version: int | None = None,
    ) -> ActiveCall:
        """Admit a call and stamp its policy version.

        Args:
            admission: The model server's contract for the call.
            prefix_token_ids: The resolved parent prefix of a ``token_in`` call; required when the
                admission names a ``staging_chain`` instead of an inline prefix, and must agree
                with an inline one.
            generation_cut: The staged prefix the call continues, rebuilt from the records under
                ``admission.generation_cut.staging_keys`` (:func:`rebuild_generation_cut`).
            generation_cut_staging_keys: The keys ``generation_cut`` was fetched from.
            stream: Whether the engine streams the response (unsupported).
            weight_version: The engine's policy version; ``weight_version_fn()`` when omitted.

        Raises:
            TypeError: ``admission`` is not a :class:`CaptureAdmission`.
            StreamingUnsupportedError: ``stream`` is true.
            CaptureError: The prefix, the version or the generation cut does not fit.
        """
        if not isinstance(admission, CaptureAdmission):
            raise TypeError(f"admission must be a CaptureAdmission, not {type(admission).__name__}")
        where = f"rollout {admission.rollout_id} call {admission.model_call_id}"
        if stream:
            raise StreamingUnsupportedError(f"{where}: staging does not support streaming")
        prefix = resolve_prefix(admission, prefix_token_ids, where)
        version = self._weight_version_fn() if weight_version is None else weight_version
        if type(version) is not int or version < 0:
            raise CaptureError(f"{where}: the policy version must be an int >= 0, got {version!r}")
        if generation_cut is not None:
            check_generation_cut(
                admission,
                generation_cut,
                prefix=prefix,
                staging_keys=generation_cut_staging_keys,
                weight_version=version,
                where=where,
            )
        elif admission.generation_cut is not None:
            raise CaptureError(f"{where}: the admission continues a cut but no snapshot was given")
        return ActiveCall(
            admission=admission,
            weight_version=version,
            prefix_token_ids=prefix,
            generation_cut=generation_cut,
        )

    def build_prefix_record(
        self,
        call: ActiveCall,
        *,
        prompt_token_ids: Sequence[int],
        generated_token_ids: Sequence[int],
        generated_logprobs: Sequence[float],
        extras: dict[str, Any] | None = None,
    ) -> StagedCallRecord:
        """Snapshot a live call without completing it.

        Without a cut the delta is the prompt past ``prev_len`` (mask 0.0) and the generated
        tokens (mask 1.0). With a cut the prompt must be the prefix plus the cut's tokens, and the
        delta is the cut's tokens (their masks and log-probs kept) followed by the new ones. The
        record is stamped with the oldest contributing policy version.

        Raises:
            ValueError: The prompt does not start with the authorized prefix, the columns
                disagree, or the record breaks a staging rule.
        """
        admission = call.admission
        tokens, masks, delta_log_probs = first_columns(
            call, prompt_token_ids, generated_token_ids, generated_logprobs
        )
        # The prompt was checked to be the prefix and then the delta's own prompt tokens.
        chain_hash, cumulative_hash = _call_hashes(call, tokens)
        return record_of(
            admission,
            weight_version=call.oldest_weight_version,
            tokens=tokens,
            masks=masks,
            log_probs=delta_log_probs,
            chain_hash=chain_hash,
            cumulative_hash=cumulative_hash,
            extras=extras,
        )

    def build_generation_chunk_record(
        self,
        call: ActiveCall,
        *,
        staged: Sequence[StagedCallRecord] | StagedPrefix,
        generated_token_ids: Sequence[int],
        generated_logprobs: Sequence[float],
    ) -> StagedCallRecord:
        """Stage only the tokens generated since the call's last staged record.

        The delta is the new tokens (mask 1.0), under the call's identity and current policy
        version. Its chain and cumulative hashes are those of the call's whole staged prefix
        through this chunk — ``staged`` deltas plus the new tokens, on the call's own parent — so
        each chunk is checkable against the call's parent on its own, and the last chunk carries
        the hashes of the snapshot :func:`rebuild_generation_cut` produces.

        Args:
            call: The live call.
            staged: The call's records staged so far, in order (the first is cumulative); as a
                :class:`~protocols.StagedPrefix` (:meth:`staged_prefix`), whose encoded columns
                spare the hashes a pass over every staged token (D420).
            generated_token_ids: The new tokens, at least one.
            generated_logprobs: Their log-probs.

        Raises:
            ValueError: No new tokens, unequal columns, no earlier record, a record of another
                call, or a prefix of another parent.
        """
        columns = chunk_columns(generated_token_ids, generated_logprobs)
        if not staged:
            raise ValueError("a chunk follows a cumulative record; stage build_prefix_record first")
        prefix = staged if isinstance(staged, StagedPrefix) else self.staged_prefix(call, staged)
        check_prefix_of(call, prefix)
        return extend(call, prefix, columns, call.weight_version).records[-1]

    build_cut = staticmethod(build_cut)
    """:func:`build_cut`: the call's next cut record on its staged prefix (D423)."""

    @staticmethod
    def staged_prefix(call: ActiveCall, records: Sequence[StagedCallRecord] = ()) -> StagedPrefix:
        """The call's staged ``records`` as one :class:`~protocols.StagedPrefix` on its parent.

        Raises:
            ValueError: The records do not form one call's prefix.
        """
        return StagedPrefix.of(
            records,
            parent_chain_hash=call.admission.parent_chain_hash,
            prefix_token_ids=call.prefix_token_ids,
        )

    def complete_call(
        self,
        call: ActiveCall,
        *,
        prompt_token_ids: Sequence[int],
        generated_token_ids: Sequence[int],
        generated_logprobs: Sequence[float],
        extras: dict[str, Any] | None = None,
        attachments: Mapping[str, Any] | None = None,
    ) -> CommitCoords:
        """Build the call's record, claim completion, stage it and answer its coordinates.

        Completion is claimed only once the record is valid; a record that cannot be built, a
        store that fails, all answer ``capture_failed`` coordinates instead of failing the call.

        Raises:
            CaptureError: Completion was already claimed.
        """
        try:
            record = self.build_prefix_record(
                call,
                prompt_token_ids=prompt_token_ids,
                generated_token_ids=generated_token_ids,
                generated_logprobs=generated_logprobs,
                extras=extras,
            )
        except (TypeError, ValueError, OverflowError):
            _log.exception(
                "could not build the record of %s/%s", call.rollout_id, call.model_call_id
            )
            return self.fail_call(call)
        self._claim_completion(call)
        key = staging_key(record.rollout_id, record.model_call_id)
        try:
            entry = StagedEntry(
                staging_key=key,
                record=record,
                attachments=None if attachments is None else dict(attachments),
            )
            self._store.put(entry)
        except Exception:
            # The store is outside our control; its failure costs the capture, not the completion.
            _log.exception("staging failed for %s/%s", call.rollout_id, call.model_call_id)
            return failed_coords(call)
        return CommitCoords(
            rollout_id=record.rollout_id,
            model_call_id=record.model_call_id,
            parent_call_id=record.parent_call_id,
            prev_len=record.prev_len,
            delta_len=record.delta_len,
            cum_len=record.cum_len,
            weight_version=record.weight_version,
            disposition="staged",
            digest=record.digest,
            extras_digest=record.extras_digest,
            staging_key=key,
            chain_hash=record.chain_hash,
            cumulative_hash=record.cumulative_hash,
        )

    def complete_call_from_response(
        self,
        call: ActiveCall,
        response: Any,
        *,
        attachments: Mapping[str, Any] | None = None,
    ) -> CommitCoords:
        """:meth:`complete_call` with the material extracted by the adapter.

        Raises:
            CaptureError: There is no adapter, or completion was already claimed.
        """
        if self._adapter is None:
            raise CaptureError("complete_call_from_response needs a CaptureAdapter")
        try:
            prompt = self._adapter.extract_prompt_ids(response)
            generated, log_probs = self._adapter.extract_generation(response)
            extras = self._adapter.extract_extras(response)
        except Exception:
            # Adapters are engine code with their own exception types; extraction failure costs
            # the capture only.
            _log.exception("extraction failed for %s/%s", call.rollout_id, call.model_call_id)
            return self.fail_call(call)
        return self.complete_call(
            call,
            prompt_token_ids=prompt,
            generated_token_ids=generated,
            generated_logprobs=log_probs,
            extras=extras,
            attachments=attachments,
        )

    def fail_call(self, call: ActiveCall) -> CommitCoords:
        """Claim completion without staging: answer ``capture_failed`` coordinates.

        Raises:
            CaptureError: Completion was already claimed.
        """
        self._claim_completion(call)
        return failed_coords(call)

    def _claim_completion(self, call: ActiveCall) -> None:
        with self._completion_lock:
            if call.completed:
                raise CaptureError(
                    f"rollout {call.rollout_id} call {call.model_call_id} was already completed"
                )
            call.completed = True


def _call_hashes(call: ActiveCall, delta: list[int]) -> tuple[str, str]:
    """The chain hash of ``delta`` on the call's parent, and the cumulative hash of the call's
    prefix followed by ``delta``. A root has no parent and no prefix, so both hashes cover
    ``delta`` alone and share one encoding of it (D418)."""
    admission = call.admission
    if admission.prev_len == 0:
        return root_call_hashes(delta)
    chain_hash = compute_chain_hash(admission.parent_chain_hash, delta)
    return chain_hash, hash_token_ids(call.prefix_token_ids + delta)
