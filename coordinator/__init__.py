"""The controller side of midflight: what a training controller embeds.

So far: the client of a model server's capture-ledger routes. The control-plane client, the
fixed-order drivers and publication land here.
"""

from ._ledger_client import LedgerClient

__all__ = ["LedgerClient"]
