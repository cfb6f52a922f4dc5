"""The training controller's client for a model server's capture-ledger routes.

Every id list is validated and de-duplicated whole before any request goes out, so an invalid id
in what would be a later batch fails before the first batch is sent. Lists longer than
``MAX_LEDGER_BATCH`` are split; results are concatenated in batch order.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import httpx

from protocols import (
    LEDGER_CONTROL_PREFIX,
    MAX_LEDGER_BATCH,
    RolloutManifest,
    RolloutRemoval,
    error_from_envelope,
    validate_ledger_key,
    validate_ledger_keys,
)


class LedgerClient:
    """Calls ``/training-token-capture/control`` on one model server.

    Args:
        base_url: The model server's root URL; a trailing ``/`` is ignored.
        capture_token: The bearer token of the ledger routes.
        request_timeout_s: Deadline of each request, in seconds.
        batch_size: Most ids per request (at most ``MAX_LEDGER_BATCH``).
        transport: An httpx transport (tests pass ``httpx.ASGITransport``).

    Raises:
        ValueError: Empty token, non-positive timeout or batch size out of range.
    """

    def __init__(
        self,
        base_url: str,
        *,
        capture_token: str,
        request_timeout_s: float = 30.0,
        batch_size: int = MAX_LEDGER_BATCH,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        if not capture_token:
            raise ValueError("the ledger client needs a non-empty capture token")
        if not request_timeout_s > 0:
            raise ValueError("request_timeout_s must be positive")
        if not 1 <= batch_size <= MAX_LEDGER_BATCH:
            raise ValueError(f"batch_size must be between 1 and {MAX_LEDGER_BATCH}")
        self.base_url = base_url.rstrip("/")
        self.request_timeout_s = request_timeout_s
        self.batch_size = batch_size
        self._client = httpx.AsyncClient(
            base_url=self.base_url + LEDGER_CONTROL_PREFIX,
            headers={"authorization": f"Bearer {capture_token}"},
            transport=transport,
            timeout=request_timeout_s,
        )

    async def __aenter__(self) -> LedgerClient:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    async def _send(self, method: str, path: str, body: Any = None) -> Any:
        try:
            with anyio.fail_after(self.request_timeout_s):
                reply = await self._client.request(method, path, json=body)
        except TimeoutError:
            raise TimeoutError(
                f"ledger control request {method} {path} exceeded {self.request_timeout_s}s"
            ) from None
        try:
            payload = reply.json()
        except ValueError:
            payload = reply.text
        if reply.status_code != 200:
            raise error_from_envelope(reply.status_code, payload)
        return payload

    async def manifest(self, rollout_id: str) -> RolloutManifest:
        """The manifest of one capture key.

        The id is validated before the URL is built: dot segments would otherwise be normalized
        into another rollout's path.

        Raises:
            InvalidRolloutIdError: The id is invalid (nothing was sent).
            RolloutRetiredError: The key is retired (HTTP 410).
            ValueError: The server answered with another rollout's manifest.
            WireError: Any other refusal, typed by its code.
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
            WireError: A batch was refused (earlier batches stay applied; retrying the
                same list is safe, both operations are idempotent).
        """
        return await self._batched("retire", rollout_ids)

    async def delete(self, rollout_ids: Sequence[str]) -> RolloutRemoval:
        """Delete capture ledgers and fences, in batches; see ``retire``."""
        return await self._batched("delete", rollout_ids)
