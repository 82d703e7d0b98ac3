"""Start-up cost of `edgekv chat` as a person meets it: the chat runs in a pseudo-terminal,
is sent two messages, and the bench times the moments the screen shows them. Three starts,
each rep: cold (numba's cache in an empty folder: a fresh install), warm (the same folder
again: every later start), and cold after `edgekv warmup` (timed on its own). Figures are
medians over the reps, wall seconds from launching the command, with the CPU-seconds of the
whole process tree (which, unlike wall time, a busy machine does not inflate much).

    python bench/startup.py [MODEL] [-r REPS] [--kv int8] [--threads N] [--python PY] [--json]

The last column counts the files numba wrote to its cache after the prompt showed: a kernel
compiled during a turn (0 is the aim).

--python runs another install's interpreter (e.g. a checkout from before a change).
"""
from __future__ import annotations

import argparse
import json
import os
import pty
import resource
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

MESSAGES = ("Hello! Who are you?", "Tell me a short joke about cats.")


class Chat:
    """`edgekv chat` on a pseudo-terminal; marks() gives the seconds at which the screen showed
    the prompt, the end of the first reply and the end of the second."""

    def __init__(self, py: str, model: str, kv: str, env: dict, threads: int | None):
        self.t0, self.cache = time.perf_counter(), env["NUMBA_CACHE_DIR"]
        argv = [py, "-m", "edgekv.cli", "chat", model, "--kv", kv, "--temp", "0", "-n", "32"]
        argv += ["--threads", str(threads)] if threads else []
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        self.screen, self.cursor = "", 0

    def until(self, text: str, timeout: float = 900.0) -> float:
        end = time.time() + timeout
        while text not in self.screen[self.cursor :]:
            data = b"-"
            if select.select([self.fd], [], [], 1.0)[0]:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # the child has gone
                    data = b""
                self.screen += data.decode("utf-8", "replace")
            if not data or time.time() > end:
                raise RuntimeError(f"chat never showed {text!r}:\n{self.screen[-1500:]}")
        self.cursor = self.screen.index(text, self.cursor) + len(text)
        return time.perf_counter() - self.t0

    def marks(self) -> dict:
        self.until("/help for commands.")
        res = dict(prompt_s=self.until("> "))
        before = _cache_files(self.cache)
        for i, msg in enumerate(MESSAGES):
            sent = time.perf_counter() - self.t0
            os.write(self.fd, (msg + "\r").encode())
            self.until(msg)  # the echo
            done = self.until("\n> ")
            res["first_reply_s" if i == 0 else "second_turn_s"] = done if i == 0 else done - sent
        os.write(self.fd, b"/exit\r")
        os.waitpid(self.pid, 0)
        os.close(self.fd)
        res["compiled_after_prompt"] = len(_cache_files(self.cache) - before)  # kernels written to the cache
        return res


def _cache_files(d: str) -> set:
    return {(os.path.join(r, f), os.stat(os.path.join(r, f)).st_mtime_ns) for r, _, fs in os.walk(d) for f in fs}


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def one_rep(py: str, model: str, kv: str, threads: int | None) -> dict:
    out = {}
    d = tempfile.mkdtemp(prefix="edgekv-numba-")
    try:
        env = dict(os.environ, NUMBA_CACHE_DIR=d, TERM="dumb", PYTHONUNBUFFERED="1")
        for name in ("cold", "warm"):
            c = _cpu()
            out[name] = Chat(py, model, kv, env, threads).marks()
            out[name]["cpu_s"] = _cpu() - c
        shutil.rmtree(d)
        os.makedirs(d)
        c, t = _cpu(), time.perf_counter()
        if subprocess.run([py, "-m", "edgekv.cli", "warmup", "-q"], env=env, capture_output=True).returncode:
            return out  # an install without `edgekv warmup`
        out["warmup"] = dict(warmup_s=time.perf_counter() - t, cpu_s=_cpu() - c)
        c = _cpu()
        out["after_warmup"] = Chat(py, model, kv, env, threads).marks()
        out["after_warmup"]["cpu_s"] = _cpu() - c
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("-r", "--reps", type=int, default=3)
    ap.add_argument("--kv", default="int8")
    ap.add_argument("--threads", type=int, default=None, help="the chat's --threads (default: its own)")
    ap.add_argument("--python", default=sys.executable, help="interpreter of the edgekv install to time")
    ap.add_argument("--json", action="store_true", help="print the raw reps as JSON too")
    args = ap.parse_args()
    reps = []
    for i in range(args.reps):
        reps.append(one_rep(args.python, args.model, args.kv, args.threads))
        print(f"rep {i + 1}/{args.reps} done (load average {os.getloadavg()[0]:.1f})", file=sys.stderr)
    med = lambda case, key: statistics.median(r[case][key] for r in reps if key in r[case])  # noqa: E731
    print(f"{args.model}, kv {args.kv}, {args.reps} reps, medians; load average at the end "
          f"{' '.join(f'{x:.1f}' for x in os.getloadavg())}")
    print("| start | to the prompt | to the end of the 1st reply | 2nd turn | CPU-seconds | cache files written after the prompt |")
    print("| --- | --- | --- | --- | --- | --- |")
    for case, label in (("cold", "cold (empty numba cache)"), ("warm", "warm (cached)"),
                        ("after_warmup", "after `edgekv warmup`")):
        if case not in reps[0]:
            continue
        print(f"| {label} | {med(case, 'prompt_s'):.1f} s | {med(case, 'first_reply_s'):.1f} s "
              f"| {med(case, 'second_turn_s'):.2f} s | {med(case, 'cpu_s'):.1f} | {max(r[case]['compiled_after_prompt'] for r in reps)} |")
    if "warmup" in reps[0]:
        print(f"| `edgekv warmup` itself | | {med('warmup', 'warmup_s'):.1f} s | | {med('warmup', 'cpu_s'):.1f} | |")
    if args.json:
        print(json.dumps(reps))


if __name__ == "__main__":
    main()
