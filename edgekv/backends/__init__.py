"""Backends: the same small set of operations, implemented on numpy (the reference), on the
numba CPU kernels, and on numba.cuda. Models call only these operations, so a model file never
knows which one runs it.

The operations (x float32, n = tokens in the batch):
  prepare(tensor) -> handle             a weight, ready for matmul/embed (no dequantized copy on fast backends)
  fuse([tensors]) -> handle             several weights applied to the same input; matmul returns them concatenated
  matmul(x, w, *, pre, pre_w, eps, residual, post_w) -> y
      y (n, m) = pre(x) @ W.T, where pre is None (x (n, k) as is), "norm" (rmsnorm(x) * pre_w)
      or "silu"/"gelu" (x (n, 2k) = gate and up side by side: act(gate) * up). With residual
      (n, m): residual += y (rmsnorm(y) * post_w when post_w is given), returned. One op, so a
      fast backend can do a layer's norm, matmul, activation and residual add in one call.
  embed(w, ids (n,)) -> (n, d)
  rmsnorm(x (..., d), w (d,), eps) -> same shape
  rope(x (n, heads, hd), pos (n,), rope, heads=None) -> x rotated (in place where possible; use
      the result) by rope (edgekv.rope.Rope: per-pair frequencies, NORM or NEOX pairs; every
      variant, llama3 factors and YaRN included, is just frequencies), the rotated dims times
      rope.attn_factor (ggml's; dims past n_rot unchanged); heads=h rotates only heads [0, h)
      (q and k of a fused QKV)
  silu_mul(g, u) / gelu_mul(g, u) -> act(g) * u
  attention(q (n, H, hd), q_pos (n,), kv LayerKV, k (n, Hkv, hd), v, scale, rope, softcap=0)
      -> (n, H, hd)
      q attends to the cached tokens of kv and to this batch's own k/v, causally by position and
      within kv.span; sink slots are seen through q counter-rotated by the plan's shifts (rope:
      the layer's Rope; only turned, q has its attn_factor already); softcap > 0: scaled scores
      s become softcap * tanh(s / softcap) (gemma2). The batch's k/v are stored in kv where the
      cache's plan says. Written once (backends/attention.py) over each backend's primitives.
  decoder_block(attn_norm=, qkv=, qkv_bias=, q_norm=, k_norm=, attn_output=, post_attn_norm=,
                ffn_norm=, gate_up=, act=, ffn_down=, post_ffw_norm=, n_head=, n_head_kv=,
                head_dim=, eps=, scale=, rope=[, residual_scale=, softcap=]) -> handle or None
      a whole pre-norm block (kernels_cpu/block.py writes it out; None for an absent step)
      prepared once for run_block; None where the backend has no fused block
  run_block(handle, x (1, d), pos (1,), kv) -> bool
      one token through that block, x updated in place, the same as the model's op-by-op code;
      False (nothing done) where it cannot (a batch, an empty cache): the model runs its ops
  decoder_stack([handle of each block]) -> handle or None
      every block of a model, prepared once for run_stack (None where any block is None)
  run_stack(handle, x (1, d), pos (1,), cache) -> bool
      one token through every block in one call, as run_block layer after layer; False
      (nothing done) where it cannot (then the model goes layer by layer)
"""
from __future__ import annotations


def get_backend(device: str = "cpu", threads: int | None = None, gpu_layers: int | None = None):
    """The backend object for a device name: "cpu", "reference" (numpy oracle), "cuda" or "auto"
    (cuda when a GPU is usable, else cpu). gpu_layers (cuda/auto only): the first N transformer
    blocks on the GPU, the rest on the CPU (None = all). numba.cuda is imported only for cuda/auto."""
    from ..errors import DeviceError

    if gpu_layers is not None and device not in ("cuda", "auto"):
        raise DeviceError(f"gpu_layers needs device cuda or auto, not {device!r}")
    if device == "auto":
        from .cuda import cuda_unusable
        device = "cpu" if cuda_unusable() else "cuda"
        gpu_layers = gpu_layers if device == "cuda" else None
    if device == "cuda":
        from .cuda import CUDABackend
        return CUDABackend(threads, gpu_layers)
    if device == "reference":
        from .reference import ReferenceBackend
        return ReferenceBackend()
    if device == "cpu":
        from .cpu import CPUBackend
        return CPUBackend(threads)
    raise DeviceError(f"unknown device {device!r} (choose cpu, cuda, auto or reference)")
