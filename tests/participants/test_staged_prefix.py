"""``protocols.StagedPrefix``: a call's cut records with their columns encoded once (D420).

Its digest and a next chunk's hashes must be byte for byte those of the joined records, which
``rebuild_generation_cut`` and the whole call's record compute from plain token lists.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from participants import ActiveCall, RolloutTokenCapture, rebuild_generation_cut
from protocols import (
    StagedCallRecord,
    StagedPrefix,
    compute_chain_hash,
    hash_token_ids,
)
from protocols._hashes import encode_float32_elements, encode_token_elements, encode_token_ids
from tests.participants.test_worker_calls import (
    CHILD_PROMPT,
    PARENT_TOKENS,
    MemoryStore,
    _parent,
)
from tests.staging_factories import child_admission, root_admission

IDS = st.integers(0, 2**64 - 1)


def _call(capture: RolloutTokenCapture, *, child: bool) -> tuple[ActiveCall, list[int]]:
    if child:
        return capture.begin_call(child_admission(_parent(), PARENT_TOKENS)), CHILD_PROMPT
    return capture.begin_call(root_admission()), [7, 8, 9]


@settings(max_examples=60)
@given(
    st.booleans(),
    st.lists(IDS, min_size=2, max_size=40),
    st.lists(st.floats(-30.0, 0.0, width=32), min_size=40, max_size=40),
    st.data(),
)
def test_each_chunk_and_digest_from_the_prefix_are_those_of_the_joined_records(
    child: bool, generated: list[int], log_probs: list[float], data: st.DataObject
) -> None:
    capture = RolloutTokenCapture(MemoryStore())
    call, prompt = _call(capture, child=child)
    log_probs = log_probs[: len(generated)]
    cuts = sorted(data.draw(st.sets(st.integers(1, len(generated) - 1), min_size=1, max_size=4)))
    first = capture.build_prefix_record(
        call,
        prompt_token_ids=prompt,
        generated_token_ids=generated[: cuts[0]],
        generated_logprobs=log_probs[: cuts[0]],
    )
    records = [first]
    prefix = capture.staged_prefix(call).extended(first)
    assert prefix.digest == first.digest
    for start, stop in zip(cuts, [*cuts[1:], len(generated)], strict=True):
        chunk = capture.build_generation_chunk_record(
            call,
            staged=prefix,
            generated_token_ids=generated[start:stop],
            generated_logprobs=log_probs[start:stop],
        )
        from_list = capture.build_generation_chunk_record(
            call,
            staged=records,
            generated_token_ids=generated[start:stop],
            generated_logprobs=log_probs[start:stop],
        )
        assert chunk == from_list
        records.append(chunk)
        prefix = prefix.extended(chunk)
        assert prefix.records == tuple(records)
        assert prefix.digest == rebuild_generation_cut(records).digest
    whole = capture.build_prefix_record(
        call, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=log_probs
    )
    assert prefix.digest == whole.digest
    assert (records[-1].chain_hash, records[-1].cumulative_hash) == (
        whole.chain_hash,
        whole.cumulative_hash,
    )


@given(st.lists(IDS, max_size=30), st.lists(IDS, max_size=30))
def test_chunk_hashes_hash_the_parent_the_staged_tokens_and_the_new_ones(
    staged_tokens: list[int], new_tokens: list[int]
) -> None:
    capture = RolloutTokenCapture(MemoryStore())
    call, prompt = _call(capture, child=True)
    prefix = capture.staged_prefix(call)
    if staged_tokens:
        first = capture.build_prefix_record(
            call,
            prompt_token_ids=prompt,
            generated_token_ids=staged_tokens,
            generated_logprobs=[-1.0] * len(staged_tokens),
        )
        prefix = prefix.extended(first)
        staged_tokens = first.token_ids_delta  # the carried prompt tokens come first
    assert prefix.chunk_hashes(new_tokens) == (
        compute_chain_hash(call.admission.parent_chain_hash, staged_tokens + new_tokens),
        hash_token_ids(PARENT_TOKENS + staged_tokens + new_tokens),
    )


def test_extending_a_prefix_leaves_it_as_it_was() -> None:
    capture = RolloutTokenCapture(MemoryStore())
    call, prompt = _call(capture, child=False)
    first = capture.build_prefix_record(
        call, prompt_token_ids=prompt, generated_token_ids=[1, 2], generated_logprobs=[-1.0] * 2
    )
    prefix = capture.staged_prefix(call, [first])
    chunk = capture.build_generation_chunk_record(
        call, staged=prefix, generated_token_ids=[3], generated_logprobs=[-1.0]
    )
    longer = prefix.extended(chunk)
    assert prefix.records == (first,) and prefix.digest == first.digest
    assert longer.records == (first, chunk) and longer.token_count == 6
    assert longer.digest == rebuild_generation_cut([first, chunk]).digest != first.digest


def test_a_prefix_of_another_parent_or_no_record_is_refused() -> None:
    capture = RolloutTokenCapture(MemoryStore())
    child, prompt = _call(capture, child=True)
    root, _ = _call(capture, child=False)
    first = capture.build_prefix_record(
        child, prompt_token_ids=prompt, generated_token_ids=[1], generated_logprobs=[-1.0]
    )
    wrong_parent = capture.staged_prefix(root, [first])  # a root's prefix: no parent
    with pytest.raises(ValueError, match="another parent"):
        capture.build_generation_chunk_record(
            child, staged=wrong_parent, generated_token_ids=[2], generated_logprobs=[-1.0]
        )
    with pytest.raises(ValueError, match="cumulative record"):
        capture.build_generation_chunk_record(
            child,
            staged=capture.staged_prefix(child),
            generated_token_ids=[2],
            generated_logprobs=[-1.0],
        )
    with pytest.raises(ValueError, match="at least one"):
        _ = StagedPrefix().digest
    with pytest.raises(ValueError, match="parent_chain_hash"):
        StagedPrefix(parent_chain_hash="not a digest")


def test_the_prefix_refuses_what_rebuild_refuses() -> None:
    capture = RolloutTokenCapture(MemoryStore())
    call, prompt = _call(capture, child=True)
    first = capture.build_prefix_record(
        call, prompt_token_ids=prompt, generated_token_ids=[1], generated_logprobs=[-1.0]
    )
    prefix = capture.staged_prefix(call, [first])
    with pytest.raises(ValueError, match="another call"):
        prefix.extended(_parent())
    with pytest.raises(ValueError, match="prompt tokens"):
        prefix.extended(first)
    with_extras = StagedCallRecord.from_components(
        **{
            name: getattr(first, name)
            for name in ("rollout_id", "model_call_id", "parent_call_id", "mode", "prev_len")
        },
        weight_version=0,
        token_ids_delta=[5],
        token_mask_delta=[1.0],
        generation_log_probs_delta=[-1.0],
        chain_hash=first.chain_hash,
        cumulative_hash=first.cumulative_hash,
        extras={"k": 1},
    )
    with pytest.raises(ValueError, match="extras"):
        prefix.extended(with_extras)


@given(st.lists(IDS, max_size=50), st.lists(st.floats(width=32, allow_nan=False), max_size=50))
def test_the_elements_are_the_blocks_without_their_counts(
    tokens: list[int], values: list[float]
) -> None:
    assert encode_token_ids(tokens) == len(tokens).to_bytes(8, "big") + encode_token_elements(
        tokens
    )
    if all(abs(value) != float("inf") for value in values):
        assert len(encode_float32_elements(values, field="f")) == 4 * len(values)
    else:
        with pytest.raises(ValueError, match="finite"):
            encode_float32_elements(values, field="f")


@settings(max_examples=60)
@given(
    st.booleans(),
    st.lists(IDS, min_size=2, max_size=40),
    st.lists(st.floats(-30.0, 0.0, width=32), min_size=40, max_size=40),
    st.data(),
)
def test_build_cut_builds_the_records_the_two_builders_build(
    child: bool, generated: list[int], log_probs: list[float], data: st.DataObject
) -> None:
    """D423: the cut records ``build_cut`` builds from one encoding of each column are those of
    ``build_prefix_record`` and ``build_generation_chunk_record``, digests and hashes included."""
    capture = RolloutTokenCapture(MemoryStore())
    call, prompt = _call(capture, child=child)
    log_probs = log_probs[: len(generated)]
    cuts = [0, *sorted(data.draw(st.sets(st.integers(1, len(generated) - 1), max_size=4)))]
    prefix = capture.staged_prefix(call)
    records: list[StagedCallRecord] = []
    for start, stop in zip(cuts, [*cuts[1:], len(generated)], strict=True):
        prefix = capture.build_cut(
            call,
            prefix,
            prompt_token_ids=prompt,
            generated_token_ids=generated[start:stop],
            generated_logprobs=log_probs[start:stop],
        )
        if not records:
            expected = capture.build_prefix_record(
                call,
                prompt_token_ids=prompt,
                generated_token_ids=generated[:stop],
                generated_logprobs=log_probs[:stop],
            )
        else:
            expected = capture.build_generation_chunk_record(
                call,
                staged=records,
                generated_token_ids=generated[start:stop],
                generated_logprobs=log_probs[start:stop],
            )
        assert prefix.records[-1] == expected
        assert prefix.records[-1].model_dump() == expected.model_dump()
        records.append(expected)
        assert prefix.digest == rebuild_generation_cut(records).digest
    whole = capture.build_prefix_record(
        call, prompt_token_ids=prompt, generated_token_ids=generated, generated_logprobs=log_probs
    )
    assert prefix.digest == whole.digest


def test_build_cut_refuses_another_call_s_prefix_and_an_empty_chunk() -> None:
    capture = RolloutTokenCapture(MemoryStore())
    child, prompt = _call(capture, child=True)
    root, _ = _call(capture, child=False)
    with pytest.raises(ValueError, match="another parent"):
        capture.build_cut(
            child,
            capture.staged_prefix(root),
            prompt_token_ids=prompt,
            generated_token_ids=[1],
            generated_logprobs=[-1.0],
        )
    prefix = capture.build_cut(
        child,
        capture.staged_prefix(child),
        prompt_token_ids=prompt,
        generated_token_ids=[1],
        generated_logprobs=[-1.0],
    )
    with pytest.raises(ValueError, match="at least one token"):
        capture.build_cut(
            child, prefix, prompt_token_ids=prompt, generated_token_ids=[], generated_logprobs=[]
        )
    with pytest.raises(ValueError, match="another call"):
        capture.build_cut(
            root, prefix, prompt_token_ids=[7], generated_token_ids=[2], generated_logprobs=[-1.0]
        )


def test_columns_handed_to_a_prefix_must_hold_the_record_s_delta() -> None:
    capture = RolloutTokenCapture(MemoryStore())
    call, prompt = _call(capture, child=False)
    record, columns = StagedCallRecord.encoded_from_components(
        rollout_id=call.rollout_id,
        model_call_id=call.model_call_id,
        parent_call_id=None,
        mode="text",
        prev_len=0,
        weight_version=0,
        token_ids_delta=[*prompt, 1],
        token_mask_delta=[0.0, 0.0, 0.0, 1.0],
        generation_log_probs_delta=[0.0, 0.0, 0.0, -1.0],
        chain_hash=compute_chain_hash(None, [*prompt, 1]),
        cumulative_hash=hash_token_ids([*prompt, 1]),
    )
    assert columns.tokens == encode_token_elements(record.token_ids_delta)
    assert columns.masks == encode_float32_elements(record.token_mask_delta, field="m")
    assert columns.log_probs == encode_float32_elements(
        record.generation_log_probs_delta, field="l"
    )
    assert encode_token_ids(record.token_ids_delta)[8:] == columns.tokens
    with pytest.raises(ValueError, match="do not hold the record's delta"):
        capture.staged_prefix(call).extended(record, columns._replace(masks=columns.masks[4:]))
