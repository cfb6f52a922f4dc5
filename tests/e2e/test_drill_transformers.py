"""The crash-restore drill on the transformers engine: green with every continued cut checked by
re-decoding on the real model, and a worker that continues without the prefix caught.

Real server processes, SIGKILLs and restores, as in ``test_drill.py``; the worker decodes the tiny
model (``midflight model tiny``) built once for the module.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from e2e._drill.continuations import continued_calls, prefix_mismatches
from e2e._drill.options import FAULTS
from e2e._drill.oracle import ERROR_FIGURES
from e2e._worker.tiny_model import build_tiny_model
from tests.e2e.test_drill import SMALL, _drill

pytestmark = [pytest.mark.process, pytest.mark.timeout(600)]
assert SMALL  # the small drill of test_drill.py: 4 rollouts, 3 checkpoints, 2 crashes


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """The engine options of every drill here: the tiny model, and one shared baseline."""
    model = build_tiny_model(tmp_path_factory.mktemp("tiny") / "model").directory
    baseline = tmp_path_factory.mktemp("baseline")
    # Eight rollouts (the later --rollouts wins over SMALL's): enough calls are cut mid-generation
    # that a run without a continued cut to check is not a coin toss.
    return [
        *("--engine", "transformers", "--model", str(model), "--baseline", str(baseline)),
        *("--rollouts", "8"),
    ]


def test_the_drill_on_the_real_model_is_green_and_its_continuations_re_decode(
    tmp_path: Path, engine: list[str]
) -> None:
    code, figures = _drill(tmp_path, *engine)
    assert {name: figures[name] for name in ERROR_FIGURES} == dict.fromkeys(ERROR_FIGURES, 0), (
        figures
    )
    assert code == 0, figures["failures"]
    assert figures["engine"] == "transformers" and figures["dtype"] == "float64"
    assert figures["cut_continued"] >= 1
    assert figures["continued_checked"] == figures["cut_continued"]  # every one was re-decoded
    assert figures["prefix_mismatches"] == 0
    assert figures["continuation_redecode_mismatches"] == 0 and figures["redecode_must_match"]
    assert figures["continuation_divergence"] == 0  # float64: argmax-stable (D306)
    assert figures["model"]["parameters"] > 100_000
    # The calls the oracle checked, rebuilt from the store: each starts with its durable prefix,
    # and one whose completion lost a prefix token is counted.
    calls = continued_calls(tmp_path / "run")
    assert len(calls) == figures["cut_continued"] and all(c.prefix for c in calls)
    assert prefix_mismatches(calls) == 0
    first = calls[0]
    broken = dataclasses.replace(first, completion=first.completion[1:])
    assert prefix_mismatches([broken, *calls[1:]]) == 1


def test_a_worker_that_continues_without_the_prefix_is_caught_by_re_decoding(
    tmp_path: Path, engine: list[str]
) -> None:
    fault = "continue-without-prefix"
    code, figures = _drill(tmp_path, *engine, "--fault", fault)
    assert figures[FAULTS[fault]] > 0, figures
    assert figures["prefix_mismatches"] == 0  # the prefix itself is still staged whole
    assert any(f.startswith("continuation_redecode_mismatches") for f in figures["failures"])
    assert code == 1
