"""``midflight model tiny DIR``: build the tiny model the transformers and vLLM engines load."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from .._worker.tiny_model import build_tiny_model
from .output import JsonOption, console, emit, usage_error

ENGINE_EXTRA_HINT = "the tiny model needs the engine extra: pip install -e '.[engine]'"


def register(app: typer.Typer) -> None:
    """Add the ``model`` sub-app."""
    model_app = typer.Typer(
        name="model",
        help="Models for the real inference engines.",
        no_args_is_help=True,
        add_completion=False,
    )

    @model_app.command("tiny")
    def tiny_command(
        directory: Annotated[
            Path,
            typer.Argument(
                help="Where to write the model: a new or empty directory, or a tiny model to replace."
            ),
        ],
        seed: Annotated[int, typer.Option(min=0, max=2**32 - 1, help="Weight seed.")] = 0,
        as_json: JsonOption = False,
    ) -> None:
        """Build a tiny Llama model with seeded weights and a byte tokenizer (no download)."""
        try:
            built = build_tiny_model(directory, seed=seed)
        except ImportError as exc:
            usage_error(f"{ENGINE_EXTRA_HINT} ({exc.name or exc} is missing)")
        except ValueError as exc:  # a directory that is no tiny model: nothing was written
            usage_error(str(exc))
        except OSError as exc:  # a parent that cannot hold it (missing, read-only, not a dir)
            usage_error(f"{directory}: the model cannot be written there ({exc.strerror or exc})")
        payload = {
            "directory": str(built.directory),
            "digest": built.digest,
            "parameters": built.parameters,
            "seed": seed,
        }
        emit(
            payload,
            as_json=as_json,
            render=lambda: console.print(
                f"tiny model ({built.parameters:,} parameters) in {built.directory}\n"
                f"digest {built.digest}"
            ),
        )

    app.add_typer(model_app)
