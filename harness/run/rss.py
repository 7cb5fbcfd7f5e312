"""Peak resident memory of a server's whole process tree, sampled on a thread (psutil)."""

from __future__ import annotations

import threading
import time

import psutil


class RssSampler:
    """`with RssSampler(pid) as s: ...` then `s.peak_bytes` and `s.samples` [(seconds, bytes)]."""

    def __init__(self, pid: int, interval_s: float = 0.25):
        self.pid, self.interval_s = pid, interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="rss")
        self._start = time.perf_counter()

    @property
    def peak_bytes(self) -> int:
        return max((b for _, b in self.samples), default=0)

    def tree_rss(self) -> int:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0
        total = 0
        for p in procs:
            try:
                total += p.memory_info().rss
            except psutil.NoSuchProcess:
                pass
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self.tree_rss()
            if rss:
                self.samples.append((round(time.perf_counter() - self._start, 3), rss))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
