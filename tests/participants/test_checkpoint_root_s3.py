"""An ``s3://`` checkpoint root: which checkpoint_dir it admits, and in what form (D330).

Over HTTP, and with nothing written, in ``test_commit_restore_s3.py``; here the rule itself.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from participants import ControlSettings
from participants._storage.checkpoint_root import checkpoint_path, participant_path
from protocols import InvalidRequestError

ROOT = "s3://midflight/runs/one"


@pytest.mark.parametrize(
    ("checkpoint_dir", "canonical"),
    [
        (f"{ROOT}/checkpoints/c1", f"{ROOT}/checkpoints/c1"),
        (f"{ROOT}/checkpoints/c1/", f"{ROOT}/checkpoints/c1"),
        (ROOT, ROOT),
    ],
)
def test_a_url_under_the_root_is_admitted_in_canonical_form(
    checkpoint_dir: str, canonical: str
) -> None:
    directory, own = participant_path(checkpoint_dir, root=ROOT, kind="model", instance="policy")
    assert (directory, own) == (canonical, f"{canonical}/gym/model/policy")


@pytest.mark.parametrize(
    ("checkpoint_dir", "reason"),
    [
        ("s3://midflight/runs/one-two/c1", "outside the checkpoint root"),
        ("s3://midflight/runs", "outside the checkpoint root"),
        ("s3://other/runs/one/c1", "outside the checkpoint root"),
        (f"{ROOT}/../two/c1", "outside the checkpoint root"),
        (f"{ROOT}/c1/../../x", "outside the checkpoint root"),
        (f"{ROOT}/c1//x", "outside the checkpoint root"),
        (f"{ROOT}/c 1", "outside the checkpoint root"),
        ("/data/checkpoints/c1", "is not an s3:// URL"),
        ("relative/c1", "is not an s3:// URL"),
    ],
)
def test_anything_else_under_an_s3_root_is_an_invalid_request(
    checkpoint_dir: str, reason: str
) -> None:
    with pytest.raises(InvalidRequestError, match=reason) as caught:
        checkpoint_path(checkpoint_dir, ROOT)
    assert "\n" not in caught.value.detail


def test_a_url_needs_a_root_of_its_kind(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequestError, match="is a directory"):
        checkpoint_path(f"{ROOT}/c1", tmp_path)
    with pytest.raises(InvalidRequestError, match="no checkpoint root"):
        checkpoint_path(f"{ROOT}/c1", None)
    assert checkpoint_path(str(tmp_path / "c1"), None) == tmp_path / "c1"  # paths as before


def test_the_settings_keep_a_root_url_canonical_and_a_string_path_as_a_path() -> None:
    assert ControlSettings(checkpoint_root="s3://midflight/runs/one/").checkpoint_root == ROOT
    assert ControlSettings(checkpoint_root="/data/run").checkpoint_root == Path("/data/run")
    with pytest.raises(ValueError, match="not a valid bucket name"):
        ControlSettings(checkpoint_root="s3://Bad_Bucket/runs")
