"""Hostile GGUF files: a malformed model must be refused with an edgekv error, never crash the
interpreter, hang, allocate without bound or reach a kernel.

Targets: the tiny synthetic llama and gemma3 files (complete, so a mutation that survives
loading runs tokenize + prefill + one decode step + detokenize + chat template on the CPU
backend), and the headers of the two real models (the data section is a sparse hole of the real
size, so loading, Config, validate_model, the tokenizer and the chat template run; no kernels).
Each case applies seeded mutations aware of the GGUF layout (bit flips, byte sets,
truncations, inflated counts / array and string lengths, shifted offsets, changed dims, type ids,
same-width value retypes and scalar values) and runs in a worker subprocess under RLIMIT_AS, with a per-case timeout:
a worker that dies (segfault, abort) or stops answering is a failure, as is any exception that
is not an EdgekvError. The crashing inputs found on the way are kept in fixtures/fuzz/ and
replayed by test_corpus.

Replay one case in-process (prints the traceback, writes the mutated file if asked):
    python tests/test_fuzz.py replay smollm2-header 123 [/tmp/case.gguf]
"""
from __future__ import annotations

import json
import math
import os
import random
import selectors
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CORPUS = HERE / "fixtures" / "fuzz"
SEED = 20240229
# cases per target: the synthetic ones are cheap (~20 ms); a real header costs one full
# tokenizer build (SmolLM2 ~0.2 s, gemma3's 262k-token vocabulary ~0.7 s)
CASES = {"llama-tiny": 2000, "gemma3-tiny": 2000, "smollm2-header": 600, "gemma3-header": 200}
CASE_TIMEOUT_S = 60.0  # a case that has not answered by then hangs (normal: < 1 s; generous for loaded CI hosts)
WARMUP_TIMEOUT_S = 900.0  # first worker: numba may compile the kernels (about a minute, cold)
# Address-space bound per worker (RLIMIT_AS), so that an allocation driven by a hostile count
# fails as MemoryError (a failure) instead of swapping. Measured VmPeak of a worker: 0.37 GB after
# the synthetic models ran, 0.68 GB after the gemma3 header (262k-token vocabulary, 253 MB map).
MEM_LIMIT = 2 << 30
PROMPT = "Hello world! The quick brown fox, 123 <s> ünïcödé"
MESSAGES = [{"role": "user", "content": "Hi"}]


# ---------------------------------------------------------------------------------------------
# GGUF layout of a valid base file: where each field lies, so that mutations hit fields.
# ---------------------------------------------------------------------------------------------
_SCALAR_SIZE = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}


@dataclass
class Layout:
    strings: list = field(default_factory=list)  # offsets of u64 string lengths (keys, values, names)
    elem_strings: list = field(default_factory=list)  # offsets of u64 lengths of strings inside arrays
    arrays: list = field(default_factory=list)  # (element type offset, count offset)
    vtypes: list = field(default_factory=list)  # offsets of u32 metadata value types
    scalars: list = field(default_factory=list)  # (offset, value type, key)
    tensors: list = field(default_factory=list)  # dict(ndims=, ne=[...], type=, offset=)
    header_end: int = 0
    data_offset: int = 0
    align: int = 32


def layout(b: bytes) -> Layout:
    """Field offsets of a valid GGUF v2/v3 (the base files only; no checks needed)."""
    L = Layout()
    u32 = lambda o: struct.unpack_from("<I", b, o)[0]  # noqa: E731
    u64 = lambda o: struct.unpack_from("<Q", b, o)[0]  # noqa: E731
    n_tensors, n_kv, p = u64(8), u64(16), 24

    def string(p, into):
        into.append(p)
        return p + 8 + u64(p)

    for _ in range(n_kv):
        p0 = p
        p = string(p, L.strings)
        key = b[p0 + 8 : p].decode()
        L.vtypes.append(p)
        vt, p = u32(p), p + 4
        if vt == 8:
            p = string(p, L.strings)
        elif vt == 9:
            et, n = u32(p), u64(p + 4)
            L.arrays.append((p, p + 4))
            p += 12
            if et == 8:
                for _ in range(n):
                    p = string(p, L.elem_strings)
            else:
                p += n * _SCALAR_SIZE[et]
        else:
            L.scalars.append((p, vt, key))
            if key == "general.alignment":
                L.align = u32(p)
            p += _SCALAR_SIZE[vt]
    for _ in range(n_tensors):
        p = string(p, L.strings)
        nd = u32(p)
        t = dict(ndims=p, ne=[p + 4 + 8 * i for i in range(nd)])
        p += 4 + 8 * nd
        t["type"], t["offset"] = p, p + 4
        p += 12
        L.tensors.append(t)
    L.header_end = p
    L.data_offset = (p + L.align - 1) // L.align * L.align
    return L


# ---------------------------------------------------------------------------------------------
# Mutations: each edits `data` (the base bytes) in place and may change the file size.
# ---------------------------------------------------------------------------------------------
def _interesting(rng: random.Random, orig: int, bits: int) -> int:
    m = (1 << bits) - 1
    vals = [0, 1, 2, 3, orig - 1, orig + 1, orig * 2, orig // 2, orig + 32, orig * 1000, m, m >> 1, (m >> 1) + 1,
            1 << (bits // 2), 255, 256, 4096, 65536, 1 << 24, rng.getrandbits(bits), rng.randrange(64)]
    return rng.choice(vals) & m


def _set(data: bytearray, off: int, fmt: str, v) -> None:
    struct.pack_into(fmt, data, off, v)


class Mutator:
    def __init__(self, base: bytes, size: int):
        self.base, self.size, self.L = base, size, layout(base)

    def case(self, target: str, index: int) -> tuple[bytearray, int, str]:
        """Deterministic mutation `index` of this target: (bytes, file size, description)."""
        rng = random.Random(f"{SEED}:{target}:{index}")
        data, size = bytearray(self.base), self.size
        ops = [rng.choice(self.OPS)] if rng.random() < 0.8 else [rng.choice(self.OPS) for _ in range(rng.randint(2, 3))]
        descs = []
        for op in ops:
            size, d = getattr(self, op)(rng, data, size)
            descs.append(d)
        return data, size, "; ".join(descs)

    OPS = ["bitflip", "bitflip", "byteset", "truncate", "count", "array_len", "string_len", "string_len",
           "offset", "dims", "type_id", "retype", "value", "value", "value"]

    def _pos(self, rng, data) -> int:
        # mostly the header, where structure lives; sometimes the tensor data
        return rng.randrange(self.L.header_end) if rng.random() < 0.85 or len(data) <= self.L.header_end \
            else rng.randrange(len(data))

    def _field(self, rng, data, off: int, bits: int, what: str) -> str:
        fmt = "<Q" if bits == 64 else "<I"
        orig = struct.unpack_from(fmt, data, off)[0]
        v = _interesting(rng, orig, bits)
        _set(data, off, fmt, v)
        return f"{what}@{off}: {orig} -> {v}"

    def bitflip(self, rng, data, size):
        offs = [self._pos(rng, data) for _ in range(rng.randint(1, 8))]
        bits = [rng.randrange(8) for _ in offs]
        for o, k in zip(offs, bits):
            data[o] ^= 1 << k
        return size, "bitflip " + ",".join(f"{o}.{k}" for o, k in zip(offs, bits))

    def byteset(self, rng, data, size):
        o = self._pos(rng, data)
        n = rng.randint(1, 8)
        v = rng.choice([0x00, 0xFF, 0x7F, 0x80, 0x01, rng.randrange(256)])
        data[o : o + n] = bytes([v]) * len(data[o : o + n])
        return size, f"byteset {o}+{n}={v:#x}"

    def truncate(self, rng, data, size):
        L = self.L
        r = rng.random()
        new = (rng.randrange(L.header_end) if r < 0.5 or size <= L.data_offset else
               rng.choice([L.header_end, L.data_offset, 0, 3, 4, 8, 23, 24]) if r < 0.7 else
               rng.randrange(L.data_offset, size))
        return min(new, size), f"truncate to {new}"

    def count(self, rng, data, size):
        off, what = rng.choice([(8, "tensor count"), (16, "kv count"), (4, "version")])
        return size, self._field(rng, data, off, 32 if off == 4 else 64, what)

    def array_len(self, rng, data, size):
        et, cnt = rng.choice(self.L.arrays)
        if rng.random() < 0.25:
            return size, self._field(rng, data, et, 32, "array element type")
        return size, self._field(rng, data, cnt, 64, "array length")

    def string_len(self, rng, data, size):
        pool = self.L.strings if rng.random() < 0.6 or not self.L.elem_strings else self.L.elem_strings
        return size, self._field(rng, data, rng.choice(pool), 64, "string length")

    def offset(self, rng, data, size):
        ts = self.L.tensors
        t = rng.choice(ts)
        orig = struct.unpack_from("<Q", data, t["offset"])[0]
        other = struct.unpack_from("<Q", data, rng.choice(ts)["offset"])[0]
        a = self.L.align
        v = rng.choice([orig + a, orig - a, orig + 1, orig - 1, other, other + a, 0, size, size - self.L.data_offset,
                        1 << 63, (1 << 64) - a, orig + rng.randrange(1, 1 << 20) * a]) % (1 << 64)
        _set(data, t["offset"], "<Q", v)
        return size, f"tensor offset@{t['offset']}: {orig} -> {v}"

    def dims(self, rng, data, size):
        t = rng.choice(self.L.tensors)
        if rng.random() < 0.3:
            return size, self._field(rng, data, t["ndims"], 32, "n_dims")
        off = rng.choice(t["ne"])
        orig = struct.unpack_from("<Q", data, off)[0]
        other = struct.unpack_from("<Q", data, rng.choice(rng.choice(self.L.tensors)["ne"]))[0]
        v = rng.choice([0, 1, orig + 1, orig - 1, orig * 2, orig // 2, orig + 32, orig + 256, other, 32, 256,
                        1 << 32, 1 << 40, 1 << 63, (1 << 64) - 1, (1 << 63) // max(orig, 1)]) % (1 << 64)
        _set(data, off, "<Q", v)
        return size, f"ne@{off}: {orig} -> {v}"

    def type_id(self, rng, data, size):
        if rng.random() < 0.6:
            off, what = rng.choice(self.L.tensors)["type"], "tensor type"
            choices = [0, 1, 2, 3, 6, 7, 8, 10, 11, 12, 13, 14, 30, 4, 5, 9, 15, 16, 20, 39, 40, 255, (1 << 32) - 1]
        else:
            off, what = rng.choice(self.L.vtypes), "value type"
            choices = list(range(14)) + [255, (1 << 32) - 1]
        orig = struct.unpack_from("<I", data, off)[0]
        v = rng.choice(choices)
        _set(data, off, "<I", v)
        return size, f"{what}@{off}: {orig} -> {v}"

    def retype(self, rng, data, size):
        """A value or array element type swapped for another of the same width: the file still
        parses, and a count becomes a float, a float an integer, a token id signed..."""
        if rng.random() < 0.7:
            off, vt, key = rng.choice(self.L.scalars)
            at, what = off - 4, f"type of {key}"
        else:
            at, _ = rng.choice(self.L.arrays)
            vt, what = struct.unpack_from("<I", data, at)[0], "array element type"
        same = [t for t, n in _SCALAR_SIZE.items() if n == _SCALAR_SIZE.get(vt) and t != vt]
        if not same:
            return size, f"{what}: no other type of its width"
        v = rng.choice(same)
        _set(data, at, "<I", v)
        return size, f"{what}@{at}: {vt} -> {v}"

    def value(self, rng, data, size):
        off, vt, key = rng.choice(self.L.scalars)
        if vt in (6, 12):
            fmt = "<f" if vt == 6 else "<d"
            orig = struct.unpack_from(fmt, data, off)[0]
            v = rng.choice([0.0, -0.0, -1.0, 1.0, math.nan, math.inf, -math.inf, 1e-38, 1e30, orig * 2, orig / 2, -orig])
            _set(data, off, fmt, v)
        else:
            n = _SCALAR_SIZE[vt]
            fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[n]
            orig = struct.unpack_from(fmt, data, off)[0]
            v = _interesting(rng, orig, 8 * n)
            _set(data, off, fmt, v)
        return size, f"value of {key}@{off}: {orig} -> {v}"


def write_case(path: str, data: bytes, size: int) -> None:
    with open(path, "wb") as f:
        f.write(memoryview(data)[: min(size, len(data))])
        if size > len(data):
            f.truncate(size)  # a sparse hole: the real model's data section, all zeros, no disk


# ---------------------------------------------------------------------------------------------
# What one case runs: the public loading path, then (for complete files) the model.
# ---------------------------------------------------------------------------------------------
def run_full(path: str) -> None:
    """LLM (GGUFFile, backend, build_model, tokenizer, chat template), then tokenize, prefill,
    one decode step, detokenize, two sampled tokens and a chat template render."""
    import numpy as np

    from edgekv import LLM

    llm = LLM(path, n_ctx=64, threads=1)
    ids = llm.tokenize(PROMPT)[:24] or [0]
    cache = llm.new_cache()
    logits = llm.forward(ids, cache, 0)
    nxt = int(np.argmax(logits[-1]))
    llm.forward([nxt], cache, len(ids))
    llm.detokenize(ids + [nxt])
    for _ in llm.generate(ids, max_tokens=2, temperature=0.8, seed=1):  # the sampler and streaming decoder
        pass
    llm.template.render(MESSAGES)


def run_header(path: str) -> None:
    """GGUFFile, the architecture's Config, validate_model, tokenizer and chat template (the
    tensor data is a hole: no kernels)."""
    from edgekv.chat_template import ChatTemplate
    from edgekv.gguf_file import GGUFFile
    from edgekv.models import model_module
    from edgekv.tokenizer import Tokenizer
    from edgekv.validate import validate_model

    f = GGUFFile(path)
    cfg = model_module(f.arch).Config.from_gguf(f)
    validate_model(f, cfg)
    tok = Tokenizer.from_metadata(f.meta)
    tok.decode(tok.encode(PROMPT))
    ChatTemplate.from_metadata(f.meta, f.meta.get("tokenizer.ggml.tokens", []), tok.bos_id, tok.eos_id).render(MESSAGES)


RUNNERS = {"run": run_full, "header": run_header}


def _selftest(kind: str):
    """Misbehaviours the harness must report (test_harness_reports_...)."""
    def run(_path):
        from edgekv.errors import ModelFileError

        if kind == "segfault":
            import ctypes
            ctypes.string_at(0)
        elif kind == "hang":
            time.sleep(3600)
        elif kind == "allocate":
            return bytearray(MEM_LIMIT)
        raise ModelFileError("refused")

    return run


def outcome(run, path: str) -> dict:
    """ok / rejected (an EdgekvError) / fail (anything else, with the traceback's tail)."""
    from edgekv.errors import EdgekvError

    try:
        run(path)
        return {"status": "ok"}
    except EdgekvError as e:
        return {"status": "rejected", "error": type(e).__name__, "message": str(e)[:300]}
    except Exception as e:  # noqa: BLE001 - any other type is exactly what this test hunts
        tb = traceback.format_exc(limit=-6)
        return {"status": "fail", "error": f"{type(e).__name__}: {str(e)[:300]}", "traceback": tb[-3000:]}


# ---------------------------------------------------------------------------------------------
# Worker process: reads one JSON request per line, answers one JSON line per request.
# ---------------------------------------------------------------------------------------------
def worker_main(spec_json: str) -> None:
    import faulthandler
    import resource
    import warnings

    spec = json.loads(spec_json)
    resource.setrlimit(resource.RLIMIT_AS, (spec["mem_limit"], spec["mem_limit"]))
    faulthandler.enable()  # a segfault prints the Python stack to stderr (the parent keeps it)
    warnings.simplefilter("ignore")  # a missing pre-tokenizer etc. is a warning, not a failure
    out = sys.stdout
    sys.stdout = sys.stderr  # nothing else may write on the answer channel
    mutators: dict = {}
    tmp = tempfile.mkdtemp(prefix="edgekv-fuzz-")
    try:
        for line in sys.stdin:
            req = json.loads(line)
            # a case about to be declared hung prints where it is stuck (the parent keeps stderr)
            faulthandler.dump_traceback_later(CASE_TIMEOUT_S * 0.9)
            if "selftest" in req:
                res, desc = outcome(_selftest(req["selftest"]), ""), req["selftest"]
            elif "corpus" in req:  # a stored file, zero-padded to its size
                path = os.path.join(tmp, "case.gguf")
                data = Path(req["corpus"]).read_bytes()
                write_case(path, data, max(req.get("pad_to") or 0, len(data)))
                res, desc = outcome(RUNNERS[req["mode"]], path), req["corpus"]
            else:
                tgt = spec["targets"][req["target"]]
                m = mutators.get(req["target"])
                if m is None:
                    m = mutators[req["target"]] = Mutator(Path(tgt["path"]).read_bytes(), tgt["size"])
                data, size, desc = m.case(req["target"], req["index"])
                path = os.path.join(tmp, "case.gguf")
                write_case(path, data, size)
                res = outcome(RUNNERS[tgt["mode"]], path)
                if res["status"] == "fail" and spec.get("keep_dir"):
                    shutil.copy(path, os.path.join(spec["keep_dir"], f"{req['target']}-{req['index']}.gguf"))
            faulthandler.cancel_dump_traceback_later()
            res["desc"] = desc
            out.write(json.dumps(res) + "\n")
            out.flush()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Worker:
    """One worker subprocess; `ask` returns its answer, or a fail for a crash or a hang (after
    which the worker is replaced)."""

    def __init__(self, spec: dict):
        self.spec = spec
        self.stderr = tempfile.TemporaryFile()
        env = dict(os.environ, NUMBA_NUM_THREADS="1", OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")
        self.p = subprocess.Popen([sys.executable, __file__, "worker", json.dumps(spec)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.stderr, env=env, cwd=str(HERE.parent),
                                  start_new_session=True)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.p.stdout, selectors.EVENT_READ)
        self.buf = b""

    def ask(self, req: dict, timeout: float) -> dict:
        try:
            self.p.stdin.write((json.dumps(req) + "\n").encode())
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died: reported below
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                return {"status": "fail", "error": f"hang: no answer within {timeout:.0f} s",
                        "traceback": self.stderr_tail()}
            if self.sel.select(left):
                chunk = os.read(self.p.stdout.fileno(), 1 << 16)
                if not chunk:  # EOF: the worker died in this case
                    rc = self.p.wait()
                    return {"status": "fail", "error": f"crash: worker exited with {rc}"
                            + (f" (signal {-rc})" if rc < 0 else ""), "traceback": self.stderr_tail()}
                self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)

    def stderr_tail(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")[-3000:]

    def alive(self) -> bool:
        return self.p.poll() is None

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.p.pid, 9)  # the worker's own session: it and anything it started
        self.p.wait()

    def close(self) -> None:
        if self.alive():
            self.p.stdin.close()
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()
        self.stderr.close()


def run_pool(spec: dict, requests: list[dict], n_workers: int, warmup: list[dict] = ()) -> list[dict]:
    """Answers to `requests` in order. The first worker answers `warmup` (unmutated files, so
    numba compiles once, into its cache) before the others start."""
    results: list = [None] * len(requests)
    todo = list(range(len(requests)))
    lock = threading.Lock()

    def take():
        with lock:
            return todo.pop(0) if todo else None

    def serve(w: Worker):
        while (i := take()) is not None:
            if not w.alive():
                w.close()
                w = Worker(spec)
            res = w.ask(requests[i], CASE_TIMEOUT_S)
            if res["status"] == "fail" and "desc" not in res:
                res["desc"] = json.dumps(requests[i])
            results[i] = res
        w.close()

    first = Worker(spec)
    for req in warmup:
        res = first.ask(req, WARMUP_TIMEOUT_S)
        assert res["status"] != "fail", f"unmutated file fails: {res}"
    threads = [threading.Thread(target=serve, args=(w,)) for w in [first] + [Worker(spec) for _ in range(n_workers - 1)]]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# ---------------------------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------------------------
def build_targets(root: Path, real: bool = True) -> dict:
    """Base files: complete tiny synthetic models, and the real models' headers."""
    from edgekv.synth import write_synthetic

    targets = {}
    for arch in ("llama", "gemma3"):
        p = write_synthetic(root / f"{arch}-tiny.gguf", arch=arch, size="tiny", qtype="q4_0", progress=False)
        targets[f"{arch}-tiny"] = {"path": str(p), "size": p.stat().st_size, "mode": "run"}
    if real:
        from conftest import model_path

        from edgekv.gguf_file import GGUFFile

        for key in ("smollm2", "gemma3"):
            src = model_path(key)
            f = GGUFFile(src)
            head = root / f"{key}.header"
            with open(src, "rb") as fin:
                head.write_bytes(fin.read(f.data_offset))
            targets[f"{key}-header"] = {"path": str(head), "size": f.size, "mode": "header"}
    return targets


def n_workers() -> int:
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(4, cpus))


def format_failures(fails: list[dict]) -> str:
    lines = []
    for r in fails[:20]:
        lines.append(f"- {r.get('desc')}: {r['error']}\n{r.get('traceback', '')}")
    return f"{len(fails)} failing cases (first {min(20, len(fails))}):\n" + "\n".join(lines)


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    return build_targets(tmp_path_factory.mktemp("fuzz"))


def test_fuzz_mutations(targets, tmp_path):
    spec = {"targets": targets, "mem_limit": MEM_LIMIT, "keep_dir": str(tmp_path)}
    requests = [{"target": t, "index": i} for i in range(max(CASES.values())) for t in CASES if i < CASES[t]]
    warmup = [{"corpus": targets[t]["path"], "mode": "run"} for t in ("llama-tiny", "gemma3-tiny")]
    t0 = time.monotonic()
    results = run_pool(spec, requests, n_workers(), warmup)
    elapsed = time.monotonic() - t0
    stats: dict = {}
    for req, r in zip(requests, results):
        s = stats.setdefault(req["target"], {"ok": 0, "rejected": 0, "fail": 0})
        s[r["status"]] += 1
    print(f"\nfuzz: {len(requests)} cases in {elapsed:.1f} s on {n_workers()} workers: {json.dumps(stats)}")
    fails = [dict(r, desc=f"{q['target']} #{q['index']}: {r.get('desc')}") for q, r in zip(requests, results)
             if r["status"] == "fail"]
    assert not fails, format_failures(fails) + f"\n(mutated files kept in {tmp_path})"
    for t, s in stats.items():  # the mutations must reach past the parser, and be caught
        assert s["ok"] > 0 and s["rejected"] > 0, (t, s)


def corpus_cases() -> list[dict]:
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    return [dict(name=name, **entry) for name, entry in sorted(manifest.items())]


def test_corpus(targets):
    """Every stored input that once crashed or escaped as a non-edgekv error now gets what the
    manifest says: refused with that error class and message, or (expect: ok) loaded and run."""
    cases = corpus_cases()
    spec = {"targets": {}, "mem_limit": MEM_LIMIT}
    requests = [{"corpus": str(CORPUS / c["name"]), "pad_to": c["pad_to"], "mode": c["mode"]} for c in cases]
    warmup = [{"corpus": targets[t]["path"], "mode": "run"} for t in ("llama-tiny", "gemma3-tiny")]
    results = run_pool(spec, requests, min(2, n_workers()), warmup)
    bad = []
    for c, r in zip(cases, results):
        if c.get("expect") == "ok":
            good = r["status"] == "ok"
        else:
            good = r["status"] == "rejected" and r["error"] == c["error"] and c["match"] in r["message"]
        if not good:
            bad.append(f"{c['name']} ({c['found']}): expected {c.get('expect') or c['error'] + ' ' + repr(c['match'])}, "
                       f"got {r}")
    assert not bad, "\n".join(bad)
    assert any(c.get("expect") != "ok" for c in cases) and len(cases) >= 5


# ---------------------------------------------------------------------------------------------
# Files that are not GGUF models at all, or GGUF that edgekv does not read: clear errors.
# ---------------------------------------------------------------------------------------------
def _gguf_header(version: bytes, n_tensors: int = 0, n_kv: int = 0) -> bytes:
    return b"GGUF" + version + struct.pack("<QQ", n_tensors, n_kv)


_NOT_MODELS = [
    ("text.gguf", b"this is not a model, just some text\n" * 4, "ModelFileError", "not a GGUF file"),
    ("empty.gguf", b"", "ModelFileError", "empty file"),
    ("short.gguf", b"GGUF\x03\x00", "ModelFileError", "truncated GGUF"),
    ("v1.gguf", b"GGUF" + struct.pack("<III", 1, 0, 0) + bytes(16), "UnsupportedModelError", "version 1"),
    ("v99.gguf", _gguf_header(struct.pack("<I", 99)), "ModelFileError", "unknown GGUF version 99"),
    ("ggjt.bin", b"tjgg" + struct.pack("<I", 3) + bytes(64), "UnsupportedModelError", "legacy GGJT"),
    ("counts.gguf", _gguf_header(struct.pack("<I", 3), 1 << 40, 1 << 40), "ModelFileError", "metadata keys"),
]


@pytest.mark.parametrize("name,content,error,match", _NOT_MODELS, ids=[c[0] for c in _NOT_MODELS])
def test_not_a_model(tmp_path, name, content, error, match):
    from edgekv import errors
    from edgekv.gguf_file import GGUFFile

    p = tmp_path / name
    p.write_bytes(content)
    with pytest.raises(getattr(errors, error), match=match) as exc:
        GGUFFile(p)
    assert name in str(exc.value)


def test_missing_path_and_directory(tmp_path):
    from edgekv import LLM
    from edgekv.errors import ModelFileError
    from edgekv.gguf_file import GGUFFile

    with pytest.raises(ModelFileError, match="No such file"):
        GGUFFile(tmp_path / "nope.gguf")
    with pytest.raises(ModelFileError, match="is a directory"):
        GGUFFile(tmp_path)
    with pytest.raises(ModelFileError, match="is a directory"):
        LLM(tmp_path)


def test_big_endian_gguf(tmp_path):
    import gguf
    import numpy as np

    from edgekv.errors import UnsupportedModelError
    from edgekv.gguf_file import GGUFFile

    p = tmp_path / "be.gguf"
    w = gguf.GGUFWriter(str(p), "llama", endianess=gguf.GGUFEndian.BIG)
    w.add_block_count(1)
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError, match="big-endian GGUF"):
        GGUFFile(p)


def _s(x: str | bytes) -> bytes:
    x = x.encode() if isinstance(x, str) else x
    return struct.pack("<Q", len(x)) + x


def _u32(key: str, v: int) -> tuple:
    return (key, 4, struct.pack("<I", v))


def _raw_gguf(kv=(), tensors=(), data: bytes = b"", version: int = 3, align: int = 32, n_kv=None) -> bytes:
    """A GGUF file from parts: kv (key, value type, packed value), tensors (name, ne, type, offset)."""
    out = b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kv) if n_kv is None else n_kv)
    for key, vt, payload in kv:
        out += _s(key) + struct.pack("<I", vt) + payload
    for name, ne, qt, off in tensors:
        out += _s(name) + struct.pack(f"<I{len(ne)}QIQ", len(ne), *ne, qt, off)
    return out + bytes(-len(out) % align) + data


_F32_64 = ("t", [64], 0, 0)  # one F32 tensor of 64 floats at offset 0 (256 bytes)


_MALFORMED = [
    ("dup-key", _raw_gguf([_u32("a", 1), _u32("a", 2)]), "ModelFileError", "metadata key a appears twice"),
    ("key-not-utf8", _raw_gguf([(b"\xff\xfe", 4, bytes(4))]), "ModelFileError", "metadata key #0 is not UTF-8"),
    ("long-name", _raw_gguf([], [("x" * 64, [64], 0, 0)], bytes(256)), "ModelFileError", "64-byte string"),
    ("align-3", _raw_gguf([_u32("general.alignment", 3)], [_F32_64], bytes(256)), "ModelFileError", "general.alignment"),
    ("align-str", _raw_gguf([("general.alignment", 8, _s("32"))], [_F32_64], bytes(256)), "ModelFileError",
     "general.alignment"),
    ("5-dims", _raw_gguf([], [("t", [1, 1, 1, 1, 64], 0, 0)], bytes(256)), "ModelFileError", "5 dimensions"),
    ("dim-0", _raw_gguf([], [("t", [64, 0], 0, 0)], bytes(256)), "ModelFileError", "every dimension must be positive"),
    ("q4-33-cols", _raw_gguf([], [("t", [33], 2, 0)], bytes(256)), "ModelFileError", "not a multiple of Q4_0's block"),
    ("type-99", _raw_gguf([], [("t", [64], 99, 0)], bytes(256)), "ModelFileError", "tensor t has unknown type id 99"),
    ("type-q8_1", _raw_gguf([], [("t", [64], 9, 0)], bytes(256)), "UnsupportedModelError", "Q8_1"),
    ("misaligned", _raw_gguf([], [_F32_64, ("u", [64], 0, 260)], bytes(600)), "ModelFileError", "not aligned to 32"),
    ("past-end", _raw_gguf([], [("t", [64, 64], 0, 0)], bytes(256)), "ModelFileError", "truncated GGUF: tensor t"),
    ("huge-dims", _raw_gguf([], [("t", [1 << 62, 1 << 62], 0, 0)], bytes(256)), "ModelFileError", "truncated GGUF"),
    ("overlap", _raw_gguf([], [("t", [128], 0, 0), ("u", [64], 0, 256)], bytes(512)), "ModelFileError", "overlap"),
    ("dup-tensor", _raw_gguf([], [_F32_64, ("t", [64], 0, 256)], bytes(512)), "ModelFileError", "appears twice"),
    ("str-array-count", _raw_gguf([("a", 9, struct.pack("<IQ", 8, 1 << 40))]), "ModelFileError", "claims 1099511627776"),
    ("num-array-count", _raw_gguf([("a", 9, struct.pack("<IQ", 6, 1 << 60))]), "ModelFileError", "runs past the end"),
    ("str-len", _raw_gguf([("a", 8, struct.pack("<Q", 1 << 62))]), "ModelFileError", "byte string"),
    ("elem-str-len", _raw_gguf([("a", 9, struct.pack("<IQQ", 8, 1, 1 << 62))]), "ModelFileError", "a\\[0\\] claims"),
    ("value-type-13", _raw_gguf([("a", 13, bytes(8))]), "ModelFileError", "unknown value type 13"),
    ("elem-type-13", _raw_gguf([("a", 9, struct.pack("<IQ", 13, 1))]), "ModelFileError", "unknown array element type"),
    ("nested", _raw_gguf([("a", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 0))]), "UnsupportedModelError",
     "array of arrays"),
    ("kv-count", _raw_gguf([], n_kv=(1 << 16) + 1), "ModelFileError", "edgekv accepts up to"),
    ("arch-int", _raw_gguf([_u32("general.architecture", 7)]), "ModelFileError",
     "general.architecture is int 7, expected a string"),
    ("scores-length", _raw_gguf([("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2) + _s("a") + _s("b")),
                                 ("tokenizer.ggml.scores", 9, struct.pack("<IQf", 6, 1, 0.0))]), "ModelFileError",
     "tokenizer.ggml.scores has 1 entries, expected one per token \\(2\\)"),
    ("token-id-str", _raw_gguf([("tokenizer.ggml.eos_token_id", 8, _s("2"))]), "ModelFileError",
     "tokenizer.ggml.eos_token_id is str"),
]


@pytest.mark.parametrize("name,content,error,match", _MALFORMED, ids=[c[0] for c in _MALFORMED])
def test_malformed_header(tmp_path, name, content, error, match):
    from edgekv import errors
    from edgekv.gguf_file import GGUFFile

    p = tmp_path / f"{name}.gguf"
    p.write_bytes(content)
    with pytest.raises(getattr(errors, error), match=match):
        GGUFFile(p)


def test_unknown_architecture_is_refused_as_such(tmp_path):
    """Hyperparameters are range-checked as a model reads them, so an architecture edgekv does
    not run opens, whatever its keys hold (OpenELM's head counts are arrays), and is refused
    for what it is."""
    from edgekv.errors import UnsupportedModelError
    from edgekv.gguf_file import GGUFFile
    from edgekv.models import model_module

    p = tmp_path / "openelm.gguf"
    p.write_bytes(_raw_gguf([("general.architecture", 8, _s("openelm")),
                             ("openelm.attention.head_count", 9, struct.pack("<IQ4I", 4, 4, 0, 12, 12, 16))]))
    f = GGUFFile(p)
    with pytest.raises(UnsupportedModelError, match="architecture 'openelm' is not supported"):
        model_module(f.arch)


def test_string_count_caps(tmp_path, monkeypatch):
    from edgekv import gguf_file
    from edgekv.errors import ModelFileError

    arr = lambda n: struct.pack("<IQ", 8, n) + _s("x") * n  # noqa: E731
    p = tmp_path / "strings.gguf"
    p.write_bytes(_raw_gguf([("a", 9, arr(5)), ("b", 9, arr(5))]))
    assert gguf_file.GGUFFile(p).meta["a"] == ["x"] * 5
    monkeypatch.setattr(gguf_file, "MAX_STRING_ARRAY", 4)
    with pytest.raises(ModelFileError, match="holds 5 strings"):
        gguf_file.GGUFFile(p)
    monkeypatch.setattr(gguf_file, "MAX_STRING_ARRAY", 5)
    monkeypatch.setattr(gguf_file, "MAX_ARRAY_STRINGS", 9)
    with pytest.raises(ModelFileError, match="b holds 5 strings"):
        gguf_file.GGUFFile(p)
    monkeypatch.setattr(gguf_file, "MAX_ARRAY_STRINGS", 10)
    monkeypatch.setattr(gguf_file, "MAX_META_BYTES", 8)  # keys "a", "b" and ten 1-byte strings: 12 bytes
    with pytest.raises(ModelFileError, match=r"more than 0 MiB of strings and arrays .* reached at b\[1\]"):
        gguf_file.GGUFFile(p)
    monkeypatch.setattr(gguf_file, "MAX_META_BYTES", 12)
    assert gguf_file.GGUFFile(p).meta["b"] == ["x"] * 5
    monkeypatch.setattr(gguf_file, "MAX_STRING", 0)
    with pytest.raises(ModelFileError, match=r"a\[0\] claims a 1-byte string"):
        gguf_file.GGUFFile(p)


def _corpus_tools():
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_corpus", CORPUS / "make_corpus.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _config(path):
    from edgekv.gguf_file import GGUFFile
    from edgekv.models import model_module

    f = GGUFFile(path)
    return f, model_module(f.arch).Config.from_gguf(f)


def test_validate_model_accepts_real_and_synthetic_models(targets):
    from conftest import model_path

    from edgekv.validate import validate_model

    for path in [targets["llama-tiny"]["path"], targets["gemma3-tiny"]["path"], model_path("smollm2"),
                 model_path("gemma3")]:
        validate_model(*_config(path))


def test_validate_model_rejects(targets, tmp_path):
    import gguf
    import numpy as np

    from edgekv.errors import ModelFileError
    from edgekv.validate import validate_model

    mc, V = _corpus_tools(), gguf.GGUFValueType
    llama, gemma = Path(targets["llama-tiny"]["path"]), Path(targets["gemma3-tiny"]["path"])
    fields = gguf.GGUFReader(llama).fields
    short = {k: (fields[k].contents()[:-5], V.ARRAY, sub) for k, sub in
             (("tokenizer.ggml.tokens", V.STRING), ("tokenizer.ggml.scores", V.FLOAT32),
              ("tokenizer.ggml.token_type", V.INT32))}
    bias = lambda n, i=2: {f"blk.{j}.attn_{x}.bias": np.zeros(n if x == "q" else n // 2, np.float32)  # noqa: E731
                           for j in range(i) for x in "qkv"}
    cases = [
        (llama, dict(set_kv=short), "tokenizer.ggml.tokens has 315 tokens but token_embd.weight has 320 rows"),
        (llama, dict(set_kv={"tokenizer.ggml.bos_token_id": (320, V.UINT32)}), "bos_token_id is 320, outside"),
        (llama, dict(set_kv={"tokenizer.ggml.eot_token_id": (1 << 20, V.UINT32)}), "eot_token_id is 1048576"),
        (llama, dict(set_kv={"llama.vocab_size": (321, V.UINT32)}), "llama.vocab_size is 321"),
        (llama, dict(arch="qwen2", add_tensors=bias(200)), "tensor blk.0.attn_q.bias is F32 \\(200,\\)"),
        (llama, dict(arch="qwen2", add_tensors={"blk.1.attn_q.bias": np.zeros(256, np.float32)}),
         "layer 1 has only some of the attention biases"),
        (gemma, dict(add_tensors={"output.weight": np.zeros((352, 256), np.float32)}), "output.weight has shape"),
        # hyperparameters are range-checked as they are read (GGUFFile.get), before any division
        (llama, dict(set_kv={"llama.attention.head_count": (0, V.UINT32)}), "llama.attention.head_count is int 0"),
        (llama, dict(set_kv={"llama.rope.freq_base": (math.nan, V.FLOAT32)}), "llama.rope.freq_base is float nan"),
        (gemma, dict(set_kv={"gemma3.context_length": (512, V.UINT32),
                             "gemma3.attention.sliding_window": (1 << 24, V.UINT32)}),
         "sliding_window is 16777216, larger than gemma3.context_length"),
    ]
    for i, (src, kw, match) in enumerate(cases):
        p = tmp_path / f"case{i}.gguf"
        mc.rewrite(src, p, **kw)
        with pytest.raises(ModelFileError, match=match):  # Config.from_gguf runs validate_model
            _config(p)
    ok = tmp_path / "qwen2-ok.gguf"  # biases of the right shapes pass
    mc.rewrite(llama, ok, arch="qwen2", add_tensors=bias(256))
    validate_model(*_config(ok))
    pad = tmp_path / "pad.gguf"  # a padding id past the vocabulary is tolerated, as llama.cpp does
    mc.rewrite(llama, pad, set_kv={"tokenizer.ggml.padding_token_id": (320, V.UINT32)})
    validate_model(*_config(pad))


def test_corpus_is_current(targets, tmp_path):
    """The stored corpus is what make_corpus.py writes (synth and gguf's writer are deterministic)."""
    manifest = json.loads((CORPUS / "manifest.json").read_text())
    cases = _corpus_tools().cases(Path(targets["llama-tiny"]["path"]), Path(targets["gemma3-tiny"]["path"]))
    assert sorted(f"{n}.gguf" for n in cases) == sorted(manifest)
    for name, c in cases.items():
        full = tmp_path / f"{name}.gguf"
        c["make"](full)
        stored = (CORPUS / f"{name}.gguf").read_bytes()
        assert full.read_bytes()[: len(stored)] == stored, name
        assert manifest[f"{name}.gguf"]["pad_to"] == full.stat().st_size, name


def test_harness_reports_crash_hang_and_allocation():
    """A segfault, a hang and an allocation beyond MEM_LIMIT each come back as a failure of that
    case, and the worker is replaced so that the next cases still run."""
    globals()["CASE_TIMEOUT_S"], saved = 5.0, CASE_TIMEOUT_S
    try:
        kinds = ["refuse", "segfault", "refuse", "hang", "refuse", "allocate", "refuse"]
        res = run_pool({"targets": {}, "mem_limit": MEM_LIMIT}, [{"selftest": k} for k in kinds], 1)
    finally:
        globals()["CASE_TIMEOUT_S"] = saved
    got = dict(zip(kinds, res))
    assert [r["status"] for r in res] == ["rejected", "fail", "rejected", "fail", "rejected", "fail", "rejected"]
    assert "crash: worker exited with -11 (signal 11)" in got["segfault"]["error"]
    assert "Segmentation fault" in got["segfault"]["traceback"]  # faulthandler's report reached us
    assert got["hang"]["error"].startswith("hang: no answer within 5 s")
    assert got["allocate"]["error"].startswith("MemoryError")


def test_layout_walker_matches_gguf_reader(targets):
    """The mutator's field offsets are right: checked against gguf's reader on the synthetic files."""
    import gguf

    for t in ("llama-tiny", "gemma3-tiny"):
        path = targets[t]["path"]
        b = Path(path).read_bytes()
        L, r = layout(b), gguf.GGUFReader(path)
        assert L.data_offset == r.data_offset
        assert [struct.unpack_from("<Q", b, tt["offset"])[0] for tt in L.tensors] == \
            [int(tt.data_offset) - r.data_offset for tt in r.tensors]
        scalars = {k: f.contents() for k, f in r.fields.items() if not k.startswith("GGUF.") and f.types[0] not in (8, 9)}
        assert sorted(key for _, _, key in L.scalars) == sorted(scalars)
        fmts = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
        for off, vt, key in L.scalars:
            assert struct.unpack_from(fmts[vt], b, off)[0] == pytest.approx(scalars[key]), key


def test_mutations_are_deterministic(targets):
    base = Path(targets["llama-tiny"]["path"]).read_bytes()
    a, b = Mutator(base, len(base)), Mutator(base, len(base))
    for i in range(50):
        assert a.case("llama-tiny", i) == b.case("llama-tiny", i)


# ---------------------------------------------------------------------------------------------
def _replay(target: str, index: int, out: str | None) -> None:
    root = Path(tempfile.mkdtemp(prefix="edgekv-replay-"))
    tgt = build_targets(root, real=target.endswith("-header"))[target]
    data, size, desc = Mutator(Path(tgt["path"]).read_bytes(), tgt["size"]).case(target, index)
    path = out or str(root / "case.gguf")
    write_case(path, data, size)
    print(f"{target} #{index}: {desc} -> {path} ({size} bytes)")
    try:
        RUNNERS[tgt["mode"]](path)
        print("loads fine")
    except Exception:  # noqa: BLE001 - shown, whatever it is
        traceback.print_exc()


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))  # conftest
    if sys.argv[1] == "worker":
        worker_main(sys.argv[2])
    elif sys.argv[1] == "replay":
        _replay(sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
