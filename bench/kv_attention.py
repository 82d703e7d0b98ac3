"""Decode and prefill speed of kv_attention over f16 / int8 / int4 rings.

Decode (one query) reads the whole cache once, so the table gives time per call and the
cache bytes read per second (K and V with their scales): how near memory speed it runs
(a 2-core znver4 streams ~20 GB/s per core). Each call reads a different layer's ring from
a set larger than the L3 cache, as a real forward pass does. Two threads on a
busy 2-core machine measure the scheduler (a parallel call waits ~8 ms for a descheduled
thread): run it on a quiet machine.

    python bench/kv_attention.py [--threads 2] [--prefill] [--quality [--model PATH ...]]
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numba
import numpy as np

from edgekv.backends.cpu import CPUBackend
from edgekv.kernels_cpu import kvquant as kq

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Gemma-3-270M": (4, 1, 256)}  # (H, Hkv, hd)
SLOTS = (512, 2048, 4096)
WORKING_SET = 96 << 20  # bytes of rings cycled through: three times the 32 MiB L3


def ring_bytes(kind: str, slots: int, n_head_kv: int, hd: int) -> int:
    """Bytes attention reads from one layer's ring: K and V (scales included) and pos."""
    return int(2 * slots * n_head_kv * hd * {"f16": 2.0, "int8": 34 / 32, "int4": 18 / 32}[kind]) + 8 * slots


def make_rings(kind: str, slots: int, n_head_kv: int, hd: int, n_layers: int, rng) -> list[tuple]:
    layers = []
    x = rng.standard_normal((slots, n_head_kv, hd)).astype(np.float32)
    for _ in range(n_layers):
        k, ks = kq.kv_arrays(kind, slots, n_head_kv, hd)
        v, vs = kq.kv_arrays(kind, slots, n_head_kv, hd)
        kq.kv_store(kind, x, k, ks, np.arange(slots), kind != "f16")
        kq.kv_store(kind, x, v, vs, np.arange(slots), False)
        layers.append((k, ks, v, vs))
    return layers


def time_calls(fn, n_layers: int, min_time: float = 0.3) -> float:
    """Median seconds of one call, cycling through the layers. The median, not the mean:
    on a shared machine a parallel call now and then waits milliseconds for a descheduled
    thread, which says nothing about the kernel."""
    for l in range(n_layers):
        fn(l)  # compile, warm
    times = []
    t_end = time.perf_counter() + min_time
    while time.perf_counter() < t_end or len(times) < 20:
        for l in range(n_layers):
            t0 = time.perf_counter()
            fn(l)
            times.append(time.perf_counter() - t0)
    return float(np.median(times))


def bench_decode(rng) -> None:
    print(f"\n### decode: one query, {numba.get_num_threads()} threads\n")
    print("| model (H/Hkv/hd) | slots | kind | us/call | GB/s | vs f16 |")
    print("|---|---:|---|---:|---:|---:|")
    for name, (H, Hkv, hd) in SHAPES.items():
        for slots in SLOTS:
            pos = np.arange(slots, dtype=np.int64)
            q = rng.standard_normal((1, H, hd)).astype(np.float32)
            q_pos = np.array([slots - 1], np.int64)
            t_f16 = None
            for kind in ("f16", "int8", "int4"):
                nbytes = ring_bytes(kind, slots, Hkv, hd)
                n_layers = max(4, WORKING_SET // nbytes)
                rings = make_rings(kind, slots, Hkv, hd, n_layers, rng)
                out = np.empty_like(q)

                def fn(l, rings=rings, kind=kind):
                    k, ks, v, vs = rings[l]
                    kq.kv_attention(kind, q, None, q_pos, k, ks, v, vs, pos, 4, None, None, None, 0.125, 0, False, out)
                t = time_calls(fn, n_layers)
                t_f16 = t if kind == "f16" else t_f16
                print(f"| {name} ({H}/{Hkv}/{hd}) | {slots} | {kind} | {t * 1e6:.1f} | {nbytes / t / 1e9:.1f} | {t_f16 / t:.2f}x |")
                del rings


def bench_prefill(rng) -> None:
    n, slots, m = 512, 4096, 512
    print(f"\n### prefill: {n} queries over {slots} full slots + {m} fresh keys, {numba.get_num_threads()} threads\n")
    print("| model (H/Hkv/hd) | kind | ms/call | GFLOP/s |")
    print("|---|---|---:|---:|")
    for name, (H, Hkv, hd) in SHAPES.items():
        pos = np.arange(slots, dtype=np.int64)
        q = rng.standard_normal((n, H, hd)).astype(np.float32)
        q_pos = np.arange(slots + m - n, slots + m, dtype=np.int64)
        fk = rng.standard_normal((m, Hkv, hd)).astype(np.float32)
        fpos = np.arange(slots, slots + m, dtype=np.int64)
        flops = 4.0 * n * H * hd * (slots + m / 2)  # QK and PV, causal half of the fresh keys
        for kind in ("f16", "int8", "int4"):
            k, ks, v, vs = make_rings(kind, slots, Hkv, hd, 1, rng)[0]
            out = np.empty_like(q)

            def fn(_, kind=kind, k=k, ks=ks, v=v, vs=vs):
                kq.kv_attention(kind, q, None, q_pos, k, ks, v, vs, pos, 4, fk, fk, fpos, 0.125, 0, False, out)

            t = time_calls(fn, 1, 1.0)
            print(f"| {name} ({H}/{Hkv}/{hd}) | {kind} | {t * 1e3:.1f} | {flops / t / 1e9:.1f} |")


def exact_attention(q, q_pos, k, v, k_pos, scale, window):
    """(n, H, hd) float64 causal softmax attention of q over k, v (S, Hkv, hd)."""
    H, Hkv = q.shape[1], k.shape[1]
    kk = np.repeat(k.astype(np.float64), H // Hkv, axis=1)  # (S, H, hd)
    vv = np.repeat(v.astype(np.float64), H // Hkv, axis=1)
    s = np.einsum("nhd,shd->nhs", q.astype(np.float64), kk) * scale
    hide = (k_pos[None, :] > q_pos[:, None]) | ((q_pos[:, None] - k_pos[None, :] >= window) if window else False)
    s[np.broadcast_to(hide[:, None, :], s.shape)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("nhs,shd->nhd", p, vv)


DEFAULT_MODELS = [
    Path.home() / ".cache/edgekv/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    Path.home() / ".cache/edgekv/models/gemma-3-270m-q4_k_m.gguf",
]
TEXT = Path(__file__).resolve().parents[1] / "tests/fixtures/text_en.txt"


def capture_qkv(path: Path, n_tok: int) -> list[tuple]:
    """Run n_tok tokens of English text through a real model; return each layer's
    (q, k, v, scale, window) as its attention saw them (post-RoPE, float32)."""
    import edgekv

    llm = edgekv.LLM(path, n_ctx=n_tok)
    ids = llm.tokenize(TEXT.read_text())[:n_tok]
    seen = []
    inner = llm.backend.attention

    def spy(q, q_pos, kv, k, v, scale, window):
        seen.append((q.copy(), k.copy(), v.copy(), scale, window))
        return inner(q, q_pos, kv, k, v, scale, window)

    llm.backend.attention = spy
    llm.model.forward(np.asarray(ids, np.int64), np.arange(len(ids), dtype=np.int64), llm.new_cache(), last_only=True)
    return seen


CONFIGS = [  # (kind, rotate K, rotate V); int4 with the cache's fitted step (the absmax and q4_0
    # steps this table also had are gone from the kernels: bench/RESULTS.md keeps their figures)
    ("f16", False, False),
    ("int8", False, False), ("int8", True, False), ("int8", True, True),
    ("int4", False, False), ("int4", True, False), ("int4", True, True),
]


def bench_quality(models: list[Path], n_tok: int = 1024, n_q: int = 64) -> None:
    """Attention-output error of each cache configuration on real models' q, k, v: the last
    n_q queries of an n_tok-token text against all its keys, per layer, vs float64."""
    print(f"\n### quality: attention output error on real K/V ({n_tok} tokens of text, last {n_q} queries)\n")
    print("relative RMS error of the attention output vs float64, mean (max) over layers\n")
    print("| model | kind | K rotated | V rotated | rel. error mean | max |")
    print("|---|---|---|---|---:|---:|")
    for path in models:
        if not path.exists():
            print(f"| {path.name}: not found |||||||")
            continue
        layers = capture_qkv(path, n_tok)
        S = layers[0][1].shape[0]
        pos = np.arange(S, dtype=np.int64)
        q_pos = pos[-n_q:]
        for kind, rot_k, rot_v in CONFIGS:
            errs = []
            for q, k, v, scale, window in layers:
                q = np.ascontiguousarray(q[-n_q:])
                ref = exact_attention(q, q_pos, k, v, pos, scale, window)
                kk, ks = kq.kv_arrays(kind, S, k.shape[1], k.shape[2])
                vv, vs = kq.kv_arrays(kind, S, k.shape[1], k.shape[2])
                kq.kv_store(kind, np.ascontiguousarray(k), kk, ks, pos, rot_k)
                kq.kv_store(kind, np.ascontiguousarray(v), vv, vs, pos, rot_v)
                qq = kq.hadamard_(q.copy()) if rot_k else q
                out = kq.kv_attention(kind, qq, None, q_pos, kk, ks, vv, vs, pos, 0, None, None, None, scale, window, rot_v)
                errs.append(np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref**2)))
            print(f"| {path.stem} | {kind} | {rot_k} | {rot_v} | "
                  f"{np.mean(errs):.2e} | {np.max(errs):.2e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", action="store_true", help="also time a 512-token prefill")
    ap.add_argument("--quality", action="store_true", help="also measure attention error on real models' K/V")
    ap.add_argument("--model", type=Path, action="append", help="GGUF file(s) for --quality (default: the two test models)")
    ap.add_argument("--no-decode", action="store_true")
    a = ap.parse_args()
    CPUBackend(threads=a.threads)  # the runtime's threading layer (OpenMP) and thread count
    rng = np.random.default_rng(0)
    if not a.no_decode:
        bench_decode(rng)
    if a.prefill:
        bench_prefill(rng)
    if a.quality:
        bench_quality(a.model or DEFAULT_MODELS)


if __name__ == "__main__":
    main()
