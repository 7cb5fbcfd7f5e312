"""Signals during a run: the first SIGTERM, SIGHUP or SIGINT stops it (`RunInterrupted`) and the cleanup it
starts runs to its end."""

from __future__ import annotations

import signal
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

INTERRUPT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)


class RunInterrupted(KeyboardInterrupt):
    """A signal stopped the run. A KeyboardInterrupt, so that nothing catching Exception swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def signal_name(e: BaseException) -> str:
    return signal.Signals(e.signum).name if isinstance(e, RunInterrupted) else "SIGINT"


class Interrupts:
    """While `installed()`, the first SIGTERM, SIGHUP or SIGINT raises RunInterrupted in the main thread; later
    ones are ignored, so the cleanup the first one started runs to its end. Inside `deferred()` (stopping a
    server, writing the records) a signal waits until the block ends. Not installed, both are no-ops."""

    def __init__(self) -> None:
        self.fired: int | None = None
        self._pending: int | None = None
        self._depth = 0

    @contextmanager
    def installed(self, signums: Sequence[int] = INTERRUPT_SIGNALS) -> Iterator[Interrupts]:
        previous = {s: signal.signal(s, self._handler) for s in signums}
        try:
            yield self
        finally:
            for s, h in previous.items():
                signal.signal(s, h)

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._pending is not None:
                self._raise(self._pending)

    def check(self) -> None:
        """Raise again the RunInterrupted of a signal that fired where Python only prints an exception (a handler
        runs between any two bytecodes, also inside an import lock's or a weakref's callback or a `__del__`), so
        the run went on: the run calls it where it goes on (a server ready, a phase, its end), which a delivered
        RunInterrupted never reaches."""
        if self.fired is not None and not self._depth:
            raise RunInterrupted(self.fired)

    def _handler(self, signum: int, frame) -> None:
        if self.fired is not None:
            return
        if self._depth:
            self._pending = signum
            return
        self._raise(signum)

    def _raise(self, signum: int) -> None:
        self.fired, self._pending = signum, None
        raise RunInterrupted(signum)
