"""The fused decoder block (kernels_cpu/block.py: a whole block in one call per decode token)
against the same model run op by op on the CPU backend (itself checked against the numpy
reference in test_models / test_kvcache), on both real models and every cache type, through
a ring that wraps (sinks seen through the counter-rotated query)."""
import numpy as np
import pytest

from conftest import decode_logits, llamacpp_fixture, open_model

N_CTX = 40  # global layers' ring: 8 + 72 tokens wrap it; gemma3's local layers keep 512


def _decode_logits(model, ids: list[int], kind: str, fused: bool, stacked: bool = True) -> np.ndarray:
    """8 tokens prefilled (op by op either way), then one at a time through a ring of N_CTX."""
    from edgekv.kvcache import KVCache

    cfg = model.cfg
    windows = cfg.windows()
    cache = KVCache([w if w else N_CTX for w in windows], cfg.n_head_kv, cfg.head_dim, windows=windows, kind=kind)
    return decode_logits(model, ids, cache, fused, 8, stacked)


def _ids(model_key: str) -> list[int]:
    P = llamacpp_fixture(model_key)["prompts"]
    ids = (P[0]["prompt_ids"] + P[0]["continuation"] + P[1]["prompt_ids"] + P[1]["continuation"])[:80]
    assert len(ids) == 80
    return ids


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_fused_block_decode_equals_op_by_op(model_key, kind):
    _, model = open_model(model_key, "cpu")
    assert all(b is not None for b in model.blocks)  # the CPU backend packs every block
    ids = _ids(model_key)
    fused = _decode_logits(model, ids, kind, True)
    plain = _decode_logits(model, ids, kind, False)
    rel = np.linalg.norm(fused - plain, axis=-1) / np.linalg.norm(plain, axis=-1)
    print(f"{model_key} {kind}: max relative difference {rel.max():.2e}")
    assert np.array_equal(fused.argmax(-1), plain.argmax(-1))
    assert rel.max() < 1e-3, rel.max()


@pytest.mark.parametrize("kind", ["f16", "int8", "int4"])
def test_stacked_decode_equals_block_by_block(monkeypatch, model_key, kind):
    # every block of a decode token in one call (block.decode_stack): the kernels of a call per
    # block in the same order, so the same bits, through the wrapping ring too
    _, model = open_model(model_key, "cpu")
    assert model.stack is not None
    blk, calls = model.be.blk, []
    inner = blk.decode_stack
    monkeypatch.setattr(blk, "decode_stack", lambda *a: calls.append(1) or inner(*a))
    ids = _ids(model_key)
    stacked = _decode_logits(model, ids, kind, True)
    assert len(calls) == len(ids) - 8  # each decode token, once
    per_block = _decode_logits(model, ids, kind, True, stacked=False)
    assert len(calls) == len(ids) - 8
    assert np.array_equal(stacked, per_block)


def test_reference_backend_has_no_fused_block():
    """The oracle runs the model's own op-by-op code."""
    _, model = open_model("smollm2", "reference")
    assert all(b is None for b in model.blocks) and model.stack is None
