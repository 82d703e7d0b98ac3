"""JIT cost at start-up: a fresh process loads a model and generates its first token, twice,
with numba's cache in an empty folder: the first run compiles every kernel the model needs,
the second finds them cached (what every later start of edgekv sees).

    python bench/startup.py [MODEL] [--kv int8]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = """
import json, sys, time
t0 = time.perf_counter()
import edgekv
llm = edgekv.load(sys.argv[1], kv=sys.argv[2], progress=False)
t1 = time.perf_counter()
next(iter(llm.generate("Hello", max_tokens=2)))  # prefill and the first token
t2 = time.perf_counter()
next(iter(llm.generate("Hi", max_tokens=3)))
list(llm.generate("Hi", max_tokens=3))  # decode steps too
t3 = time.perf_counter()
print(json.dumps(dict(import_load_s=t1 - t0, first_token_s=t2 - t1, decode_s=t3 - t2)))
"""


def run(model: str, kv: str, cache_dir: str) -> dict:
    env = dict(os.environ, NUMBA_CACHE_DIR=cache_dir)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", CHILD, model, kv], env=env, capture_output=True, text=True, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t  # interpreter start to exit
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    ap.add_argument("--kv", default="int8")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        first, cached = run(args.model, args.kv, d), run(args.model, args.kv, d)
    for name, r in (("first run (compiles)", first), ("cached start", cached)):
        print(f"{name:22s} start to first token {r['import_load_s'] + r['first_token_s']:6.2f} s "
              f"(import+load {r['import_load_s']:.2f}, prefill+token {r['first_token_s']:.2f}), "
              f"first decode steps {r['decode_s']:.2f} s, whole process {r['process_s']:.2f} s")


if __name__ == "__main__":
    main()
