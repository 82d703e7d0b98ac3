"""How many threads a CPU forward pass uses, chosen from what the machine gives right now.

A parallel region ends when its slowest thread does: with static row partitions and threads
that spin while they wait, one thread descheduled by another program (a browser, a compile)
stalls every region for a scheduler time slice, and decode collapses (0.75 tok/s instead of
~150 on two cores with one busy process beside it). Sleeping instead of spinning costs ~60%
on a quiet machine (every region then waits for a thread to wake). So the count adapts:

- before a call that follows an idle gap, the cores that other work keeps busy are read from
  /proc (runnable tasks of other processes) plus the threads of this process's other forward
  passes in flight, and that many are left free;
- every decode step is timed, and now and then a neighbouring count is tried for a few steps:
  one more thread while below the most, one fewer while other programs want a CPU (so a quiet
  machine tries nothing); it is kept if faster, dropped at its first clearly slower step, and
  tries back off (16 .. 256 steps apart) while the current count holds. Two slow steps in a
  row (load arrived) try one thread fewer at once.

An explicit thread count (`threads=N`) is used as given, as llama.cpp's -t is.
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from collections import deque

IDLE_GAP_S = 0.5  # a step after this much idle time starts a new call: look at the load again
PROBE_STEPS = 3  # steps a tried count runs before it is judged
FIRST_WAIT, MOST_WAIT = 16, 256  # steps between tries: reset on a change, doubled on a failed try
SLOW = 2.5  # a step this many times the recent median is slow
KEEP = 0.93  # a tried count is kept when its median step is below KEEP x the current one's


def runnable_elsewhere() -> int:
    """Tasks of other processes running or waiting for a CPU now (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/stat", "rb") as f:
            running = next(int(line.split()[1]) for line in f if line.startswith(b"procs_running"))
        ours = 0
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat", "rb") as f:
                    ours += f.read().rsplit(b")", 1)[1].split()[0] == b"R"
            except OSError:
                pass
        return max(0, running - max(ours, 1))
    except (OSError, StopIteration, ValueError, IndexError):
        return 0


# native thread id -> threads of its forward pass now running: other Python threads of this
# process (sessions side by side) are load too, but /proc cannot tell their workers from ours
RUNNING: dict[int, int] = {}


def busy_cores() -> int:
    """CPUs other work wants now: other programs' runnable tasks and this process's other passes."""
    me = threading.get_native_id()
    return runnable_elsewhere() + sum(n for t, n in list(RUNNING.items()) if t != me)


def free_cores(cores: int, samples: int = 3) -> int:
    """Cores not kept busy by other work: the least busy of a few looks 1 ms apart."""
    busy = cores
    for _ in range(samples):
        busy = min(busy, busy_cores())
        if busy == 0:
            break
        time.sleep(0.001)
    return max(1, cores - busy)


class ThreadTuner:
    """The thread count for one calling thread's forward passes (numba's count is per thread)."""

    def __init__(self, most: int, look=free_cores, busy=busy_cores, clock=time.perf_counter):
        self.most, self._look, self._busy, self._clock = most, look, busy, clock
        self.n = most
        self.recent: deque[float] = deque(maxlen=9)  # decode step seconds at self.n
        self.trying: int | None = None  # the count under trial, if any
        self.tried: list[float] = []
        self.wait, self.backoff, self.up = FIRST_WAIT, FIRST_WAIT, False
        self.slow = 0
        self.last_end = -1e9

    def begin(self) -> int:
        """The count to run the next step with."""
        if self.trying is None and self._clock() - self.last_end > IDLE_GAP_S:
            n = min(self.most, self._look(self.most))
            if n != self.n:
                self._switch(n)
        return self.n if self.trying is None else self.trying

    def end(self, seconds: float, tokens: int) -> None:
        """Record a step of `tokens` tokens that took `seconds`; only decode steps (1) teach."""
        self.last_end = self._clock()
        if tokens != 1 or self.most == 1:
            return
        if self.trying is not None:
            self._judge(seconds)
            return
        ref = statistics.median(self.recent) if len(self.recent) >= 2 else None
        self.recent.append(seconds)
        self.slow = self.slow + 1 if ref is not None and seconds > SLOW * ref else 0
        self.wait -= 1
        if self.slow >= 2 and self.n > 1:  # judged against the slow steps, not the old median
            last = list(self.recent)[-2:]
            self.recent.clear()
            self.recent.extend(last)
            self._try(self.n - 1)
        elif self.wait <= 0 and ref is not None:
            # below the most: try one more (the load may have gone), else one fewer only while
            # other programs want a CPU (on a quiet machine nothing is tried)
            self.up = not self.up
            if self.n < self.most and (self.up or self.n == 1):
                self._try(self.n + 1)
            elif self.n > 1 and self._busy() > 0:
                self._try(self.n - 1)
            else:
                self._fail()

    def _try(self, m: int) -> None:
        self.trying, self.tried, self.slow = m, [], 0

    def _judge(self, seconds: float) -> None:
        ref = statistics.median(self.recent)
        self.tried.append(seconds)
        if len(self.tried) == 1 and seconds > 1.5 * ref:
            return self._fail()  # clearly slower at once: do not pay the whole trial
        if len(self.tried) < PROBE_STEPS:
            return
        if statistics.median(self.tried) < KEEP * ref:
            m, tried = self.trying, self.tried
            self._switch(m)
            self.recent.extend(tried)
        else:
            self._fail()

    def _fail(self) -> None:
        self.trying = None
        self.backoff = min(2 * self.backoff, MOST_WAIT)
        self.wait = self.backoff

    def _switch(self, n: int) -> None:
        self.n, self.trying = n, None
        self.recent.clear()
        self.wait = self.backoff = FIRST_WAIT
        self.slow = 0
