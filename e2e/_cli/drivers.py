"""The hidden commands of the drill's controller processes (started by ``midflight drill``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer) -> None:
    """Add the hidden ``drill-driver`` and ``sequence-driver`` to the app."""

    @app.command("drill-driver", hidden=True)
    def drill_driver_command(
        root: Annotated[Path, typer.Option()],
        cluster: Annotated[Path, typer.Option()],
        plan: Annotated[Path, typer.Option()],
    ) -> None:
        """The drill's controller process (started by ``midflight drill``)."""
        from .._drill.driver import main
        from .._launch.serving import configure_server_logging

        configure_server_logging()  # JSON on stderr, its log: stdout is its line protocol
        main(root, cluster, plan)

    @app.command("sequence-driver", hidden=True)
    def sequence_driver_command(
        root: Annotated[Path, typer.Option()],
        cluster: Annotated[Path, typer.Option()],
        plan: Annotated[Path, typer.Option()],
    ) -> None:
        """The controller process of one random sequence (started by ``drill --sequences``)."""
        from .._launch.serving import configure_server_logging
        from .._sequences.driver import main

        configure_server_logging()  # as the drill's controller (D410): stdout is its protocol
        main(root, cluster, plan)
