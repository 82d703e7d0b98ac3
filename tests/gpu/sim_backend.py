"""The CUDA backend end to end on tiny synthetic models: logits as the numpy reference's, the
same greedy tokens as the CPU backend, rings that wrap (sinks, sliding windows), a batch that
attends before it is stored, int8/int4 caches (key offset, channel weights, exact first and
recent tokens, fitted int4 steps), partial offload, and sessions saved from the device."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gpu_common import SIM, launch_sizes  # noqa: F401  (fixture)
from edgekv import LLM
from edgekv.backends.cuda import CUDABackend, DeviceArray
from edgekv.synth import write_synthetic

# tiny shapes: under the simulator every GPU thread is a Python thread
LLAMA = dict(n_layer=2, n_embd=32, n_head=1, n_head_kv=1, n_ff=32, n_vocab=264, n_ctx=64)
GEMMA = dict(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, head_dim=32, n_ff=32, n_vocab=264, n_ctx=64,
             sliding_window=4)  # both layers slide; GQA
PROMPT = [1, 200, 17, 42, 99, 7]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpu_synth")
    return {
        "llama": write_synthetic(d / "llama.gguf", "llama", "tiny", "q4_0", progress=False, **LLAMA),
        "gemma3": write_synthetic(d / "gemma3.gguf", "gemma3", "tiny", "q8_0", progress=False, **GEMMA),
        # llama3 RoPE factors, qwen3's q/k norms with YaRN and a head wider than n_embd/n_head,
        # granite's multipliers, phi3's LongRoPE
        "llama3": write_synthetic(d / "llama3.gguf", "llama", "tiny", "q8_0", progress=False,
                                  **{**LLAMA, "head_dim": 32}, rope_llama3=(8.0, 1.0, 4.0, 16)),
        "qwen3": write_synthetic(d / "qwen3.gguf", "qwen3", "tiny", "q8_0", progress=False,
                                 n_layer=2, n_embd=32, n_head=2, n_head_kv=1, head_dim=32, n_ff=32, n_vocab=264, n_ctx=64,
                                 rope_yarn=(4.0, 16)),
        "granite": write_synthetic(d / "granite.gguf", "granite", "tiny", "q8_0", progress=False, **LLAMA),
        # soft-caps at the size of these random weights' scores and logits, so both bend them
        "gemma2": write_synthetic(d / "gemma2.gguf", "gemma2", "tiny", "q8_0", progress=False,
                                  **GEMMA, attn_softcap=0.01, final_softcap=0.3),
        # phi3: fused attn_qkv and gate/up, LongRoPE's long factors (n_ctx 8 is past 4) and attention factor
        "phi3": write_synthetic(d / "phi3.gguf", "phi3", "tiny", "q8_0", progress=False,
                                **{**LLAMA, "n_ctx": 16}, rope_longrope=4),
        # Phi-4-mini's layout: RoPE over 24 of 32 dims with LongRoPE's attention factor, GQA, tied
        "phi4": write_synthetic(d / "phi4.gguf", "phi3", "tiny-phi4", "q8_0", progress=False,
                                **{**LLAMA, "n_embd": 64, "n_head": 2, "n_ctx": 16}, rope_dim=24, rope_longrope=4),
    }


def greedy(llm: LLM, n: int) -> list[int]:
    """n argmax tokens after PROMPT (no end-of-generation stop: random models emit EOS)."""
    c = llm.new_cache()
    out = [int(np.argmax(llm.forward(PROMPT, c, 0)[-1]))]
    while len(out) < n:
        out.append(int(np.argmax(llm.forward([out[-1]], c, len(PROMPT) + len(out) - 1)[-1])))
    return out


def steps(llm: LLM) -> np.ndarray:
    """Logits of three calls on one 8-token ring with 4 sinks: 6 tokens (stored, then read), 4
    more (attended as a fresh batch, then stored, wrapping the ring), one decode step (sinks
    seen through the counter-rotated query)."""
    c = llm.new_cache()
    a = llm.forward(PROMPT, c, 0, last_only=False)
    b = llm.forward([3, 5, 8, 13], c, 6, last_only=False)
    d = llm.forward([21], c, 10)
    for x in (a, b, d):
        assert isinstance(x, np.ndarray)  # logits come back to the host
    return np.concatenate([a, b, d])


# (arch, kv, recent): int caches with the default exact tokens (a ring of 8 with 4 sinks keeps
# its whole window exact: recent = capacity - sinks) and with recent = 2, which leaves window
# tokens to the quantized ring. llama stands in for SmolLM2 (its architecture; 4 sinks, seen
# through the counter-rotated query with the sink bias once the ring wraps); gemma3 has GQA and
# only sliding layers (rings of its window, no sinks).
CASES = [("llama", "f16", None), ("gemma3", "int4", None), ("gemma3", "int4", 2), ("llama", "int8", 2),
         ("llama", "int4", 2), ("llama3", "f16", None), ("qwen3", "int8", 2), ("granite", "f16", None),
         ("gemma2", "f16", None), ("gemma2", "int8", 2), ("phi3", "int8", 2), ("phi4", "f16", None),
         ("phi4", "int8", 2)]


@pytest.mark.parametrize("arch,kv,recent", CASES)
def test_logits_match_reference(models, arch, kv, recent, monkeypatch):
    from edgekv import kvcache

    if recent is not None:
        monkeypatch.setattr(kvcache, "RECENT", recent)
    gpu = LLM(models[arch], n_ctx=8, kv=kv, device="cuda")
    assert isinstance(gpu.backend, CUDABackend) and gpu.backend.weight_bytes > 0
    ref = LLM(models[arch], n_ctx=8, kv=kv, device="reference")
    a, b = steps(gpu), steps(ref)
    rel = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)
    # float activations on both: summation order, and (int kinds) a rare one-level rounding flip
    assert rel.max() < (1e-4 if kv == "f16" else 2e-2), rel
    if kv != "f16":
        lk = gpu.new_cache()[0]
        assert lk.recent == min(recent or kvcache.RECENT, lk.capacity - lk.n_sink) and lk.first == 4


def test_iq4_file_matches_reference(monkeypatch):
    """llama.cpp's IQ4_XS quantization of a synthetic llama (tests/fixtures/archs/; IQ4_NL's
    kernel is tested in sim_kernels.py): one prefill of the prompt. Heads of 64: blocks of 16
    threads."""
    from edgekv.kernels_gpu import launch

    monkeypatch.setattr(launch, "THREADS", 16)
    path = Path(__file__).resolve().parent.parent / "fixtures" / "archs" / "llama3.iq4_xs.gguf"
    a, b = (LLM(path, n_ctx=8, kv="f16", device=d) for d in ("cuda", "reference"))
    la, lb = (m.forward(PROMPT, m.new_cache(), 0, last_only=False) for m in (a, b))
    rel = np.linalg.norm(la - lb, axis=-1) / np.linalg.norm(lb, axis=-1)
    assert rel.max() < 1e-4, rel


def test_a_type_without_gpu_kernels_is_refused_naming_the_tensor(monkeypatch):
    from edgekv.errors import UnsupportedModelError
    from edgekv.kernels_gpu import qmatmul as gq

    monkeypatch.setattr(gq, "SUPPORTED", tuple(q for q in gq.SUPPORTED if q != gq.IQ4_XS))
    path = Path(__file__).resolve().parent.parent / "fixtures" / "archs" / "llama3.iq4_xs.gguf"
    with pytest.raises(UnsupportedModelError, match=r"tensor blk\.0\.\w+\.weight has type IQ4_XS, which edgekv's GPU"):
        LLM(path, n_ctx=8, device="cuda")


@pytest.mark.parametrize("arch,kv", [("llama", "f16"), ("gemma3", "f16"), ("llama", "int4")])
def test_same_greedy_tokens_as_cpu(models, arch, kv):
    """n_ctx 8 with 4 sinks (llama) / windows of 4 (gemma3): the ring wraps while decoding."""
    gpu = LLM(models[arch], n_ctx=8, kv=kv, device="cuda")
    cpu = LLM(models[arch], n_ctx=8, kv=kv, device="cpu")
    assert greedy(gpu, 4) == greedy(cpu, 4)


def test_partial_offload(models):
    part = LLM(models["llama"], n_ctx=16, device="cuda", gpu_layers=1)
    full = LLM(models["llama"], n_ctx=16, device="cuda")
    be = part.backend
    assert be._cpu is not None and be.weight_bytes < full.backend.weight_bytes  # block 1, embeddings, output on the CPU
    from edgekv.backends.cuda import GPUWeight

    assert isinstance(part.model.layers[0].attn_output, GPUWeight)
    assert not isinstance(part.model.layers[1].attn_output, GPUWeight)  # the CPU backend's handle
    rows = []
    for llm in (part, full):  # a prefill and a decode step: the residual crosses at the layer boundary
        c = llm.new_cache()
        rows.append(np.concatenate([llm.forward(PROMPT, c, 0, last_only=False), llm.forward([5], c, len(PROMPT))]))
    a, b = rows
    rel = np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)
    assert rel.max() < 3e-2, rel  # the CPU block takes its int8-activation path for <= 7 tokens
    assert (a.argmax(-1) == b.argmax(-1)).mean() >= 0.8


def test_session_saved_from_the_device(models, tmp_path):
    """A session's cache lives on the device; saving copies it back, and a CPU LLM continues it."""
    from edgekv.session import ChatSession

    gpu = LLM(models["llama"], n_ctx=32, kv="f16", device="cuda")
    s = gpu.session()
    s.seq.feed(PROMPT[:3])
    lk = s.seq.cache.layers[0]
    ring = lk.__dict__["_cuda_ring"]
    assert not lk.k.any()  # the host copy is stale until a save
    s.save(tmp_path / "s.edgekv")
    written = lk.live
    assert written.sum() == 3
    np.testing.assert_array_equal(lk.k.view(np.uint16)[written], ring.k.copy_to_host()[written])
    assert lk.k[written].any() and not lk.k[~written].any()  # empty slots saved as zeros
    cpu = LLM(models["llama"], n_ctx=32, kv="f16", device="cpu")
    t = ChatSession.load(tmp_path / "s.edgekv", cpu)
    assert t.seq.tokens == PROMPT[:3] and np.array_equal(t.seq.cache.layers[1].k, s.seq.cache.layers[1].k)


def test_device_array_numpy_surface():
    from numba import cuda

    x = np.arange(12, dtype=np.float32).reshape(2, 6)
    d = DeviceArray(cuda.to_device(x))
    np.testing.assert_array_equal(np.asarray(d[:, 2:5].reshape(2, 3, 1)), x[:, 2:5].reshape(2, 3, 1))
    d += np.ones(6, np.float32)  # a bias on every row
    d *= np.float32(2.0)
    np.testing.assert_array_equal(np.asarray(d[-1:]), ((x + 1) * 2)[-1:])
    assert d.shape == (2, 6) and len(d) == 2 and d.reshape(-1, 3).shape == (4, 3)


def test_int4_session_saved_from_the_device(models, tmp_path):
    """An int4 cache's device state (ring, exact copies) and host state (positions, key offset,
    channel weights) saved; the reference backend continues it with the logits the GPU gets."""
    from edgekv.session import ChatSession

    gpu = LLM(models["gemma3"], n_ctx=32, kv="int4", device="cuda")
    s = gpu.session()
    s.seq.feed(PROMPT)
    lk = s.seq.cache.layers[0]
    ring = lk.__dict__["_cuda_ring"]
    assert lk.mu.any() and not lk.rk.any()  # calibrated on the host; the exact copies stay on the device
    s.save(tmp_path / "s.edgekv")
    live = lk.rpos >= 0
    assert sorted(lk.rpos[live]) == list(range(len(PROMPT)))
    np.testing.assert_array_equal(lk.rk.view(np.uint16)[live], ring.rk.copy_to_host()[live])
    assert lk.rk[live].any() and not lk.rk[~live].any()
    ref = LLM(models["gemma3"], n_ctx=32, kv="int4", device="reference")
    t = ChatSession.load(tmp_path / "s.edgekv", ref)
    a = gpu.forward([5], s.seq.cache, len(PROMPT))
    b = ref.forward([5], t.seq.cache, len(PROMPT))
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-3
