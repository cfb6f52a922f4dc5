"""The drill's option checks: each refuses, as one line and exit 2, a run that cannot work."""

from __future__ import annotations

from pathlib import Path

from .._drill.hosting import ON_CHOICES, ray_available
from .._drill.oracle import MIN_CHECKPOINTS, MIN_CRASHES
from .._drill.store import DISK, LOCAL_S3, check_store_option, local_s3_available
from .._worker.engines import DEFAULT_ENGINE, EngineError, load_engine_factory
from .output import usage_error


def refuse_a_used_directory(keep_dir: Path) -> None:
    """Refuse a ``--keep-dir`` that holds anything: a run there would read the old run's evidence.

    Raises:
        typer.Exit: With exit code 2, after one line.
    """
    if keep_dir.exists() and not keep_dir.is_dir():
        usage_error(f"--keep-dir {keep_dir} is not a directory")
    if keep_dir.is_dir() and any(keep_dir.iterdir()):
        usage_error(
            f"--keep-dir {keep_dir} is not empty (a kept run would mix with this one): "
            "name a new or empty directory"
        )


def refuse_a_drill_that_cannot_pass(checkpoints: int, crashes: int) -> None:
    """Refuse the options the minimum-activity rule fails whatever happens (D232).

    Every crash restores a checkpoint of its own phase, so each crash needs one of the
    ``--checkpoints`` before it; with fewer the drill would publish more than asked.

    Raises:
        typer.Exit: With exit code 2, after one line.
    """
    if checkpoints < MIN_CHECKPOINTS or crashes < MIN_CRASHES:
        usage_error(
            f"--checkpoints {checkpoints} --crashes {crashes} can never pass: the drill proves "
            f"nothing with fewer than {MIN_CHECKPOINTS} checkpoints and {MIN_CRASHES} crashes"
        )
    if checkpoints < crashes:
        usage_error(
            f"--checkpoints {checkpoints} is fewer than --crashes {crashes}: every crash "
            "restores a checkpoint taken since the one before"
        )


MODEL_DTYPES = ("float64", "float32", "bfloat16")


def refuse_an_engine_that_cannot_run(engine: str, model: Path | None, dtype: str) -> None:
    """Refuse an unknown engine, one whose packages are missing, or a model that is not there.

    Raises:
        typer.Exit: With exit code 2, after one line.
    """
    try:
        load_engine_factory(engine)
    except EngineError as exc:
        usage_error(str(exc))
    if dtype not in MODEL_DTYPES:
        usage_error(f"unknown dtype {dtype!r}; known: {', '.join(MODEL_DTYPES)}")
    if engine == DEFAULT_ENGINE and model is not None:
        usage_error("--model needs a model engine (--engine transformers or vllm)")
    if model is not None and not (model / "config.json").is_file():
        usage_error(f"--model {model} holds no config.json (midflight model tiny DIR builds one)")


def refuse_a_store_that_cannot_run(option: str, sequences: int) -> str:
    """The ``--checkpoint-store`` option, checked: ``disk``, ``s3`` or an ``s3://`` URL.

    Raises:
        typer.Exit: With exit code 2, after one line: a malformed value, the sequence suites
            (they keep their checkpoints on disk), or ``s3`` without moto installed.
    """
    try:
        store = check_store_option(option)
    except ValueError as exc:
        usage_error(f"--checkpoint-store {exc}")
    if store != DISK and sequences:
        usage_error("--checkpoint-store: the sequence suites keep their checkpoints on disk")
    if store == LOCAL_S3 and not local_s3_available():
        usage_error("--checkpoint-store s3 needs moto: pip install 'midflight[s3-local]'")
    return store


def refuse_hosting_that_cannot_run(on: str, *, matrix: bool, sequences: int) -> str:
    """The ``--on`` option, checked: ``local``, or ``ray`` with Ray installed.

    Raises:
        typer.Exit: With exit code 2, after one line: an unknown value, ``ray`` without Ray,
            or ``ray`` with the matrix or the sequence suites (they run local processes).
    """
    if on not in ON_CHOICES:
        usage_error(f"--on {on!r}: choose one of {', '.join(ON_CHOICES)}")
    if on == "ray":
        if matrix or sequences:
            usage_error("--on ray: the matrix and the sequence suites run local processes")
        if not ray_available():
            usage_error("--on ray needs Ray: pip install 'midflight[ray]'")
    return on
