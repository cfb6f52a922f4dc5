"""The cluster file (TOML): the run root and every server's name, role, URL and options.

An optional ``checkpoint_store`` names where the coordinator keeps checkpoints when that is not
the run root: an ``s3://bucket/prefix`` URL (or another absolute directory). Without it, as in
every file written before it existed, checkpoints live under ``root``.

The supervisor writes it; every server, the coordinator and the command line read it. Servers
start in dependency order (worker, model, resources, agent, environment), so when a server reads
the file at start-up its peers are already listed.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Literal

from participants import write_file_durably
from protocols import is_object_store_url, split_s3_url

Role = Literal["environment", "agent", "resources", "model", "worker"]
ROLES: Final[tuple[Role, ...]] = ("worker", "model", "resources", "agent", "environment")
PARTICIPANT_ROLES: Final[tuple[Role, ...]] = ("environment", "model", "agent", "resources")
"""The roles that are participants (the worker is not), in the order the operator commands list them."""
"""Every role, in start-up (dependency) order."""

DEFAULT_NAMES: Final[dict[Role, str]] = {
    "worker": "worker",
    "model": "policy",
    "resources": "resources",
    "agent": "agent",
    "environment": "environment",
}
DEFAULT_PORTS: Final[dict[Role, int]] = {
    "worker": 8701,
    "model": 8702,
    "resources": 8703,
    "agent": 8704,
    "environment": 8705,
}


@dataclass(frozen=True)
class ServerEntry:
    """One ``[[server]]`` table."""

    name: str
    role: Role
    url: str
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Cluster:
    """A parsed cluster file.

    Attributes:
        root: The run root (logs, ledger, staging; checkpoints too, unless ``checkpoint_store``).
        servers: Every ``[[server]]`` table, in file order.
        checkpoint_store: Where checkpoints are kept instead of ``root``: ``s3://bucket/prefix``
            or an absolute directory; ``None`` for ``root``.
    """

    root: Path
    servers: tuple[ServerEntry, ...]
    checkpoint_store: str | None = None

    @property
    def store_root(self) -> str | Path:
        """The run root of the checkpoints: ``checkpoint_store`` when set, else ``root``."""
        if self.checkpoint_store is None:
            return self.root
        if is_object_store_url(self.checkpoint_store):
            return self.checkpoint_store
        return Path(self.checkpoint_store)

    def by_role(self, role: Role) -> list[ServerEntry]:
        """The servers of one role, in file order."""
        return [server for server in self.servers if server.role == role]

    def url_of(self, role: Role) -> str:
        """The URL of the (first) server of ``role``.

        Raises:
            LookupError: No server of that role is listed.
        """
        found = self.by_role(role)
        if not found:
            raise LookupError(f"the cluster file lists no {role} server")
        return found[0].url


def default_cluster(root: Path) -> Cluster:
    """Every role on its default port on 127.0.0.1 (what ``serve`` assumes without a file)."""
    return Cluster(
        root=root,
        servers=tuple(
            ServerEntry(DEFAULT_NAMES[role], role, f"http://127.0.0.1:{DEFAULT_PORTS[role]}")
            for role in ROLES
        ),
    )


def read_cluster(path: Path) -> Cluster:
    """Parse a cluster file.

    Raises:
        ValueError: The file is not a valid cluster file.
    """
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"cannot read cluster file {path}: {exc}") from exc
    root = data.get("root")
    if not isinstance(root, str) or not Path(root).is_absolute():
        raise ValueError(f"{path}: root must be an absolute path")
    store = data.get("checkpoint_store")
    if store is not None:
        _check_store(path, store)
    entries = data.get("server", [])
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"{path}: server must be tables, each under its own [[server]] header")
    servers = [_server_entry(path, number, entry) for number, entry in enumerate(entries, 1)]
    seen: set[str] = set()
    for server in servers:
        if server.name in seen:
            raise ValueError(f"{path}: two [[server]] tables are named {server.name!r}")
        seen.add(server.name)
    return Cluster(root=Path(root), servers=tuple(servers), checkpoint_store=store)


def _server_entry(path: Path, number: int, entry: dict[str, Any]) -> ServerEntry:
    """One ``[[server]]`` table, checked (D363).

    Raises:
        ValueError: ``name``, ``role`` or ``url`` is missing or not a non-empty string, the role
            is unknown, or the URL is not ``http://`` or ``https://``.
    """
    where = f"{path}: [[server]] number {number}"
    for key in ("name", "role", "url"):
        value = entry.get(key)
        if not isinstance(value, str) or not value:
            raise ValueError(f'{where} needs {key} = "...", a non-empty string')
    role, url = entry["role"], entry["url"]
    if role not in ROLES:
        raise ValueError(f"{path}: unknown role {role!r} (the roles: {', '.join(ROLES)})")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"{where}: url must start with http:// or https://, got {url!r}")
    options = {k: v for k, v in entry.items() if k not in ("name", "role", "url")}
    return ServerEntry(entry["name"], role, url, options)


def _check_store(path: Path, store: Any) -> None:
    """``checkpoint_store`` is an ``s3://`` URL that parses, or an absolute directory.

    Raises:
        ValueError: It is neither.
    """
    if isinstance(store, str) and is_object_store_url(store):
        try:
            split_s3_url(store)
        except ValueError as exc:
            raise ValueError(f"{path}: checkpoint_store: {exc}") from exc
        return
    if not isinstance(store, str) or not Path(store).is_absolute():
        raise ValueError(
            f"{path}: checkpoint_store must be an s3://bucket/prefix URL or an absolute path"
        )


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        escaped = value.replace("\\", "\\\\").replace('"', '\\"')
        return f'"{escaped}"'
    raise TypeError(f"cannot write {value!r} to a cluster file")


def write_cluster(path: Path, cluster: Cluster) -> None:
    """Write the cluster file atomically (temp, fsync, rename, directory fsync)."""
    lines = [f"root = {_toml_value(str(cluster.root))}"]
    if cluster.checkpoint_store is not None:
        lines.append(f"checkpoint_store = {_toml_value(cluster.checkpoint_store)}")
    lines.append("")
    for server in cluster.servers:
        lines += [
            "[[server]]",
            f"name = {_toml_value(server.name)}",
            f"role = {_toml_value(server.role)}",
            f"url = {_toml_value(server.url)}",
        ]
        lines += [f"{key} = {_toml_value(value)}" for key, value in server.options.items()]
        lines.append("")
    write_file_durably(Path(path), "\n".join(lines).encode("utf-8"))
