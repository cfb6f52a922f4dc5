"""The worker staging helpers: begin_call's checks (each pinned by its own test), the builders,
chunked cuts and their rebuild, and completion."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

import protocols._staging as staging_module
from participants import (
    ActiveCall,
    CaptureError,
    RolloutTokenCapture,
    StreamingUnsupportedError,
    rebuild_generation_cut,
)
from protocols import (
    CaptureAdmission,
    StagedCallRecord,
    StagedEntry,
    generation_cut_staging_key,
)
from tests.staging_factories import child_admission, continuation_of, root_admission, root_record

PARENT_PROMPT = [2, 117, 3, 104, 105, 4, 2, 97, 3]
PARENT_GENERATED = [120, 121, 122]
PARENT_TOKENS = PARENT_PROMPT + PARENT_GENERATED
CHILD_PROMPT = [*PARENT_TOKENS, 4, 2, 116, 3, 111, 107, 4, 2, 97, 3]
CUT_KEYS = [generation_cut_staging_key("c2", 1)]


class MemoryStore:
    """An in-memory TokenStagingStore."""

    def __init__(self) -> None:
        self.entries: dict[str, StagedEntry] = {}

    def put(self, entry: StagedEntry) -> None:
        self.entries[entry.staging_key] = entry

    def get(self, staging_key: str) -> StagedEntry | None:
        return self.entries.get(staging_key)

    def delete(self, staging_key: str) -> bool:
        return self.entries.pop(staging_key, None) is not None


def _capture(version: int = 0, **kwargs: Any) -> RolloutTokenCapture:
    return RolloutTokenCapture(MemoryStore(), weight_version_fn=lambda: version, **kwargs)


def _parent() -> StagedCallRecord:
    return root_record(PARENT_PROMPT, PARENT_GENERATED, model_call_id="c1")


def _cut_of_source(
    parent: StagedCallRecord | None = None,
    parent_tokens: list[int] = PARENT_TOKENS,
    *,
    version: int = 0,
    generated: tuple[int, ...] = (97, 98, 99),
) -> StagedCallRecord:
    """The cut snapshot of call c2 of capture key r1 (a child of c1), three tokens in."""
    parent = parent or _parent()
    capture = _capture(version)
    source = capture.begin_call(child_admission(parent, parent_tokens, model_call_id="c2"))
    return capture.build_prefix_record(
        source,
        prompt_token_ids=parent_tokens + CHILD_PROMPT[len(PARENT_TOKENS) :],
        generated_token_ids=list(generated),
        generated_logprobs=[-0.5] * len(generated),
    )


def _replacement(snapshot: StagedCallRecord, **continuation_changes: Any) -> CaptureAdmission:
    """Attempt 1's replacement of c2, continuing ``snapshot``."""
    return child_admission(
        _parent(),
        PARENT_TOKENS,
        rollout_id="r1-a1",
        model_call_id="c2-retry",
        generation_cut=continuation_of(snapshot, CUT_KEYS, **continuation_changes),
    )


def _begin(admission: CaptureAdmission, snapshot: StagedCallRecord, **kwargs: Any) -> ActiveCall:
    kwargs.setdefault("generation_cut_staging_keys", CUT_KEYS)
    return _capture().begin_call(admission, generation_cut=snapshot, **kwargs)


def test_a_valid_continuation_is_admitted() -> None:
    snapshot = _cut_of_source()
    call = _begin(_replacement(snapshot), snapshot)
    assert call.generation_cut == snapshot
    assert call.prefix_token_ids == PARENT_TOKENS


# --- begin_call: one test per check of a continued cut ----------------------------------------


def test_begin_call_rejects_wrong_staging_keys() -> None:
    snapshot = _cut_of_source()
    with pytest.raises(CaptureError, match="other staging keys"):
        _begin(
            _replacement(snapshot),
            snapshot,
            generation_cut_staging_keys=["__generation_cut__/c2/9"],
        )


def test_begin_call_rejects_a_wrong_source_call() -> None:
    snapshot = _cut_of_source()
    admission = _replacement(snapshot, source_model_call_id="c7")
    with pytest.raises(CaptureError, match="another source call"):
        _begin(admission, snapshot)


def test_begin_call_rejects_a_wrong_source_capture_key() -> None:
    snapshot = _cut_of_source()
    admission = _replacement(snapshot, source_capture_key="r9")
    with pytest.raises(CaptureError, match="another source call"):
        _begin(admission, snapshot)


def test_begin_call_rejects_a_wrong_digest() -> None:
    snapshot = _cut_of_source()
    admission = _replacement(snapshot, prefix_digest=_parent().digest)
    with pytest.raises(CaptureError, match="digest differs"):
        _begin(admission, snapshot)


def test_begin_call_rejects_a_lineage_mismatch() -> None:
    snapshot = _cut_of_source()
    admission = _replacement(snapshot).model_copy(update={"parent_call_id": "c1-renamed"})
    with pytest.raises(CaptureError, match="lineage"):
        _begin(admission, snapshot)


def test_begin_call_rejects_a_wrong_generated_token_count() -> None:
    snapshot = _cut_of_source()
    admission = _replacement(snapshot, prefix_token_count=snapshot.generated_token_count + 1)
    with pytest.raises(CaptureError, match="generated tokens"):
        _begin(admission, snapshot)


def test_begin_call_rejects_a_newer_policy_version() -> None:
    snapshot = _cut_of_source(version=5)
    admission = _replacement(snapshot)
    _capture(5).begin_call(admission, generation_cut=snapshot, generation_cut_staging_keys=CUT_KEYS)
    with pytest.raises(CaptureError, match="newer"):
        _capture(4).begin_call(
            admission, generation_cut=snapshot, generation_cut_staging_keys=CUT_KEYS
        )


def test_begin_call_rejects_a_prefix_built_on_other_parent_tokens() -> None:
    # Another parent with the same call id and the same length, but other tokens.
    impostor_generated = [110, 111, 112]
    impostor = root_record(PARENT_PROMPT, impostor_generated, model_call_id="c1")
    impostor_tokens = PARENT_PROMPT + impostor_generated
    snapshot = _cut_of_source(impostor, impostor_tokens)
    assert (snapshot.parent_call_id, snapshot.prev_len) == ("c1", len(PARENT_TOKENS))
    with pytest.raises(CaptureError, match="other parent tokens"):
        _begin(_replacement(snapshot), snapshot)


# --- begin_call: the admission and its prefix -------------------------------------------------


def test_begin_call_resolves_prefixes() -> None:
    capture = _capture(3)
    root = capture.begin_call(root_admission())
    assert root.prefix_token_ids == [] and root.weight_version == 3
    child = capture.begin_call(child_admission(_parent(), PARENT_TOKENS), weight_version=9)
    assert child.prefix_token_ids == PARENT_TOKENS and child.weight_version == 9
    chained = CaptureAdmission(
        rollout_id="r1",
        model_call_id="c2",
        parent_call_id="c1",
        prev_len=len(PARENT_TOKENS),
        mode="token_in",
        staging_chain=["r1/c1"],
        parent_chain_hash=_parent().chain_hash,
    )
    assert (
        capture.begin_call(chained, prefix_token_ids=PARENT_TOKENS).prefix_token_ids
        == PARENT_TOKENS
    )


@pytest.mark.parametrize(
    ("admission", "kwargs", "message"),
    [
        (root_admission(), {"prefix_token_ids": [1]}, "takes no prefix"),
        (child_admission(_parent(), PARENT_TOKENS), {"prefix_token_ids": [1]}, "prev_len"),
        (child_admission(_parent(), PARENT_TOKENS), {"prefix_token_ids": [0] * 12}, "disagrees"),
        (
            child_admission(_parent(), PARENT_TOKENS),
            {"prefix_token_ids": [-1] * 12},
            "non-negative",
        ),
        (
            CaptureAdmission(
                rollout_id="r1",
                model_call_id="c2",
                parent_call_id="c1",
                prev_len=12,
                mode="token_in",
                staging_chain=["r1/c1"],
                parent_chain_hash=_parent().chain_hash,
            ),
            {},
            "resolved prefix",
        ),
        (root_admission(), {"weight_version": -1}, "policy version"),
    ],
)
def test_begin_call_refuses_a_bad_prefix_or_version(
    admission: CaptureAdmission, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(CaptureError, match=message):
        _capture().begin_call(admission, **kwargs)


def test_begin_call_refuses_types_streams_and_unpaired_cuts() -> None:
    with pytest.raises(TypeError):
        _capture().begin_call(root_admission().model_dump())  # type: ignore[arg-type]
    with pytest.raises(StreamingUnsupportedError):
        _capture().begin_call(root_admission(), stream=True)
    with pytest.raises(CaptureError, match="policy version"):
        RolloutTokenCapture(MemoryStore(), weight_version_fn=lambda: "1").begin_call(  # type: ignore[arg-type, return-value]
            root_admission()
        )
    snapshot = _cut_of_source()
    with pytest.raises(CaptureError, match="no snapshot"):
        _capture().begin_call(_replacement(snapshot))
    with pytest.raises(CaptureError, match="does not authorize"):
        _capture().begin_call(
            child_admission(_parent(), PARENT_TOKENS),
            generation_cut=snapshot,
            generation_cut_staging_keys=CUT_KEYS,
        )


# --- builders ---------------------------------------------------------------------------------


def test_build_prefix_record_of_a_child() -> None:
    capture = _capture()
    call = capture.begin_call(child_admission(_parent(), PARENT_TOKENS))
    record = capture.build_prefix_record(
        call, prompt_token_ids=CHILD_PROMPT, generated_token_ids=[97], generated_logprobs=[-1.5]
    )
    carried = CHILD_PROMPT[len(PARENT_TOKENS) :]
    assert record.token_ids_delta == [*carried, 97]
    assert record.token_mask_delta == [0.0] * len(carried) + [1.0]
    assert record.prev_len == 12 and record.cum_len == len(CHILD_PROMPT) + 1
    assert StagedCallRecord.model_validate(record.model_dump()) == record
    with pytest.raises(ValueError, match="authorized token prefix"):
        capture.build_prefix_record(
            call, prompt_token_ids=[0] * 20, generated_token_ids=[], generated_logprobs=[]
        )
    with pytest.raises(ValueError, match="equal lengths"):
        capture.build_prefix_record(
            call, prompt_token_ids=CHILD_PROMPT, generated_token_ids=[1], generated_logprobs=[]
        )


def test_a_continued_call_stages_the_cut_then_the_rest_at_the_oldest_version() -> None:
    snapshot = _cut_of_source(version=2)
    capture = _capture(5)
    call = capture.begin_call(
        _replacement(snapshot), generation_cut=snapshot, generation_cut_staging_keys=CUT_KEYS
    )
    engine_prompt = PARENT_TOKENS + snapshot.token_ids_delta
    record = capture.build_prefix_record(
        call, prompt_token_ids=engine_prompt, generated_token_ids=[100], generated_logprobs=[-0.5]
    )
    assert record.token_ids_delta == [*snapshot.token_ids_delta, 100]
    assert record.token_mask_delta == [*snapshot.token_mask_delta, 1.0]
    assert record.weight_version == 2
    assert record.rollout_id == "r1-a1" and record.model_call_id == "c2-retry"
    with pytest.raises(ValueError, match="cut's tokens"):
        capture.build_prefix_record(
            call,
            prompt_token_ids=CHILD_PROMPT,
            generated_token_ids=[100],
            generated_logprobs=[-0.5],
        )


@given(st.lists(st.integers(97, 122), min_size=3, max_size=30), st.data())
def test_chunks_rebuild_into_the_cumulative_snapshot(
    generated: list[int], data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.sets(st.integers(1, len(generated) - 1), min_size=1, max_size=4)))
    capture = _capture()
    call = capture.begin_call(child_admission(_parent(), PARENT_TOKENS))
    log_probs = [-0.5] * len(generated)
    staged = [
        capture.build_prefix_record(
            call,
            prompt_token_ids=CHILD_PROMPT,
            generated_token_ids=generated[: cuts[0]],
            generated_logprobs=log_probs[: cuts[0]],
        )
    ]
    for start, stop in zip(cuts, [*cuts[1:], len(generated)], strict=True):
        chunk = capture.build_generation_chunk_record(
            call,
            staged=staged,
            generated_token_ids=generated[start:stop],
            generated_logprobs=log_probs[start:stop],
        )
        assert chunk.token_mask_delta == [1.0] * (stop - start)
        staged.append(chunk)
    whole = capture.build_prefix_record(
        call,
        prompt_token_ids=CHILD_PROMPT,
        generated_token_ids=generated,
        generated_logprobs=log_probs,
    )
    rebuilt = rebuild_generation_cut(staged)
    assert rebuilt == whole
    # Each chunk's hashes are those of the whole prefix through it, on the call's own parent.
    assert staged[-1].chain_hash == whole.chain_hash
    assert staged[-1].cumulative_hash == whole.cumulative_hash


def test_chunk_builder_refusals() -> None:
    capture = _capture()
    call = capture.begin_call(child_admission(_parent(), PARENT_TOKENS))
    first = capture.build_prefix_record(
        call, prompt_token_ids=CHILD_PROMPT, generated_token_ids=[97], generated_logprobs=[-0.5]
    )
    with pytest.raises(ValueError, match="at least one"):
        capture.build_generation_chunk_record(
            call, staged=[first], generated_token_ids=[], generated_logprobs=[]
        )
    with pytest.raises(ValueError, match="equal lengths"):
        capture.build_generation_chunk_record(
            call, staged=[first], generated_token_ids=[1], generated_logprobs=[]
        )
    with pytest.raises(ValueError, match="cumulative record"):
        capture.build_generation_chunk_record(
            call, staged=[], generated_token_ids=[1], generated_logprobs=[-0.5]
        )
    with pytest.raises(ValueError, match="another call"):
        capture.build_generation_chunk_record(
            call, staged=[_parent()], generated_token_ids=[1], generated_logprobs=[-0.5]
        )


def test_rebuild_refuses_what_is_not_one_calls_prefix() -> None:
    capture = _capture()
    call = capture.begin_call(child_admission(_parent(), PARENT_TOKENS))
    first = capture.build_prefix_record(
        call, prompt_token_ids=CHILD_PROMPT, generated_token_ids=[97], generated_logprobs=[-0.5]
    )
    chunk = capture.build_generation_chunk_record(
        call, staged=[first], generated_token_ids=[98], generated_logprobs=[-0.5]
    )
    assert rebuild_generation_cut([first]) is first
    with pytest.raises(ValueError, match="at least one"):
        rebuild_generation_cut([])
    with pytest.raises(ValueError, match="another call"):
        rebuild_generation_cut([first, _parent()])
    with pytest.raises(ValueError, match="prompt tokens"):
        rebuild_generation_cut([first, first])
    older = _capture(0)
    newer_call = _capture(3).begin_call(child_admission(_parent(), PARENT_TOKENS))
    newer_first = older.build_prefix_record(
        newer_call,
        prompt_token_ids=CHILD_PROMPT,
        generated_token_ids=[97],
        generated_logprobs=[-0.5],
    )
    old_chunk = older.build_generation_chunk_record(
        call, staged=[first], generated_token_ids=[98], generated_logprobs=[-0.5]
    )
    with pytest.raises(ValueError, match="older policy version"):
        rebuild_generation_cut([newer_first, old_chunk])
    assert rebuild_generation_cut([first, chunk]).generated_token_count == 2


# --- completion -------------------------------------------------------------------------------


def test_complete_call_stages_before_answering_coordinates() -> None:
    store = MemoryStore()
    capture = RolloutTokenCapture(store)
    call = capture.begin_call(root_admission())
    coords = capture.complete_call(
        call,
        prompt_token_ids=PARENT_PROMPT,
        generated_token_ids=PARENT_GENERATED,
        generated_logprobs=[-0.5] * 3,
        attachments={"engine": "deterministic"},
    )
    assert coords.disposition == "staged" and coords.staging_key == "r1/c1"
    entry = store.entries["r1/c1"]
    assert entry.attachments == {"engine": "deterministic"}
    assert (coords.digest, coords.chain_hash, coords.cumulative_hash) == (
        entry.record.digest,
        entry.record.chain_hash,
        entry.record.cumulative_hash,
    )
    assert entry.record.token_ids_delta == PARENT_TOKENS
    assert entry.record.token_mask_delta == [0.0] * len(PARENT_PROMPT) + [1.0] * 3
    with pytest.raises(CaptureError, match="already completed"):
        capture.complete_call(
            call, prompt_token_ids=PARENT_PROMPT, generated_token_ids=[], generated_logprobs=[]
        )


def test_a_record_that_cannot_be_built_fails_the_capture_not_the_call() -> None:
    capture = _capture()
    call = capture.begin_call(child_admission(_parent(), PARENT_TOKENS))
    coords = capture.complete_call(
        call, prompt_token_ids=[0] * 20, generated_token_ids=[1], generated_logprobs=[-0.5]
    )
    assert coords.disposition == "capture_failed" and coords.delta_len == 0
    assert coords.cum_len == coords.prev_len == 12
    assert call.completed


def test_a_failing_store_fails_the_capture_not_the_call() -> None:
    class BrokenStore(MemoryStore):
        def put(self, entry: StagedEntry) -> None:
            raise OSError("disk full")

    capture = RolloutTokenCapture(BrokenStore())
    call = capture.begin_call(root_admission())
    coords = capture.complete_call(
        call, prompt_token_ids=PARENT_PROMPT, generated_token_ids=[1], generated_logprobs=[-0.5]
    )
    assert coords.disposition == "capture_failed"


class DictAdapter:
    def extract_prompt_ids(self, response: dict[str, Any]) -> list[int]:
        return list(response["prompt"])

    def extract_generation(self, response: dict[str, Any]) -> tuple[list[int], list[float]]:
        return list(response["ids"]), [-0.5] * len(response["ids"])

    def extract_extras(self, response: dict[str, Any]) -> dict[str, Any] | None:
        return response.get("extras")


def test_complete_call_from_response_and_fail_call() -> None:
    store = MemoryStore()
    capture = RolloutTokenCapture(store, adapter=DictAdapter())
    call = capture.begin_call(root_admission())
    coords = capture.complete_call_from_response(
        call, {"prompt": PARENT_PROMPT, "ids": [97], "extras": {"k": 1}}
    )
    assert coords.disposition == "staged"
    assert store.entries["r1/c1"].record.extras == {"k": 1}
    broken = capture.begin_call(root_admission(model_call_id="c9"))
    assert capture.complete_call_from_response(broken, {}).disposition == "capture_failed"
    assert broken.completed
    failed = capture.begin_call(root_admission(model_call_id="c10"))
    assert capture.fail_call(failed).disposition == "capture_failed"
    with pytest.raises(CaptureError, match="already completed"):
        capture.fail_call(failed)
    with pytest.raises(CaptureError, match="CaptureAdapter"):
        _capture().complete_call_from_response(call, {})


def test_each_builder_computes_its_digest_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    original = staging_module._staging_digest_blocks

    def counting(**fields: Any) -> tuple[str, bytes, bytes, bytes]:
        calls.append(fields["model_call_id"])
        return original(**fields)

    capture = _capture()
    call = capture.begin_call(child_admission(_parent(), PARENT_TOKENS))
    monkeypatch.setattr(staging_module, "_staging_digest_blocks", counting)
    first = capture.build_prefix_record(
        call, prompt_token_ids=CHILD_PROMPT, generated_token_ids=[97], generated_logprobs=[-0.5]
    )
    assert len(calls) == 1
    capture.build_generation_chunk_record(
        call, staged=[first], generated_token_ids=[98], generated_logprobs=[-0.5]
    )
    assert len(calls) == 2
    capture.complete_call(
        call, prompt_token_ids=CHILD_PROMPT, generated_token_ids=[97], generated_logprobs=[-0.5]
    )
    assert len(calls) == 3
