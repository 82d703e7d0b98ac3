"""The thread count under load (edgekv/backends/threads.py): the tuner's decisions on scripted
step times, the /proc reading, and a real decode beside busy processes finishing in bounded time."""
import os
import subprocess
import sys
import time

import pytest

from edgekv.backends import threads as T


class Machine:
    """A scripted machine: step seconds as a function of the thread count, a clock, a load."""

    def __init__(self, cost, busy=0):
        self.cost, self.busy, self.t = cost, busy, 0.0

    def clock(self):
        return self.t

    def tuner(self, most):
        return T.ThreadTuner(most, look=lambda cores: max(1, cores - self.busy), busy=lambda: self.busy,
                             clock=self.clock)

    def decode(self, tuner, steps):
        used = []
        for _ in range(steps):
            n = tuner.begin()
            dt = self.cost(n)
            self.t += dt
            tuner.end(dt, 1)
            used.append(n)
        return used


def quiet(n):
    return 0.010 / n  # two threads twice as fast


def loaded(n):
    return 0.012 if n == 1 else 0.300  # a busy process beside: a second thread stalls every region


def test_quiet_machine_keeps_all_threads_and_tries_nothing():
    m = Machine(quiet)
    tuner = m.tuner(2)
    assert set(m.decode(tuner, 600)) == {2}


def test_a_busy_machine_starts_with_the_free_cores_and_rarely_tries_more():
    m = Machine(loaded, busy=1)
    tuner = m.tuner(2)
    used = m.decode(tuner, 600)
    assert used[0] == 1 and tuner.n == 1
    tries = used.count(2)  # each try of 2 threads ends at its first slow step, tries back off
    assert 1 <= tries <= 8
    assert sum(map(loaded, used)) < 1.4 * 600 * loaded(1)


def test_load_that_arrives_mid_decode_drops_a_thread_within_a_few_steps():
    m = Machine(quiet)
    tuner = m.tuner(2)
    m.decode(tuner, 50)
    m.cost, m.busy = loaded, 1
    used = m.decode(tuner, 50)
    assert used[:6].count(1) >= 1 and set(used[6:20]) == {1}


def test_load_that_goes_away_gets_its_threads_back():
    m = Machine(loaded, busy=1)
    tuner = m.tuner(2)
    m.decode(tuner, 300)
    m.cost, m.busy = quiet, 0
    used = m.decode(tuner, 300)
    assert used[-50:] == [2] * 50
    assert used.index(2) <= T.MOST_WAIT + T.PROBE_STEPS


def test_more_cores_settle_on_the_fastest_count():
    # 8 cores, 3 kept busy: 5 threads is best; more stall, fewer are slower
    def cost(n):
        return 0.040 / n if n <= 5 else 0.2
    m = Machine(cost, busy=3)
    tuner = m.tuner(8)
    used = m.decode(tuner, 400)
    assert used[0] == 5 and used[-100:].count(5) >= 95


def test_prefill_steps_use_the_count_but_do_not_teach():
    m = Machine(quiet)
    tuner = m.tuner(2)
    for _ in range(100):
        assert tuner.begin() == 2
        tuner.end(5.0, 512)  # however slow a prefill chunk is
    assert tuner.n == 2 and tuner.trying is None


def test_an_idle_gap_looks_at_the_load_again():
    m = Machine(quiet)
    tuner = m.tuner(2)
    m.decode(tuner, 20)
    m.busy, m.cost = 1, loaded
    m.t += 10  # a new call after the user read the reply
    assert tuner.begin() == 1


def test_runnable_elsewhere_sees_a_busy_process():
    if not os.path.exists("/proc/stat"):
        pytest.skip("no /proc: the load is not read on this system")
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)
        seen = max(T.runnable_elsewhere() for _ in range(20))
    finally:
        busy.kill()
        busy.wait()
    assert seen >= 1  # (other processes may come and go meanwhile: no comparison with before)
    assert 1 <= T.free_cores(os.cpu_count() or 1) <= (os.cpu_count() or 1)


def test_explicit_threads_are_used_as_given():
    from edgekv.backends.cpu import CPUBackend

    be = CPUBackend(threads=1)
    with be.step(1):
        import numba

        assert numba.get_num_threads() == 1
    assert be.current_threads == 1 and not be.auto_threads


def test_decode_beside_busy_processes_finishes_in_bounded_time():
    """One busy process per core but one beside the decode (issue 13's laptop): the default
    thread choice must not collapse (it was 100x slower than one thread, 0.75 tok/s)."""
    import edgekv

    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("one CPU: there is no thread count to choose")
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores - 1)]
    try:
        time.sleep(0.5)
        times = {}
        for threads in (1, None):  # one thread: the floor the default must stay near
            llm = edgekv.load("smollm2-135m-instruct", n_ctx=256, threads=threads, progress=False)
            llm.complete("Hello", max_tokens=2)  # compiled, pages mapped
            t = time.perf_counter()
            llm.complete("The capital of France is", max_tokens=48)
            times[threads] = time.perf_counter() - t
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert times[None] < 3 * times[1] + 2.0, times


def test_other_passes_of_this_process_count_as_load(monkeypatch):
    """Sessions generating side by side in one process: /proc cannot tell their workers from
    ours, so the passes in flight are counted from the backend's own table."""
    monkeypatch.setattr(T, "runnable_elsewhere", lambda: 0)
    assert T.free_cores(4) == 4
    monkeypatch.setitem(T.RUNNING, -1, 3)  # another thread's pass, 3 threads
    assert T.free_cores(4) == 1
    import threading
    monkeypatch.setitem(T.RUNNING, threading.get_native_id(), 2)  # our own pass is not load
    assert T.free_cores(4) == 1


def test_decode_gives_the_same_bits_with_any_thread_count():
    """The same prompt prefilled and decoded with 1 and 2 threads: identical logits at every step
    (the thread tuner picks the count by the machine's load, so nothing may depend on it)."""
    import numpy as np

    from conftest import model_path
    from edgekv import LLM

    outs = []
    for n in (1, 2):
        llm = LLM(model_path("smollm2"), n_ctx=1024, kv="int8", threads=n, prompt_cache=False)
        ids = llm.tokenize(open(__file__).read())[:700]
        cache = llm.new_cache()
        steps = [llm.forward(ids[:690], cache, 0)[-1]]
        steps += [llm.forward(ids[p : p + 1], cache, p)[-1] for p in range(690, 700)]
        outs.append(np.stack(steps))
    np.testing.assert_array_equal(outs[0], outs[1])


def test_a_thread_done_with_kernels_gives_its_openmp_pool_back():
    # the main thread's pool, freed (libgomp's pause), comes back at its next kernel with the same
    # results; a thread generating after the loading thread released its pool sees the same text
    import threading

    import numba
    import numpy as np

    from conftest import model_path
    from edgekv import LLM
    from edgekv.backends import cpu

    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float32)
    llm = LLM(model_path("smollm2"), n_ctx=64, prompt_cache=False)
    want = llm.backend.rmsnorm(x, np.ones(64, np.float32), 1e-6)
    llm.backend.release_threads()
    if numba.threading_layer() == "omp":  # where the pool is libgomp's, its pause was found and works
        assert cpu._GOMP and cpu._GOMP[0] is not None and cpu._GOMP[0](1) == 0
    assert np.array_equal(llm.backend.rmsnorm(x, np.ones(64, np.float32), 1e-6), want)
    alone = "".join(e.text for e in llm.generate("Hello", max_tokens=8, temperature=0.0))
    got = []
    t = threading.Thread(target=lambda: got.append("".join(e.text for e in llm.generate("Hello", max_tokens=8,
                                                                                     temperature=0.0))))
    t.start()
    t.join()
    assert got == [alone]
