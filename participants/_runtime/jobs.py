"""Work that may outlive the control call that started it (writes, exports, installs).

A job runs in the control plane's task group. Callers wait for it under their own deadline; a
retry of the same call waits for the same job instead of starting the work again.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio
from anyio.abc import TaskGroup

from protocols import DeadlineExceededError

from .clock import Clock, wait_until

T = TypeVar("T")


class Job(Generic[T]):
    """One piece of background work and its outcome.

    Args:
        name: What the job does, for error messages ("write of checkpoint c1").
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._done = anyio.Event()
        self._scope = anyio.CancelScope()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._cancelled = False

    @classmethod
    def start(cls, task_group: TaskGroup, name: str, work: Callable[[], Awaitable[T]]) -> Job[T]:
        """Start ``work`` in ``task_group`` and return its job."""
        job: Job[T] = cls(name)
        task_group.start_soon(job._run, work, name=name)
        return job

    async def _run(self, work: Callable[[], Awaitable[T]]) -> None:
        try:
            with self._scope:
                self._result = await work()
            if self._scope.cancelled_caught:
                self._cancelled = True
        except Exception as exc:  # stored, and raised to whoever waits for the job
            self._error = exc
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        """Whether the job has finished (well, badly, or cancelled)."""
        return self._done.is_set()

    @property
    def failed(self) -> bool:
        """Whether the job finished with an error or was cancelled."""
        return self.done and (self._error is not None or self._cancelled)

    def cancel(self) -> None:
        """Cancel the job; a no-op once it is done."""
        self._scope.cancel()

    async def wait_done(self) -> None:
        """Wait until the job has finished, however it finished."""
        await self._done.wait()

    async def result(self, clock: Clock, deadline: float) -> T:
        """The job's result, waiting at most until ``deadline``.

        Raises:
            DeadlineExceededError: The deadline passed first; the job keeps running.
            Exception: Whatever the job raised.
        """
        if not self.done:
            await wait_until(clock, deadline, self._done.wait)
        if not self.done:
            raise DeadlineExceededError(f"the deadline passed during the {self.name}; retry")
        if self._cancelled:
            raise DeadlineExceededError(f"the {self.name} was cancelled")
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]
