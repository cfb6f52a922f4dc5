"""The benches' pictures (``e2e._bench.plots``) and ``midflight bench plot``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from e2e import build_app
from e2e._bench.plots import check_plottable, draw

runner = CliRunner()
PNG = b"\x89PNG\r\n\x1a\n"


def _restore_payload(*, at_16000: float = 0.99) -> dict[str, Any]:
    rows = [
        {
            "rollouts": 4000,
            "restore_s": 0.254,
            "floor_s": 0.010,
            "floor_samples_s": [0.015, 0.010, 0.009, 0.010, 0.011],
            "us_per_rollout": 63.4,
        },
        {
            "rollouts": 16_000,
            "restore_s": at_16000,
            "floor_s": 0.041,
            "floor_samples_s": [0.084, 0.041, 0.040, 0.040, 0.041],
            "us_per_rollout": round(at_16000 / 16_000 * 1e6, 1),
        },
    ]
    return {"suite": "restore", "rows": rows}


def _scale_payload() -> dict[str, Any]:
    rung = {"pause_s": 0.23, "restore_s": 0.079, "floor_s": 0.0054, "us_per_rollout": 79.1}
    return {
        "suite": "scale",
        "rungs": [
            {"rollouts": 4000, **rung, "peak_rss_mb": 864.0},
            {"rollouts": 1000, **rung, "peak_rss_mb": 274.4},
            {"rollouts": 50_000, "skipped": "memory: 9,800 MB needed", "resource": "memory"},
        ],
    }


def test_the_rows_drawn_are_the_measured_ones_by_size() -> None:
    suite, rows = check_plottable(_scale_payload())
    assert suite == "scale"
    assert [row["rollouts"] for row in rows] == [1000, 4000]  # the skipped rung is not drawn


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ([1, 2], "not a bench's JSON object"),
        ({"suite": "ledger", "rows": []}, "suite 'ledger' has no picture"),
        ({"rows": []}, "suite None has no picture"),
        ({"suite": "restore", "rows": {"rollouts": 1}}, "'rows' is not a list of rows"),
        ({"suite": "restore", "rows": [3]}, "'rows' is not a list of rows"),
        ({"suite": "scale", "rungs": [{"rollouts": 2, "error": "x"}]}, "no measured row"),
    ],
)
def test_a_payload_without_a_picture_is_refused(payload: object, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        check_plottable(payload)


@pytest.mark.parametrize("bad", [None, "0.9", True, 0, -0.5, math.nan, math.inf])
def test_a_row_without_a_positive_number_for_a_figure_is_refused_by_name(bad: object) -> None:
    # The axes are logarithmic: a zero, a negative or a NaN would be dropped with a warning.
    for field in ("restore_s", "rollouts"):
        payload = _restore_payload()
        payload["rows"][1][field] = bad
        with pytest.raises(ValueError, match=f"measured row 1 has no positive number in '{field}'"):
            check_plottable(payload)


def test_a_refused_payload_writes_nothing(tmp_path: Path) -> None:
    payload = _restore_payload()
    del payload["rows"][0]["floor_s"]
    with pytest.raises(ValueError):
        draw(payload, tmp_path / "restore.png")
    assert list(tmp_path.iterdir()) == []


def test_each_picture_is_drawn_from_its_figures(tmp_path: Path) -> None:
    for name, payload in (
        ("restore", _restore_payload()),
        ("slower", _restore_payload(at_16000=2.5)),
        ("scale", _scale_payload()),
        (
            "checkpoint",
            {"suite": "checkpoint", "rows": [_checkpoint_row(100), _checkpoint_row(1000)]},
        ),
    ):
        assert draw(payload, tmp_path / f"{name}.png").read_bytes().startswith(PNG)
    # The same payload draws the same picture; other figures draw another.
    again = draw(_restore_payload(), tmp_path / "again.png")
    assert again.read_bytes() == (tmp_path / "restore.png").read_bytes()
    assert (tmp_path / "slower.png").read_bytes() != (tmp_path / "restore.png").read_bytes()


def _checkpoint_row(rollouts: int) -> dict[str, Any]:
    return {
        "rollouts": rollouts,
        "pause_s": rollouts * 2e-4,
        "overhead_s": rollouts * 1.9e-4,
        "floor_s": rollouts * 1e-5,
    }


def test_bench_plot_draws_a_saved_payload_again(tmp_path: Path) -> None:
    source = tmp_path / "restore.json"
    source.write_text(json.dumps(_restore_payload()))
    result = runner.invoke(build_app(), ["bench", "plot", str(source), "--json"])
    assert result.exit_code == 0, result.output
    target = tmp_path / "restore.png"  # beside the JSON by default
    assert json.loads(result.stdout) == {"suite": "restore", "rows": 2, "written": [str(target)]}
    assert target.read_bytes() == draw(_restore_payload(), tmp_path / "direct.png").read_bytes()
    named = tmp_path / "pictures" / "r.png"
    result = runner.invoke(build_app(), ["bench", "plot", str(source), "--out", str(named)])
    assert result.exit_code == 0, result.output
    assert f"wrote {named} (restore, 2 rows drawn)" in result.stdout.replace("\n", "")
    assert named.read_bytes() == target.read_bytes()


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("{", "not JSON (Expecting property name enclosed in double quotes, line 1)"),
        ('{"suite": "ledger"}', "suite 'ledger' has no picture"),
        (
            '{"suite": "restore", "rows": [{"rollouts": 1}]}',
            "measured row 0 has no positive number",
        ),
    ],
)
def test_bench_plot_refuses_a_file_it_cannot_draw_in_one_line(
    tmp_path: Path, content: str, why: str
) -> None:
    source = tmp_path / "bench.json"
    source.write_text(content)
    result = runner.invoke(build_app(), ["bench", "plot", str(source)])
    assert result.exit_code == 2
    assert result.stderr.count("\n") == 1 and why in result.stderr
    assert "Traceback" not in result.output
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bench.json"]


def test_bench_plot_refuses_a_missing_file_and_a_target_it_cannot_write(tmp_path: Path) -> None:
    missing = runner.invoke(build_app(), ["bench", "plot", str(tmp_path / "none.json")])
    assert missing.exit_code == 2 and "cannot be read (No such file or directory)" in missing.stderr
    source = tmp_path / "restore.json"
    source.write_text(json.dumps(_restore_payload()))
    for target, why in (
        (tmp_path, "is a directory: name the PNG to write"),
        (source, "that is the JSON being drawn"),
    ):
        result = runner.invoke(build_app(), ["bench", "plot", str(source), "--out", str(target)])
        assert result.exit_code == 2 and why in result.stderr, result.output
    assert json.loads(source.read_text()) == _restore_payload()  # the JSON is left as it was
    blocked = tmp_path / "file"
    blocked.write_text("")
    result = runner.invoke(
        build_app(), ["bench", "plot", str(source), "--out", str(blocked / "x.png")]
    )
    assert result.exit_code == 2 and "the picture cannot be written there" in result.stderr


def test_a_rung_not_measured_is_named_under_the_title(tmp_path: Path) -> None:
    payload = _scale_payload()
    with_note = draw(payload, tmp_path / "noted.png").read_bytes()
    payload["rungs"].pop()  # the skipped rung: the drawn rows are the same, the title is not
    assert draw(payload, tmp_path / "plain.png").read_bytes() != with_note


def test_a_restore_picture_says_where_the_servers_ran(tmp_path: Path) -> None:
    in_one = draw(_restore_payload(), tmp_path / "one.png").read_bytes()
    per_server = {**_restore_payload(), "servers": "processes"}  # D447
    assert draw(per_server, tmp_path / "many.png").read_bytes() != in_one
