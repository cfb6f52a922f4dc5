"""``python -m e2e`` runs the ``midflight`` command line."""

from ._cli.app import main

main()
