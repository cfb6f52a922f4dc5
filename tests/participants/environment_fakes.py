"""Scripted agent and resources peers for the environment participant's tests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import anyio

from participants import SeededSession


@dataclass
class ScriptedPeers:
    """Peers that record every call and can hold any of them until released.

    ``hold("activate")`` makes the next ``activate`` calls wait until ``release("activate")``;
    ``entered[name]`` is set once a call of that name is waiting at its gate. A call whose name
    is in ``refuse`` raises that error once past its gate.
    """

    verify_mode: str = "wait"
    restart: bool = False
    reward: float = 0.42
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    gates: dict[str, anyio.Event] = field(default_factory=dict)
    entered: dict[str, anyio.Event] = field(default_factory=dict)
    refuse: dict[str, Exception] = field(default_factory=dict)
    sessions: int = 0

    def hold(self, name: str) -> None:
        self.gates[name] = anyio.Event()
        self.entered[name] = anyio.Event()

    def release(self, name: str) -> None:
        self.gates.pop(name).set()

    async def _gate(self, name: str, key: str, arg: Any) -> None:
        self.calls.append((name, key, arg))
        gate = self.gates.get(name)
        if gate is not None:
            self.entered[name].set()
            await gate.wait()
        if name in self.refuse:
            raise self.refuse[name]

    def names(self, key: str | None = None) -> list[str]:
        return [name for name, k, _ in self.calls if key is None or k == key]

    async def seed_resources(self, key: str, task_input: dict[str, Any]) -> SeededSession:
        self.sessions += 1
        session_id = f"s{self.sessions}"
        await self._gate("seed_resources", key, task_input)
        return SeededSession(
            session_id, "replay" if self.verify_mode == "replay" else "wait", self.restart
        )

    async def seed_agent(
        self, key: str, resources_session_id: str, task_input: dict[str, Any]
    ) -> None:
        await self._gate("seed_agent", key, resources_session_id)

    async def activate(self, key: str, activation: int) -> dict[str, Any]:
        await self._gate("activate", key, activation)
        return {"activation": activation, "messages": [], "turns": 2}

    async def verify(self, key: str, resources_session_id: str) -> float:
        await self._gate("verify", key, resources_session_id)
        return self.reward

    async def close(self, key: str, resources_session_id: str | None) -> None:
        await self._gate("close", key, resources_session_id)
