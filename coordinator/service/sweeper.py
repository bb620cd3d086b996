"""A periodic sweep on the event loop, running while there is something to sweep: the audits'
and the stalls' (each call starts it if it stopped; it stops when its state empties)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import structlog

log = structlog.get_logger("cohortgate")


class Sweeper:
    def __init__(
        self, what: str, every_s: float, sweep: Callable[[], None], busy: Callable[[], bool]
    ) -> None:
        self.what, self.every_s, self.sweep, self.busy = what, every_s, sweep, busy
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """From a call on the loop: sweeping from now on, while busy()."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def _loop(self) -> None:
        while self.busy():
            await asyncio.sleep(self.every_s)
            try:
                self.sweep()
            except Exception:  # a bug: logged whole; the next sweep goes on
                log.exception(f"{self.what} sweep failed")

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
