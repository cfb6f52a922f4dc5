"""The worker's generation-cut round at real context lengths (``midflight bench cuts``).

The other suites park calls with a 44-token prompt, so they measure what a cut costs per call
and never what it costs per token. A real rollout's call carries thousands: a long system
prompt, a multi-turn history, a reasoning trace. This suite builds ``calls`` live calls on one
worker engine, each a root call whose prompt holds ``prompt_tokens`` tokens and which has
generated ``generated`` tokens, and runs cut rounds through the engine's own ``cut`` — the
batches of ``CUT_BATCH`` calls, one staging segment each, the cut deadline — with nothing else
running. With ``parent_tokens`` each call is a later turn instead (``token_in``): its parent's
sequence comes before its own prompt, as in a multi-turn conversation, so its records carry
only its own tokens while their cumulative hashes cover the parent's too. Round 1 stages every
call's cumulative record (its prompt past the parent and its generated tokens); before each
later round every call generates ``chunk`` more tokens, so the round stages chunks and answers
each call's receipt with the digest of its whole staged prefix, as checkpoints minutes apart
would.

Each round reports its wall time, the process CPU it took, the CPU per call and per token in
flight, how many calls it cut and how many missed the deadline (``cut_failed``). The floor is the
bytes the round added to the staging directory, written again with one
``open``/``write``/``fsync``/``close`` per file, right after the round.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any, Final

import anyio

from participants import FileTokenStagingStore
from protocols import (
    CaptureAdmission,
    GenerationCutInventory,
    GenerationCutPrefix,
    compute_chain_hash,
)

from .._servers.evidence import EvidenceLog
from .._worker.cuts import LiveCall
from .._worker.engine import WorkerEngine
from .._worker.engine_api import GenerationRequest
from .common import files_under, ratio, stage, write_floor

CALLS: Final = (256, 1024, 4096)
PROMPT_TOKENS: Final = 2048
GENERATED_TOKENS: Final = 512
CHUNK_TOKENS: Final = 64
ROUNDS: Final = 2
VOCABULARY: Final = 151_936
"""Token ids are drawn below this (a current open model's vocabulary size); an id's size does not
change what it costs, every id is encoded as a u64."""
LOG_PROB: Final = -1.25


def _live_calls(
    engine: WorkerEngine, calls: int, *, prompt_tokens: int, generated: int, parent_tokens: int = 0
) -> None:
    """``calls`` admitted calls on ``engine``, each with its prompt and generated tokens.

    With ``parent_tokens`` each is a later turn of a conversation (a ``token_in`` call): its
    parent's whole sequence, ``parent_tokens`` long, comes before its own prompt, and its cut
    records hold only its own tokens while their cumulative hashes cover the parent's too.
    """
    rng = random.Random(calls)  # noqa: S311 - reproducible token ids, not secrets
    for index in range(calls):
        parent = [rng.randrange(VOCABULARY) for _ in range(parent_tokens)]
        if parent:
            admission = CaptureAdmission(
                rollout_id=f"r{index:06d}",
                model_call_id=f"call-{index:06d}",
                parent_call_id=f"parent-{index:06d}",
                prev_len=len(parent),
                mode="token_in",
                required_prefix_token_ids=parent,
                parent_chain_hash=compute_chain_hash(None, parent),
            )
        else:
            admission = CaptureAdmission(
                rollout_id=f"r{index:06d}", model_call_id=f"call-{index:06d}", mode="text"
            )
        prompt = parent + [rng.randrange(VOCABULARY) for _ in range(prompt_tokens)]
        live = LiveCall(
            call=engine.capture.begin_call(admission, weight_version=0),
            generation=GenerationRequest(
                prompt_token_ids=tuple(prompt), max_tokens=generated + 1_000_000
            ),
            engine_prompt=prompt,
            max_tokens=generated + 1_000_000,
            continued=0,
        )
        for _ in range(generated):
            live.append(rng.randrange(VOCABULARY), LOG_PROB)
        engine.live[admission.model_call_id] = live


def _inventory(engine: WorkerEngine, checkpoint_id: str) -> GenerationCutInventory:
    prefixes = [
        GenerationCutPrefix(
            ticket_id=f"ticket-{call_id}",
            rollout_id=live.call.rollout_id,
            attempt=0,
            model_call_id=call_id,
            admitted_at=1.0,
        )
        for call_id, live in engine.live.items()
    ]
    return GenerationCutInventory.build(
        checkpoint_id=checkpoint_id, server_name="bench", active_prefixes=prefixes
    )


async def _measure_size(
    root: Path,
    calls: int,
    *,
    prompt_tokens: int,
    generated: int,
    chunk: int,
    rounds: int,
    cut_timeout_ms: float,
    parent_tokens: int,
) -> list[dict[str, Any]]:
    staging = root / "staging"
    engine = WorkerEngine(
        store=FileTokenStagingStore(staging),
        evidence=EvidenceLog(root / "evidence.jsonl"),
        cut_timeout_ms=cut_timeout_ms,
    )
    stage(f"{calls:,} calls · admitting, {parent_tokens + prompt_tokens:,} prompt tokens each")
    _live_calls(
        engine,
        calls,
        prompt_tokens=prompt_tokens,
        generated=generated,
        parent_tokens=parent_tokens,
    )
    rows: list[dict[str, Any]] = []
    for round_number in range(1, rounds + 1):
        if round_number > 1:
            for live in engine.live.values():  # decoding went on since the last round
                for token in range(chunk):
                    live.append(token, LOG_PROB)
        per_call = parent_tokens + prompt_tokens + len(next(iter(engine.live.values())).generated)
        inventory = _inventory(engine, f"bench-cuts-{calls}-{round_number}")
        stage(f"{calls:,} calls · round {round_number} of {rounds}")
        before = set(files_under(staging))
        cpu, started = time.process_time(), time.perf_counter()
        receipt = await engine.cut(inventory)
        round_s, cpu_s = time.perf_counter() - started, time.process_time() - cpu
        durable = sum(1 for ack in receipt.prefixes if ack.disposition == "durable_prefix")
        written = {str(p): p.read_bytes() for p in files_under(staging) if p not in before}
        floor_s = write_floor(written, root / "floor" / f"{calls}-{round_number}")
        tokens = calls * per_call
        rows.append(
            {
                "calls": calls,
                "round": round_number,
                "staged": "cumulative" if round_number == 1 else "chunk",
                "tokens_per_call": per_call,
                "tokens_in_flight": tokens,
                "cut": durable,
                "cut_failed": calls - durable,
                "round_s": round(round_s, 4),
                "cpu_s": round(cpu_s, 4),
                "us_per_call": round(cpu_s / calls * 1e6, 1),
                "ns_per_token": round(cpu_s / tokens * 1e9, 1),
                "bytes_written": sum(len(data) for data in written.values()),
                "floor_s": round(floor_s, 4),
                "ratio": ratio(round_s, floor_s),
            }
        )
    return rows


def run_cuts_bench(
    directory: Path,
    *,
    calls: list[int],
    prompt_tokens: int = PROMPT_TOKENS,
    generated: int = GENERATED_TOKENS,
    chunk: int = CHUNK_TOKENS,
    rounds: int = ROUNDS,
    cut_timeout_ms: float = 5000.0,
    parent_tokens: int = 0,
) -> dict[str, Any]:
    """Every size's rounds, each beside its floor (one fresh worker engine per size).

    Args:
        directory: An empty scratch directory on the disk to measure.
        calls: Live calls per size.
        prompt_tokens: Prompt tokens of each call (past its parent's, with ``parent_tokens``).
        generated: Tokens each call has generated when round 1 runs.
        chunk: Tokens each call generates before each later round.
        rounds: Cut rounds per size.
        cut_timeout_ms: The worker's cut deadline (``serve worker --cut-timeout-ms``).
        parent_tokens: With more than 0, every call is a later turn whose parent's sequence
            holds this many tokens (a ``token_in`` call); 0 makes root calls.
    """
    if prompt_tokens < 1 or generated < 0 or chunk < 1 or rounds < 1 or not calls:
        raise ValueError("prompt_tokens, chunk, rounds and calls must be positive")
    if parent_tokens < 0:
        raise ValueError("parent_tokens must not be negative")

    async def main() -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        for size in calls:
            rows += await _measure_size(
                directory / str(size),
                size,
                prompt_tokens=prompt_tokens,
                generated=generated,
                chunk=chunk,
                rounds=rounds,
                cut_timeout_ms=cut_timeout_ms,
                parent_tokens=parent_tokens,
            )
        return rows

    return {
        "parent_tokens": parent_tokens,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "chunk_tokens": chunk,
        "rounds": rounds,
        "cut_timeout_ms": cut_timeout_ms,
        "rows": anyio.run(main),
    }
