"""Quality of the quantized caches on the real models, measured as the issue asks (KL of the
next-token distribution against the f16 cache, top-1 agreement) on English text, and the
streaming property: far past the ring, sinks keep perplexity near its in-ring value."""
from functools import lru_cache

import numpy as np
import pytest

from conftest import FIXTURES, model_path
from edgekv import LLM
from edgekv.perplexity import perplexity, streaming_nll

N_TOKENS, WINDOW = 2048, 512  # bench/kv_quality.py runs the same at 4096+ tokens


@lru_cache(maxsize=None)
def english_ids(key):
    llm = LLM(model_path(key), n_ctx=WINDOW)
    return llm, llm.tokenize((FIXTURES / "text_en.txt").read_text(), special=False)


# The targets: int8 KL <= 0.002 and top-1 >= 99%, int4 KL <= 0.02 and top-1 >= 95%.
# Measured 2026-11-29 (2048 tokens, windows of 512): SmolLM2 int8 0.00006 / 99.9%, int4
# 0.0041 / 97.2%; Gemma-3 int8 0.00002 / 99.9%, int4 0.0049 / 96.7% (before the exact
# first/recent tokens, key offset, channel weights and fitted int4 steps of kvcache.py:
# int4 0.056 / 88.7% and 0.22 / 76.8%, Gemma-3 int8 top-1 98.4%). Combinations that miss
# would be listed here as expected failures (strict: they flag once a change makes them pass).
MISSES: set[tuple[str, str]] = set()
TARGET = {"int8": (0.002, 0.99), "int4": (0.02, 0.95)}


@lru_cache(maxsize=None)
def kl_report(key):
    """The caches' own effect: float prefill products, so that the int8 activations' rounding
    (KL ~0.003 between any two slightly different runs) does not mask it."""
    from edgekv.kernels_cpu.qmatmul import float_prefill

    llm, ids = english_ids(key)
    with float_prefill():
        return perplexity(llm, ids[:N_TOKENS], n_ctx=WINDOW, kinds=("f16", "int8", "int4"), kl_base="f16",
                          progress=False)


@pytest.mark.parametrize("kind", ["int8", "int4"])
@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_quantized_cache_meets_the_targets(key, kind, request):
    if (key, kind) in MISSES:
        request.applymarker(pytest.mark.xfail(strict=True, reason="below the issue's target; see MISSES"))
    r = kl_report(key)[kind]
    print(key, kind, r)
    max_kl, min_top1 = TARGET[kind]
    assert r["mean_kl"] <= max_kl and r["top1_agreement"] >= min_top1


@pytest.mark.parametrize("key", ["smollm2", "gemma3"])
def test_int8_is_near_lossless(key):
    r = kl_report(key)
    assert r["int8"]["mean_kl"] <= 0.002 and r["int8"]["top1_agreement"] >= 0.98
    assert abs(r["int8"]["ppl"] / r["f16"]["ppl"] - 1) < 0.01


def test_streaming_far_past_the_ring_needs_sinks():
    """SmolLM2 through a 128-token ring over 4x that much text, decoded token by token."""
    ring = 128
    _, ids = english_ids("smollm2")
    llm = LLM(model_path("smollm2"), n_ctx=ring)
    ids = ids[: 4 * ring]
    inside = np.exp(streaming_nll(llm, ids[:ring], "int8", 4, progress=False).mean())
    with_sinks = np.exp(streaming_nll(llm, ids, "int8", 4, progress=False)[-ring:].mean())
    without = np.exp(streaming_nll(llm, ids, "int8", 0, progress=False)[-ring:].mean())
    print(f"ppl inside ring {inside:.2f}, last ring of 4x with sinks {with_sinks:.2f}, without {without:.2f}")
    assert with_sinks <= inside * 1.10
    assert without > with_sinks * 1.2
