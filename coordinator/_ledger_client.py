"""The training controller's client for a model server's capture-ledger routes.

Every id list is validated and de-duplicated whole before any request goes out, so an invalid id
in what would be a later batch fails before the first batch is sent. Lists longer than
``MAX_LEDGER_BATCH`` are split; results are concatenated in batch order. Each request goes through
the same retrying boundary as ``ControlClient`` (``_retry.RetryingCaller``): bounded by
``request_timeout_s`` per attempt, a refusal typed by its code, and only transport failures and
retryable codes (``checkpoint_open``, say) tried again. Every ledger call is idempotent (a manifest
is a read; retire and delete of the same ids converge on the same state), so a repeat is safe.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
from tenacity.wait import wait_base

from protocols import (
    LEDGER_CONTROL_PREFIX,
    MAX_LEDGER_BATCH,
    RolloutManifest,
    RolloutRemoval,
    validate_ledger_key,
    validate_ledger_keys,
)

from ._retry import DEFAULT_CONTROL_ATTEMPTS, RetryingCaller, RetryPolicy


class LedgerClient:
    """Calls ``/training-token-capture/control`` on one model server.

    Args:
        base_url: The model server's root URL; a trailing ``/`` is ignored.
        capture_token: The bearer token of the ledger routes.
        request_timeout_s: Deadline of each attempt of a request, in seconds.
        batch_size: Most ids per request (at most ``MAX_LEDGER_BATCH``).
        transport: An httpx transport (tests pass ``httpx.ASGITransport``).
        attempts: How many times a retryable failure is tried in all.
        wait: The pause between attempts (a tenacity wait strategy).

    Raises:
        ValueError: Empty token, non-positive timeout, batch size out of range or fewer than one
            attempt.
    """

    def __init__(
        self,
        base_url: str,
        *,
        capture_token: str,
        request_timeout_s: float = 30.0,
        batch_size: int = MAX_LEDGER_BATCH,
        transport: httpx.AsyncBaseTransport | None = None,
        attempts: int = DEFAULT_CONTROL_ATTEMPTS,
        wait: wait_base | None = None,
    ) -> None:
        if not capture_token:
            raise ValueError("the ledger client needs a non-empty capture token")
        if not request_timeout_s > 0:
            raise ValueError("request_timeout_s must be positive")
        if not 1 <= batch_size <= MAX_LEDGER_BATCH:
            raise ValueError(f"batch_size must be between 1 and {MAX_LEDGER_BATCH}")
        policy = RetryPolicy.of(attempts, wait)
        self.base_url = base_url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.batch_size = batch_size
        self.attempts = attempts
        self._caller = RetryingCaller(
            self.base_url,
            prefix=LEDGER_CONTROL_PREFIX,
            token=capture_token,
            name="ledger control",
            policy=policy,
            transport=transport,
        )

    async def __aenter__(self) -> LedgerClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._caller.aclose()

    async def _send(self, method: str, path: str, body: Any = None) -> Any:
        return await self._caller.call(method, path, body, budget=lambda: self.request_timeout_s)

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        """The manifest of one capture key.

        The id is validated before the URL is built: dot segments would otherwise be normalized
        into another rollout's path.

        Raises:
            InvalidRolloutIdError: The id is invalid (nothing was sent).
            RolloutRetiredError: The key is retired (HTTP 410).
            ValueError: The server answered with another rollout's manifest.
            WireError: Any other refusal, typed by its code (a retryable one only once the
                attempts are used up).
            TimeoutError: An attempt got no reply within ``request_timeout_s``.
        """
        key = validate_ledger_key(rollout_id)
        payload = await self._send("GET", f"/rollouts/{key}/manifest")
        manifest = RolloutManifest.model_validate(payload)
        if manifest.rollout_id != key:
            raise ValueError(
                f"asked for the manifest of {key!r} but received the one of {manifest.rollout_id!r}"
            )
        return manifest

    async def _batched(self, action: str, rollout_ids: Sequence[str]) -> RolloutRemoval:
        keys = validate_ledger_keys(rollout_ids)
        removed: list[str] = []
        absent: list[str] = []
        for start in range(0, len(keys), self.batch_size):
            batch = keys[start : start + self.batch_size]
            payload = await self._send("POST", f"/rollouts/{action}", {"rollout_ids": batch})
            result = RolloutRemoval.model_validate(payload)
            removed.extend(result.removed)
            absent.extend(result.absent)
        return RolloutRemoval(removed=removed, absent=absent)

    async def retire(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Retire capture ledgers, in batches; an empty list sends nothing.

        Raises:
            TypeError: A bare string was passed.
            InvalidRolloutIdError: Any id is invalid (nothing was sent).
            WireError: A batch was refused, after its retries where the code is retryable
                (earlier batches stay applied; retrying the same list is safe, both operations
                are idempotent). A batch whose first reply was lost and was sent again reports
                the keys that first attempt removed as ``absent``.
        """
        return await self._batched("retire", rollout_ids)

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Delete capture ledgers and fences, in batches; see ``retire``."""
        return await self._batched("delete", rollout_ids)
