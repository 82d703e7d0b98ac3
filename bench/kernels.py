"""Quantized matmul kernels against the machine's measured read bandwidth.

    python bench/kernels.py [--threads N] [--types Q4_0,Q4_K] [--no-prefill]
    python bench/kernels.py --layouts [--types Q4_0,Q4_K] [--tokens 1,2,4,8]

Decode: a (11008, 4096) weight of each type (random blocks with sane scales, 15-180 MB) times one
token; consecutive calls cycle through copies of the weight (>= 1 GiB in all, --stream-mib) so that
each call streams it from memory, not from a last-level cache (480 MiB on some servers). GB/s =
weight bytes / time of the best call (and the median call), compared with the read bandwidth
measured in the same run. Prefill: GFLOP/s of a (4096, 4096) weight times 64 and 512 tokens.
Prints a markdown table. --layouts: decode of the GGUF rows against the interleaved layout
(qmatmul.pack) of the same weights, calls alternating, for a few token counts.
"""
from __future__ import annotations

import argparse
import time

import numba
import numpy as np

from edgekv.kernels_cpu import qmatmul as qm
from edgekv.kernels_cpu.membw import read_bandwidth
from edgekv.quants import BY_NAME, QUANT_TYPES

# byte offsets of the float16 scale fields inside each block (set to small finite values)
_SCALE_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,),
}


def random_weight(name: str, m: int, k: int, rng) -> np.ndarray:
    """Raw (m, row_bytes) blocks: random bytes, float fields set to small finite values."""
    qt = BY_NAME[name]
    if name == "F32":
        return (rng.standard_normal((m, k), dtype=np.float32) * 0.02).view(np.uint8)
    if name in ("F16", "BF16"):
        f = rng.standard_normal((m, k), dtype=np.float32) * 0.02
        return (f.astype(np.float16) if name == "F16" else (f.view(np.uint32) >> 16).astype(np.uint16)).view(np.uint8)
    nb = k // qt.block_elems
    raw = rng.integers(0, 256, size=(m, nb, qt.block_bytes), dtype=np.uint8)
    for off in _SCALE_FIELDS[name]:
        scale = (rng.random((m, nb), dtype=np.float32) * 1e-3).astype(np.float16)
        raw[:, :, off : off + 2] = scale.view(np.uint8).reshape(m, nb, 2)
    return raw.reshape(m, nb * qt.block_bytes)


def times(fn, reps: int) -> list[float]:
    fn()
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def best_time(fn, reps: int) -> float:
    return min(times(fn, reps))


def layouts(names: list[str], tokens: list[int], stream_mib: int, rng) -> None:
    """GGUF rows against their packed layout, calls alternating, each streaming its weight."""
    print("| type | shape | tokens | GGUF rows: best / median GB/s (median ms) | packed: best / median GB/s (median ms) |")
    print("|---|---|---:|---|---|")
    for name in names:
        qt = BY_NAME[name].id
        for m, k in ((11008, 4096), (4096, 11008)):
            w = random_weight(name, m, k, rng)
            n_cop = -(-(stream_mib << 20) // w.nbytes)
            plain = [qm.QWeight(w.copy(), qt) for _ in range(n_cop)]
            packed = [qm.pack(p) for p in plain]
            if packed[0] is plain[0]:
                print(f"| {name} | {m} x {k} | | no packed layout on this machine or shape | |")
                break
            for n in tokens:
                x = rng.standard_normal((n, k), dtype=np.float32)
                out = np.empty((n, m), np.float32)
                ts: dict[str, list[float]] = {"plain": [], "packed": []}
                for rep in range(3 * n_cop):  # the first pass over the copies is a warm-up
                    for label, ws in (("plain", plain), ("packed", packed)):
                        t = time.perf_counter()
                        qm.run(ws[rep % n_cop], x, out, 0, qm.PRE_NONE, qm._NONE1, 0.0, qm._NONE2, qm._NONE1)
                        if rep >= n_cop:
                            ts[label].append(time.perf_counter() - t)
                cells = [f"{w.nbytes / min(v) / 1e9:.1f} / {w.nbytes / np.median(v) / 1e9:.1f} ({np.median(v) * 1e3:.2f})"
                         for v in ts.values()]
                print(f"| {name} | {m} x {k} | {n} | {cells[0]} | {cells[1]} |", flush=True)
            del plain, packed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    ap.add_argument("--types", default=",".join(QUANT_TYPES[q].name for q in qm.SUPPORTED))
    ap.add_argument("--no-prefill", action="store_true")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--stream-mib", type=int, default=1024, help="copies of each weight streamed in turn")
    ap.add_argument("--layouts", action="store_true", help="GGUF rows against the packed layout (decode)")
    ap.add_argument("--tokens", default="1,2,4,8", help="with --layouts: token counts")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)

    bw = read_bandwidth()
    print(f"threads {args.threads}; read bandwidth {bw / 1e9:.1f} GB/s (best parallel sum of 128 MiB parts of 1 GiB); "
          f"decode streams copies of each weight, >= {args.stream_mib} MiB in all\n")
    if args.layouts:
        layouts(args.types.split(","), [int(t) for t in args.tokens.split(",")], args.stream_mib, rng)
        return
    print("| type | weight MB | decode ms | GB/s | % of bandwidth | median call % | prefill n=64 GFLOP/s "
          "| prefill n=512 GFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.types.split(","):
        qt = BY_NAME[name].id
        m, k = 11008, 4096
        w = random_weight(name, m, k, rng)
        copies = [w] + [w.copy() for _ in range(-(-(args.stream_mib << 20) // w.nbytes) - 1)]
        x = rng.standard_normal((1, k), dtype=np.float32)
        out = np.empty((1, m), np.float32)
        turn = iter(range(1 << 62))
        call = lambda: qm.qmatmul(x, copies[next(turn) % len(copies)], qt, out)  # noqa: E731
        ts = times(call, max(args.reps, 2 * len(copies)))
        t = min(ts)
        gbs = w.nbytes / t / 1e9
        cells = [name, f"{w.nbytes / 1e6:.1f}", f"{t * 1e3:.2f}", f"{gbs:.1f}", f"{100 * gbs * 1e9 / bw:.0f}%",
                 f"{100 * w.nbytes / float(np.median(ts)) / bw:.0f}%"]
        del w, copies
        if not args.no_prefill:
            w = random_weight(name, 4096, 4096, rng)
            for n in (64, 512):
                xs = rng.standard_normal((n, 4096), dtype=np.float32)
                t = best_time(lambda: qm.qmatmul(xs, w, qt), 1 if n == 512 else 3)
                cells.append(f"{2 * n * 4096 * 4096 / t / 1e9:.0f}")
        else:
            cells += ["", ""]
        print("| " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
