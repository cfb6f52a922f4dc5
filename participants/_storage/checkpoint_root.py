"""Where commit and restore may read and write: under the checkpoint root (D240).

A ``checkpoint_dir`` must be absolute; with a root configured (every reference server has one),
it and the participant's own directory inside it must lie under the root once ``..`` and every
existing symlink are resolved, else the call is ``invalid_request`` and nothing is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

from protocols import InvalidRequestError, participant_directory


def checkpoint_path(checkpoint_dir: str, root: Path | None = None) -> Path:
    """The checkpoint directory of a request: absolute, and under ``root`` when one is set.

    With a root, the path is returned resolved (``..`` and every existing symlink followed), so
    what is written or read is exactly what was checked.

    Raises:
        InvalidRequestError: The path is relative (it would depend on the server's cwd), or it
            leaves the checkpoint root.
    """
    path = Path(checkpoint_dir)
    if not path.is_absolute():
        raise InvalidRequestError(
            f"checkpoint_dir must be an absolute path, got {checkpoint_dir!r}"
        )
    if root is None:
        return path
    base = Path(os.path.realpath(root))
    resolved = Path(os.path.realpath(path))
    if resolved != base and base not in resolved.parents:
        raise InvalidRequestError(
            f"checkpoint_dir {checkpoint_dir!r} is outside the checkpoint root {str(base)!r} "
            "(after resolving '..' and symlinks); nothing was read or written"
        )
    return resolved


def participant_path(
    checkpoint_dir: str, *, root: Path | None, kind: str, instance: str
) -> tuple[Path, Path]:
    """The checkpoint directory of a request and the participant's directory inside it.

    Both are checked against the checkpoint root: a symlink below the checkpoint directory must
    not lead out of the root either.

    Raises:
        InvalidRequestError: Either path is relative or leaves the checkpoint root.
    """
    directory = checkpoint_path(checkpoint_dir, root)
    own = Path(participant_directory(directory, kind, instance))
    return directory, checkpoint_path(str(own), root)
