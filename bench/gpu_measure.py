"""Measure the CUDA backend on real models: decode tokens/s, the share of the GPU's memory
bandwidth that decode reaches, and agreement with the CPU backend (greedy tokens and logits).

    python bench/gpu_measure.py MODEL [MODEL ...] [--tokens 128] [--json out.jsonl]

MODEL: a known name (pulled on first use) or a .gguf path. Bandwidth share = decode weight
bytes per token (every matrix once, the embedding as one row; edgekv.bench) x tokens/s /
the GPU's bandwidth, both as the driver reports it (memory clock x bus width) and as a
device-to-device copy measures it. Run by bench/gpu_check.sh.
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np

PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
          "combined movable metal type, oil-based ink and a wooden press into a system that")


def peak_bandwidth_reported() -> float | None:
    """Bytes/s from the driver's attributes: 2 (DDR) x memory clock x bus width."""
    from numba import cuda

    try:
        dev = cuda.get_current_device()
        clock_khz, bus_bits = dev.MEMORY_CLOCK_RATE, dev.GLOBAL_MEMORY_BUS_WIDTH
    except Exception:  # noqa: BLE001 (attribute names differ across numba-cuda versions)
        return None
    return 2.0 * clock_khz * 1e3 * bus_bits / 8 if clock_khz and bus_bits else None


def copy_bandwidth(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Bytes/s moved (read + write) by device-to-device copies of an nbytes buffer."""
    from numba import cuda

    a = cuda.device_array(nbytes // 4, np.float32)
    b = cuda.device_array_like(a)
    b.copy_to_device(a)  # warm up
    cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        b.copy_to_device(a)
    cuda.synchronize()
    return 2.0 * nbytes * reps / (time.perf_counter() - t)


def greedy(llm, ids: list[int], n: int) -> tuple[list[int], float]:
    """n greedy tokens after ids, and decode tokens/s (prefill excluded; EOS does not stop)."""
    c = llm.new_cache()
    out = [int(np.argmax(llm.forward(ids, c, 0)[-1]))]
    t = time.perf_counter()
    while len(out) < n:
        out.append(int(np.argmax(llm.forward([out[-1]], c, len(ids) + len(out) - 1)[-1])))
    return out, (n - 1) / (time.perf_counter() - t)


def agreement(gpu, cpu, ids: list[int]) -> dict:
    """Teacher-forced logits after every prefix of ids: top-1 agreement, mean KL(cpu || gpu),
    largest relative difference."""
    a = gpu.logits(ids).astype(np.float64)
    b = cpu.logits(ids).astype(np.float64)
    pa = np.exp(a - a.max(-1, keepdims=True))
    pa /= pa.sum(-1, keepdims=True)
    pb = np.exp(b - b.max(-1, keepdims=True))
    pb /= pb.sum(-1, keepdims=True)
    kl = np.sum(pb * (np.log(pb + 1e-30) - np.log(pa + 1e-30)), axis=-1)
    rel = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)
    return dict(top1=float((a.argmax(-1) == b.argmax(-1)).mean()), mean_kl=float(kl.mean()), max_rel=float(rel.max()))


def measure(model: str, tokens: int, cpu_tokens: int, bw: float, bw_reported: float | None) -> dict:
    from edgekv import load
    from edgekv.bench import decode_weight_bytes

    t = time.perf_counter()
    gpu = load(model, device="cuda", n_ctx=1024)
    load_s = time.perf_counter() - t
    ids = gpu.tokenize(PROMPT)
    greedy(gpu, ids, 4)  # compiles every kernel the model uses
    toks, tps = greedy(gpu, ids, tokens)
    wbytes = decode_weight_bytes(gpu.file)
    rec = dict(model=gpu.path.name, load_s=round(load_s, 1), device_weight_gib=round(gpu.backend.weight_bytes / 2**30, 2),
               decode_tokens_per_s=round(tps, 2), weight_bytes_per_token=wbytes,
               decode_gb_per_s=round(wbytes * tps / 1e9, 1), bandwidth_share_measured=round(wbytes * tps / bw, 3))
    if bw_reported:
        rec["bandwidth_share_reported"] = round(wbytes * tps / bw_reported, 3)
    cpu = load(model, device="cpu", n_ctx=1024)
    n = min(tokens, cpu_tokens)
    cpu_toks, cpu_tps = greedy(cpu, ids, n)
    same = next((i for i, (x, y) in enumerate(zip(toks[:n], cpu_toks)) if x != y), n)
    rec.update(cpu_decode_tokens_per_s=round(cpu_tps, 2), greedy_tokens_compared=n, greedy_same_prefix=same,
               greedy_text_same=toks[:n] == cpu_toks, **agreement(gpu, cpu, ids))
    return rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--tokens", type=int, default=128, help="tokens to decode on the GPU")
    ap.add_argument("--cpu-tokens", type=int, default=64, help="of those, how many the CPU decodes to compare")
    ap.add_argument("--json", default=None, help="append one JSON line per model here")
    ap.add_argument("--copy-mib", type=int, default=1024, help="buffer size of the copy-bandwidth probe")
    args = ap.parse_args()
    from numba import cuda

    try:
        name = cuda.get_current_device().name
        name = name.decode() if isinstance(name, bytes) else name
    except AttributeError:  # the simulator
        name = "simulator"
    bw, bw_rep = copy_bandwidth(args.copy_mib << 20), peak_bandwidth_reported()
    rep = f"{bw_rep / 1e9:.0f} GB/s" if bw_rep else "unavailable"
    print(f"GPU: {name}; device-to-device copy {bw / 1e9:.0f} GB/s; reported peak {rep}", flush=True)
    for m in args.models:
        rec = measure(m, args.tokens, args.cpu_tokens, bw, bw_rep)
        rec.update(copy_gb_per_s=round(bw / 1e9), reported_gb_per_s=round(bw_rep / 1e9) if bw_rep else None)
        print(json.dumps(rec), flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(rec) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
