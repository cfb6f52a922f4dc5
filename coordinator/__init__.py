"""The controller side of midflight: what a training controller embeds.

Empty so far; the client, the fixed-order drivers and publication land here.
"""

__all__: list[str] = []
