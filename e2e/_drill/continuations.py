"""The continued generation cuts of a drill run, rebuilt from the staging store, and what a real
engine's continuations must satisfy.

A continued call is a worker ``generation`` event with ``tokens_continued > 0``. Its durable cut is
named by a restored checkpoint (the model records' ``generation_cuts``) and rebuilt from the staged
cut records; its completion is the mask-1 part of its own staged record; its prompt is the staged
chain of its parents plus the mask-0 part of its record. The worker's evidence only says which
staging keys to read: every token compared here is read from the store.

- ``prefix_mismatches`` (every engine, an error figure): continued calls whose completion does not
  start with their durable prefix, unchanged.
- ``continuation_redecode_mismatches`` (model engines): continued calls whose tokens after the
  prefix are not what the model decodes alone from prompt + prefix; an error figure in the
  argmax-stable ``float64`` setting.
- ``continuation_divergence`` (model engines, reported): continued calls whose completion is not
  what the uninterrupted call decodes from the prompt alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from participants import FileTokenStagingStore, read_participant_checkpoint, rebuild_generation_cut
from protocols import EpisodeId, StagedCallRecord

from .._servers.evidence import read_evidence
from .store import model_shares


@dataclass(frozen=True)
class ContinuedCall:
    """One continued cut as the store holds it.

    Attributes:
        capture_key: The continuing attempt's capture key.
        prompt: The call's prompt (every token before its completion).
        prefix: The durable prefix the cut handed over (generated tokens only).
        completion: The call's generated tokens, the prefix included.
        max_tokens: The call's output limit (``None`` when the worker did not record it).
    """

    capture_key: str
    prompt: list[int]
    prefix: list[int]
    completion: list[int]
    max_tokens: int | None

    @property
    def prefix_kept(self) -> bool:
        """Whether the completion starts with the prefix, unchanged."""
        return self.completion[: len(self.prefix)] == self.prefix


def _split(record: StagedCallRecord) -> tuple[list[int], list[int]]:
    """A record's delta as (prompt tokens, generated tokens), by mask."""
    prompt: list[int] = []
    generated: list[int] = []
    for token, mask in zip(record.token_ids_delta, record.token_mask_delta, strict=True):
        (generated if mask else prompt).append(token)
    return prompt, generated


def cut_continuations(checkpoint_dir: Path | str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """(target capture key, continuation) of every generation cut a checkpoint's model records
    hand to the restored attempt."""
    for location in model_shares(checkpoint_dir):
        share = read_participant_checkpoint(
            location, kind="model", instance=str(location).rsplit("/", 1)[-1]
        )
        for record in share.records:
            target = EpisodeId.model_validate(record["episode_id"]).next_attempt().capture_key
            for cut in record.get("generation_cuts", []):
                yield target, cut["continuation"]


def _cut_keys(driver: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], list[str]]:
    """(target capture key, source model call id) → the staging keys of the cut a restore handed
    over, from every restored checkpoint."""
    keys: dict[tuple[str, str], list[str]] = {}
    for restore in driver:
        if restore.get("event") == "restore":
            for target, continuation in cut_continuations(restore["checkpoint_dir"]):
                source = continuation["source_model_call_id"]
                keys[(target, source)] = list(continuation["staging_keys"])
    return keys


def continued_calls(run_root: Path) -> list[ContinuedCall]:
    """Every continued cut of the run whose records the store still holds."""
    driver = read_evidence(run_root / "evidence" / "driver.jsonl")
    worker = read_evidence(run_root / "evidence" / "worker.jsonl")
    store = FileTokenStagingStore(run_root / "staging")
    generations = [e for e in worker if e.get("event") == "generation"]
    final_keys = {e["model_call_id"]: e["staging_key"] for e in generations}
    cut_keys = _cut_keys(driver)

    def record(key: str) -> StagedCallRecord | None:
        entry = store.get(key)
        return None if entry is None else entry.record

    def tokens_before(parent: str | None, length: int) -> list[int] | None:
        chain: list[StagedCallRecord] = []
        while parent is not None:
            parent_record = record(final_keys.get(parent, ""))
            if parent_record is None:
                return None
            chain.append(parent_record)
            parent = parent_record.parent_call_id
        tokens = [t for r in reversed(chain) for t in r.token_ids_delta]
        return tokens if len(tokens) == length else None

    calls: list[ContinuedCall] = []
    for event in generations:
        if not event.get("tokens_continued"):
            continue
        keys = cut_keys.get((event["capture_key"], event.get("continued_from") or ""))
        final = record(event["staging_key"])
        if keys is None or final is None:
            continue
        cut_records = [record(k) for k in keys]
        if any(r is None for r in cut_records):
            continue
        snapshot = rebuild_generation_cut([r for r in cut_records if r is not None])
        before = tokens_before(final.parent_call_id, final.prev_len)
        if before is None:
            continue
        carried, completion = _split(final)
        calls.append(
            ContinuedCall(
                capture_key=event["capture_key"],
                prompt=before + carried,
                prefix=_split(snapshot)[1],
                completion=completion,
                max_tokens=event.get("max_tokens"),
            )
        )
    return calls


def prefix_mismatches(calls: Sequence[ContinuedCall]) -> int:
    """Continued calls whose completion does not start with their durable prefix."""
    return sum(1 for call in calls if not call.prefix_kept)


def model_engine_figures(
    calls: Sequence[ContinuedCall], model: Path, engine: str, dtype: str
) -> dict[str, Any]:
    """Re-decode every continued call on ``model`` (the transformers engine, alone, in ``dtype``).

    Returns:
        ``continued_checked`` (calls re-decoded), ``continuation_redecode_mismatches``,
        ``continuation_divergence``, ``redecode_must_match`` (whether a re-decode mismatch fails
        the drill: the transformers engine in ``float64``) and the model's summary.
    """
    from .._worker.transformers_decode import DTYPES, LoadedModel, greedy_decode, model_summary

    loaded = LoadedModel(model, dtype if dtype in DTYPES else "float32")
    stops = loaded.stop_token_ids
    redecode = divergence = checked = 0
    for call in calls:
        limit = call.max_tokens
        if limit is None or not call.prefix_kept:
            continue  # a broken prefix is already a prefix mismatch; nothing to re-decode
        checked += 1
        after = call.completion[len(call.prefix) :]
        finished = bool(call.prefix) and call.prefix[-1] in stops  # answered from the prefix
        remaining = 0 if finished else limit - len(call.prefix)
        if greedy_decode(loaded, call.prompt + call.prefix, remaining, stops) != after:
            redecode += 1
        if greedy_decode(loaded, call.prompt, limit, stops) != call.completion:
            divergence += 1
    return {
        "continued_checked": checked,
        "continuation_redecode_mismatches": redecode,
        "continuation_divergence": divergence,
        "redecode_must_match": engine == "transformers" and dtype == "float64",
        "model": model_summary(loaded),
    }
