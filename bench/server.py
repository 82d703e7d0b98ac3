"""The server under load: aggregate tokens/s and time to first token (TTFT) for 1, 4 and 8
clients streaming completions at once through `edgekv serve`, and (--compare llama.cpp) through
llama-cpp-python's server on the same model, same threads, in the same run. Both servers stay up;
client counts and servers take turns rep by rep, so a change in the machine's load falls on all
alike; each figure is the median of its reps.

Every request is a distinct prompt (no prompt-cache help), greedy, end-of-generation tokens
banned, so each client gets exactly -n tokens. Aggregate tokens/s: all clients' tokens over the
span from the first request sent to the last token received (prefill included). TTFT: from a
request sent to its first token. llama-cpp-python's server runs one request at a time (requests
queue; `--interrupt_requests False`, else a new request would cut the streaming one); it has no
`--n_parallel` (llama.cpp's own llama-server has).

    python bench/server.py [MODEL] [--clients 1,4,8] [-n 64] [-r 3] [--ctx 512] [--threads 2]
                           [--compare llama.cpp] [--llama-python /path/to/python]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from batch import machine  # noqa: E402

TOPICS = ["a dragon", "the sea", "a small robot", "an old map", "winter", "a lost key", "the moon", "a market"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server process on 127.0.0.1:port, up until stop()."""

    def __init__(self, name: str, cmd: list[str], port: int):
        self.name, self.port = name, port
        self.url = f"http://127.0.0.1:{port}/v1"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-server-{name}.log", "w")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        end = time.time() + 600
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"{name} server exited ({self.proc.returncode}); see {self.log.name}")
            try:
                httpx.get(self.url + "/models", timeout=2).raise_for_status()
                return
            except httpx.HTTPError:
                if time.time() > end:
                    raise SystemExit(f"{name} server did not start; see {self.log.name}")
                time.sleep(0.5)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def stream_one(url: str, prompt: str, n: int, ban: dict, out: list, i: int, t0: float) -> None:
    """One streaming completion; out[i] = (seconds to first token, tokens, finish_reason, end time)."""
    body = dict(prompt=prompt, max_tokens=n, temperature=0, stream=True, logit_bias=ban)
    first, tokens, reason = None, 0, None
    with httpx.stream("POST", url + "/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            if choice.get("text"):
                tokens += 1
                first = first if first is not None else time.perf_counter() - t0
            reason = choice.get("finish_reason") or reason
    out[i] = (first, tokens, reason, time.perf_counter())


def round_of(server: Server, clients: int, n: int, ban: dict, tag: str) -> dict:
    """`clients` requests at once: aggregate tokens/s and TTFTs."""
    out = [None] * clients
    t0 = time.perf_counter()
    threads = [threading.Thread(target=stream_one, args=(server.url, f"Request {tag}-{i}: a story about "
                                                         f"{TOPICS[i % len(TOPICS)]}. Once upon a time",
                                                         n, ban, out, i, time.perf_counter()))
               for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if any(o is None for o in out):
        raise SystemExit(f"{server.name}: a request failed")
    tokens = sum(o[1] for o in out)
    span = max(o[3] for o in out) - t0
    return dict(tokens=tokens, tps=tokens / span, ttft=[o[0] for o in out], reasons={o[2] for o in out})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("-n", type=int, default=64, help="tokens per request")
    ap.add_argument("-r", type=int, default=3, help="reps (after a warm-up round)")
    ap.add_argument("--ctx", type=int, default=512, help="context per sequence")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv", default="f16", help="edgekv's cache type (f16: as llama.cpp's default cache)")
    ap.add_argument("--compare", choices=["llama.cpp"], default=None)
    ap.add_argument("--llama-python", default=sys.executable, help="a python with llama-cpp-python and its server")
    args = ap.parse_args()
    clients = [int(c) for c in args.clients.split(",")]

    from edgekv.gguf_file import GGUFFile
    from edgekv.hub import resolve
    from edgekv.tokenizer import Tokenizer

    path = resolve(args.model)
    ban = {str(t): -100 for t in Tokenizer.from_metadata(GGUFFile(path).meta).eot_ids}
    port = free_port()
    servers = [Server("edgekv", [sys.executable, "-m", "edgekv.cli", "serve", str(path), "--port", str(port),
                                 "--parallel", str(max(clients)), "--ctx", str(args.ctx), "--kv", args.kv,
                                 "--threads", str(args.threads), "-q", "--log-format", "json"], port)]
    try:
        if args.compare:
            port = free_port()
            servers.append(Server("llama.cpp", [args.llama_python, "-m", "llama_cpp.server", "--model", str(path),
                                                "--port", str(port), "--n_ctx", str(args.ctx), "--n_threads",
                                                str(args.threads), "--n_threads_batch", str(args.threads),
                                                "--interrupt_requests", "False", "--verbose", "False"], port))
        for s in servers:  # warm-up: kernels compiled, batched paths taken once
            round_of(s, max(clients), 4, ban, f"warm-{s.name}")
        runs: dict = {}
        for rep in range(args.r):
            for c in clients:
                for s in servers:
                    res = round_of(s, c, args.n, ban, f"{rep}-{c}")
                    if res["reasons"] != {"length"} or res["tokens"] != c * args.n:
                        print(f"note: {s.name} x{c}: {res['tokens']} tokens, finish {res['reasons']}", file=sys.stderr)
                    runs.setdefault((s.name, c), []).append(res)
    finally:
        for s in servers:
            s.stop()
    print(f"# bench/server.py, {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC, {machine()}")
    print(f"# {Path(path).name}, {args.n} tokens per request, ctx {args.ctx}, {args.threads} threads, edgekv kv "
          f"{args.kv}, median of {args.r} reps\n")
    print("| server | clients | aggregate tok/s | TTFT median | TTFT max |")
    print("| --- | --- | --- | --- | --- |")
    for (name, c), rs in runs.items():
        ttft = [statistics.median(r["ttft"]) for r in rs]
        worst = [max(r["ttft"]) for r in rs]
        print(f"| {name} | {c} | {statistics.median(r['tps'] for r in rs):.1f} | "
              f"{statistics.median(ttft) * 1e3:.0f} ms | {statistics.median(worst) * 1e3:.0f} ms |")


if __name__ == "__main__":
    main()
