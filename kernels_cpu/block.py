"""One token through one pre-norm decoder block, in a single call; or the next token of each of
several sequences (batched decode: the matmuls read each weight once for all of them, each token
attends over its own sequence's cache).

At 135M parameters a decode token is ~7 ms for 30 blocks; made as six kernel calls a block,
each call's dispatch and the Python around it cost several microseconds while the work behind
it is a few, so a fifth of the token went to calling. Here a block's steps run one after
another inside compiled code; its parallel regions are the matmuls' (and a long context's
attention's) own.

The block, every norm an RMSNorm times its weight, [..] the optional parts (empty arrays):

    qkv = norm(x, attn_norm) @ Wqkv.T [+ qkv_bias]       q, k, v: heads of qkv side by side
    [q = norm(q, q_norm); k = norm(k, k_norm)]           per head
    q, k = rope(q), rope(k) at the token's position     rotated dims times rope_mag (attn_factor)
    a = attention of q over the layer's cache, k and v stored there (kvquant.kv_decode)
    x += [norm(] r * a @ Wo.T [, post_attn_norm)]       r: the residual scale (granite; else 1)
    g, u = norm(x, ffn_norm) @ Wgu.T                     gate and up side by side
    x += [norm(] r * act(g) * u @ Wdown.T [, post_ffw_norm)] act: silu or gelu (silu where r != 1)

A fused weight (Wqkv, Wgu) comes as up to three runs of one GGML type each (gemma3 keeps v
in another type than q and k), written side by side.
"""
from __future__ import annotations

import numpy as np
from numba import get_num_threads, njit, prange
from numba.typed import List

from .kvquant import KV_ATTN_PAR_MIN, KV_ATTN_SPLIT_MIN_KEYS, _decode_core
from .ops import _rmsnorm_serial, _rope_token, _silu_mul_serial
from .qmatmul import PRE, PRE_NONE, PRE_NORM, QWeight, _qmatvec

_E1 = np.empty(0, np.float32)
_NO_W = np.zeros((0, 1), np.uint8)
_NO_W.setflags(write=False)  # the type of a memory-mapped weight: read-only
_NO_RUN = (_NO_W, _NO_W, _NO_W)


@njit(cache=True, error_model="numpy")
def _block_core(x, q_pos, W, N, dims, eps, scale, res_scale, rope, layers, ats, par, softcap):
    # x (n, d): token t belongs to a sequence of its own, cache layers[t] (a typed list: one numba
    # type whatever the batch's size) at ats[t] = (slot, n_ring, exact_lo, exact_row, shift)
    wqkv, tqkv, mqkv, wo, to, wgu, tgu, mgu, wdown, tdown = W
    attn_norm, qkv_bias, q_norm, k_norm, post_attn, ffn_norm, post_ffw = N
    H, Hkv, hd, act = dims
    n = x.shape[0]
    e1 = np.empty(0, np.float32)  # absent pre_w / post_w / residual (module globals would be read-only)
    e2 = np.empty((0, 0), np.float32)
    # constants reach _qmatvec as plain int64: a literal argument would compile another _qmatvec
    norm, plain, zero = np.int64(PRE_NORM), np.int64(PRE_NONE), np.int64(0)
    # qkv, in runs of one type side by side; each token's rows the bits it has alone (qmatmul)
    qkv = np.empty((n, (H + 2 * Hkv) * hd), np.float32)
    col = zero
    for r in range(3):
        if mqkv[r]:
            _qmatvec(x, wqkv[r], tqkv[r], qkv, col, norm, attn_norm, eps, e2, e1)
            col += mqkv[r]
    if qkv_bias.shape[0]:
        for t in range(n):
            for c in range(qkv.shape[1]):
                qkv[t, c] += qkv_bias[c]
    qkv3 = qkv.reshape(n, H + 2 * Hkv, hd)  # (n, heads, hd) view
    a = np.empty((n, H, hd), np.float32)
    _attend(qkv3, q_pos, q_norm, k_norm, eps, rope, layers, ats, scale, par, softcap, a)
    if res_scale != 1:
        a *= res_scale
    o = np.empty((n, x.shape[1]), np.float32)
    _qmatvec(a.reshape(n, H * hd), wo, to, o, zero, plain, e1, eps, x, post_attn)  # x += post(o)
    gu = np.empty((n, mgu[0] + mgu[1] + mgu[2]), np.float32)
    col = zero
    for r in range(3):
        if mgu[r]:
            _qmatvec(x, wgu[r], tgu[r], gu, col, norm, ffn_norm, eps, e2, e1)
            col += mgu[r]
    if res_scale == 1:
        _qmatvec(gu, wdown, tdown, o, zero, act, e1, eps, x, post_ffw)  # x += post(down(act(g) * u))
    else:  # as the model's ops do it: h = silu(g) * u, h *= r, x += down(h)
        nf = gu.shape[1] // 2
        h = np.empty((n, nf), np.float32)
        for t in range(n):
            _silu_mul_serial(gu[t, :nf], gu[t, nf:], h[t])
        h *= res_scale
        _qmatvec(h, wdown, tdown, o, zero, plain, e1, eps, x, post_ffw)


@njit(cache=True, error_model="numpy")
def _attend(qkv3, q_pos, q_norm, k_norm, eps, rope, layers, ats, scale, par, softcap, a):
    # a batch's tokens side by side, each attending over its own cache with one thread: a
    # short context's attention is a serial ~10-25 us, most of it fixed cost, so one token at
    # a time left the other cores idle (bench/RESULTS.md, "Batches"). One token (or one
    # thread) keeps the attention's own split over the keys. The bits are the same either way
    # (kvquant._attn_core splits by the problem, never by the thread count).
    n = a.shape[0]
    inv_freq, neox, nh, mag = rope
    if n > 1 and par[2] > 1:
        _attend_par(qkv3, q_pos, q_norm, k_norm, eps, inv_freq, neox, nh, mag, layers, ats, scale, par[0], par[1],
                    softcap, a)
    else:
        for t in range(n):
            _attend_token(qkv3, q_pos, q_norm, k_norm, eps, inv_freq, neox, nh, mag, layers[t], ats[t, 0], ats[t, 1],
                          ats[t, 2], ats[t, 3], ats[t, 4], scale, par[0], par[1], par[2], softcap, a, t)


@njit(parallel=True, cache=True, error_model="numpy")
def _attend_par(qkv3, q_pos, q_norm, k_norm, eps, inv_freq, neox, nh, mag, caches, at, scale, par_min, split_min,
                softcap, a):
    for i in prange(a.shape[0]):
        t = np.int64(i)
        _attend_token(qkv3, q_pos, q_norm, k_norm, eps, inv_freq, neox, nh, mag, caches[t], at[t, 0], at[t, 1],
                      at[t, 2], at[t, 3], at[t, 4], scale, par_min, split_min, np.int64(1), softcap, a, t)


@njit(cache=True, error_model="numpy")
def _attend_token(qkv3, q_pos, q_norm, k_norm, eps, inv_freq, neox, nh, mag, layer, slot, n_ring, e0, row, shift,
                  scale, par_min, split_min, threads, softcap, a, t):
    # token t: q/k norms and RoPE in place in qkv3 (n, heads, hd), then its cache's decode step
    # (k and v stored, attention) into a[t]
    H, hd = a.shape[1], a.shape[2]
    Hkv = (qkv3.shape[1] - H) // 2
    # ops' own compiled functions, not their inline rows: inlined here they would take this
    # function's float flags (no fastmath) and differ from the op-by-op path in the last bit
    if q_norm.shape[0]:  # per head, in place: rows of the (heads, hd) view
        heads = qkv3[t]
        _rmsnorm_serial(heads[:H], q_norm, eps, heads[:H])
        _rmsnorm_serial(heads[H : H + Hkv], k_norm, eps, heads[H : H + Hkv])
    cs = np.empty(inv_freq.shape[0], np.float32)
    sn = np.empty(inv_freq.shape[0], np.float32)
    _rope_token(qkv3, q_pos, inv_freq, neox, nh, t, cs, sn, mag)  # q and k: the first H + Hkv heads
    # copies, not slice assignments: each of those compiles numba's shape-mismatch message (~1 s cold)
    q = qkv3[t : t + 1, :H].copy()  # (1, H, hd)
    k = qkv3[t : t + 1, H : H + Hkv].copy()
    v = qkv3[t : t + 1, H + Hkv :].copy()
    a1 = np.empty((1, H, hd), np.float32)
    _decode_core(layer, q, k, v, q_pos[t : t + 1].copy(), (slot, n_ring, e0, row), (inv_freq, neox, shift),
                 scale, (par_min, split_min, threads), a1, softcap)
    for h in range(H):
        for i in range(hd):
            a[t, h, i] = a1[0, h, i]


def _runs(w) -> tuple[tuple, tuple, tuple]:
    """A fused weight (a QWeight or a tuple of them) as three runs: raw parts, types, rows."""
    runs = (w,) if isinstance(w, QWeight) else tuple(w)
    if len(runs) > 3:
        raise ValueError(f"decoder block: a fused weight of {len(runs)} runs (at most 3)")
    pad = 3 - len(runs)
    return (tuple(r.ws for r in runs) + (_NO_RUN,) * pad, tuple(r.qtype for r in runs) + (0,) * pad,
            tuple(r.m for r in runs) + (0,) * pad)


def _vec(a, n: int, what: str) -> np.ndarray:
    if a is None:
        return _E1
    a = np.ascontiguousarray(a, dtype=np.float32)
    if a.shape != (n,):
        raise ValueError(f"decoder block: {what} has shape {a.shape}, expected ({n},)")
    return a


def block_pack(*, attn_norm, qkv, qkv_bias, q_norm, k_norm, attn_output, post_attn_norm, ffn_norm, gate_up, act,
               ffn_down, post_ffw_norm, n_head: int, n_head_kv: int, head_dim: int, eps: float, scale: float,
               rope_freqs: np.ndarray, rope_neox: bool, rope_mag: float = 1.0, residual_scale: float = 1.0,
               softcap: float = 0.0) -> tuple:
    """A block's weights (QWeights, fused ones as tuples of runs) and norm vectors (float32;
    None = that step is absent) checked once and packed for `decode_block`. act: "silu" or
    "gelu"; rope_freqs (n_rot/2,) float64, any per-pair frequencies (edgekv/rope.py); RoPE
    turns q and k (all heads), their rotated dims times rope_mag (ggml's attn_factor).
    residual_scale: both branches' outputs times this. softcap: the attention scores' soft-cap
    (kvquant.kv_attention's; 0 = off)."""
    H, Hkv, hd = n_head, n_head_kv, head_dim
    d = attn_output.m
    wqkv, tqkv, mqkv = _runs(qkv)
    wgu, tgu, mgu = _runs(gate_up)
    if sum(mqkv) != (H + 2 * Hkv) * hd or attn_output.k != H * hd or sum(mgu) != 2 * ffn_down.k or ffn_down.m != d:
        raise ValueError("decoder block: weight shapes do not fit the head counts and widths")
    if not isinstance(attn_output, QWeight) or not isinstance(ffn_down, QWeight) or act not in ("silu", "gelu"):
        raise ValueError("decoder block: attn_output and ffn_down must be single weights, act silu or gelu")
    if residual_scale != 1 and act != "silu":
        raise ValueError("decoder block: a residual scale only with silu")
    if (q_norm is None) != (k_norm is None) or 2 * rope_freqs.shape[0] > hd:
        raise ValueError("decoder block: q_norm and k_norm come together; RoPE dims must fit the head")
    W = (wqkv, tqkv, mqkv, attn_output.ws, attn_output.qtype, wgu, tgu, mgu, ffn_down.ws, ffn_down.qtype)
    N = (_vec(attn_norm, d, "attn_norm"), _vec(qkv_bias, sum(mqkv), "qkv_bias"), _vec(q_norm, hd, "q_norm"),
         _vec(k_norm, hd, "k_norm"), _vec(post_attn_norm, d, "post_attn_norm"), _vec(ffn_norm, d, "ffn_norm"),
         _vec(post_ffw_norm, d, "post_ffw_norm"))
    return W, N, (H, Hkv, hd, PRE[act]), np.float64(eps), \
        (np.float32(scale), np.float32(residual_scale), np.float32(softcap)), \
        (np.ascontiguousarray(rope_freqs, dtype=np.float64), bool(rope_neox), H + Hkv, float(rope_mag))


def decode_block(pack: tuple, x: np.ndarray, q_pos: np.ndarray, layers: List, ats: np.ndarray,
                 threads: int | None = None) -> np.ndarray:
    """x (n, d) float32, C-contiguous: the residual streams of n tokens at q_pos (n,) int64, token t
    of a sequence of its own over layers[t], a layer's cache (kvquant.kv_decode_layer; a typed
    list from `cache_list`, all of one numba type), placed at ats[t] = (slot, n_ring, exact_lo,
    exact_row, shift) ((n, 5) int64: the cache's plan, Plan.one_token and Plan.shift), updated in
    place through the block `pack` (block_pack); each token gets the bits it gets alone.
    Unchecked: a backend's decode step. threads: the calling thread's numba count, where the
    caller knows it (numba's get_num_threads costs ~1.4 us, a layer's whole cache bookkeeping
    ~1). Returns x; the callers' caches commit the plans."""
    W, N, dims, eps, (scale, res_scale, softcap), (freqs, neox, heads, mag) = pack
    _block_core(x, q_pos, W, N, dims, eps, scale, res_scale, (freqs, neox, heads, mag), layers, ats,
                (KV_ATTN_PAR_MIN, KV_ATTN_SPLIT_MIN_KEYS, threads or get_num_threads()), softcap)
    return x


def decode_stack(stack: List, x: np.ndarray, q_pos: np.ndarray, lists: List, ats: np.ndarray,
                 threads: int | None = None) -> np.ndarray:
    """One token through every block of `stack` (block_pack's packs of one numba type, as
    cache_list's typed list) in one call: block i as decode_block(stack[i], x, q_pos, lists[i],
    ats[i], threads) does it, lists a typed list of
    each layer's cache list (cache_list's), ats (n_layer, 1, 5) int64 each layer's plan. Between
    two layers a 7B step streams ~110 MB of weights, which leaves the Python of a call per
    layer (the cache's plan, numba's dispatch of the block's ~30 arrays) to run from cold caches:
    ~80 us a layer there against ~10 warm, ~3 ms of an ~85 ms token (bench/RESULTS.md). Returns x."""
    _stack_core(x, q_pos, stack, lists, ats, (KV_ATTN_PAR_MIN, KV_ATTN_SPLIT_MIN_KEYS, threads or get_num_threads()))
    return x


@njit(cache=True, error_model="numpy")
def _stack_core(x, q_pos, stack, lists, ats, par):
    for i in range(len(stack)):
        W, N, dims, eps, (scale, res_scale, softcap), rope = stack[i]
        _block_core(x, q_pos, W, N, dims, eps, scale, res_scale, rope, lists[i], ats[i], par, softcap)


def cache_list(states) -> List:
    """Packs of one numba type (layers' caches, kvquant.kv_decode_layer's; or blocks,
    block_pack's) as the typed list decode_block and decode_stack take: a call receives it as
    one object, where a tuple of caches costs ~2 us a cache to unpack at every call
    (bench/RESULTS.md). Made in compiled code (a typed list made
    from Python costs ~300 us); made once and kept by the caller."""
    out = _list_of(states[0])
    for s in states[1:]:
        _list_push(out, s)
    return out


@njit(cache=True)
def _list_of(s):
    out = List()
    out.append(s)
    return out


@njit(cache=True)
def _list_push(out, s):
    out.append(s)
