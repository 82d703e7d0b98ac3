"""Shared fixtures: the two real models (pulled on first use, like `edgekv pull`) and
llama.cpp's recorded outputs."""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import numpy as np
import pytest

FIXTURES = Path(__file__).parent / "fixtures"
MODELS = {"smollm2": "smollm2-135m-instruct", "gemma3": "gemma3-270m"}


@lru_cache(maxsize=None)
def model_path(key: str) -> Path:
    """Path of a real model by short key; pulls it into the cache on first use."""
    from edgekv.hub import resolve

    return resolve(MODELS[key], progress=False)


def pulled(name: str) -> Path:
    """A known model by its full name, pulled into the cache if it is not there yet."""
    return model_path({v: k for k, v in MODELS.items()}[name])


@lru_cache(maxsize=None)
def llamacpp_fixture(key: str) -> dict:
    return json.loads((FIXTURES / f"llamacpp_{key}.json").read_text())


@lru_cache(maxsize=None)
def open_model(key: str, device: str):
    """(GGUFFile, Model) for a real model on a backend, shared across tests."""
    from edgekv.backends import get_backend
    from edgekv.gguf_file import GGUFFile
    from edgekv.models import build_model

    f = GGUFFile(model_path(key))
    return f, build_model(f, get_backend(device))


def decode_logits(model, ids: list[int], cache, fused: bool, n_prefill: int, stacked: bool = True) -> np.ndarray:
    """Logits of ids[:n_prefill] prefilled, then of each later id fed one at a time, through
    cache: with the model's fused decode blocks (fused; all of them in one call a token where the
    backend stacks them, unless not stacked) or its op-by-op code (blocks switched off)."""
    saved = model.blocks, model.stack
    if not fused:
        model.blocks = [None] * len(saved[0])
    if not (fused and stacked):
        model.stack = None
    try:
        out = [model.forward(np.asarray(ids[:n_prefill]), np.arange(n_prefill), cache)]
        for p in range(n_prefill, len(ids)):
            out.append(model.forward(np.asarray(ids[p : p + 1]), np.array([p]), cache))
    finally:
        model.blocks, model.stack = saved
    return np.concatenate(out)


def teacher_forced_logits(model, ids: list[int], n_ctx: int = 4096, kind: str = "f16") -> np.ndarray:
    """Logits after every prefix of ids, prefilled in chunks of 512 like llama.cpp's batches."""
    from edgekv.kvcache import KVCache

    cache = KVCache.for_model(model.cfg, n_ctx, kind)
    outs = []
    for s in range(0, len(ids), 512):
        chunk = np.asarray(ids[s : s + 512], dtype=np.int64)
        outs.append(model.forward(chunk, np.arange(s, s + len(chunk), dtype=np.int64), cache, last_only=False))
    return np.concatenate(outs)


def agreement(model, fixture: dict) -> tuple[float, float]:
    """(top-1 agreement, mean KL over llama.cpp's top-20) teacher-forced along llama.cpp's
    greedy continuations. KL(p || q) with p = llama.cpp's top-20 renormalised and q = ours
    restricted to the same ids and renormalised."""
    tops, kls = [], []
    for P in fixture["prompts"]:
        ids = P["prompt_ids"] + P["continuation"][:-1]
        lg = teacher_forced_logits(model, ids)[len(P["prompt_ids"]) - 1 :]
        t, k = row_agreement(lg, P["top_ids"], P["top_logprobs"])
        tops += t
        kls += k
    return float(np.mean(tops)), float(np.mean(kls))


def row_agreement(logits: np.ndarray, top_ids, top_logprobs) -> tuple[list[bool], list[float]]:
    """Per row of our logits (n, n_vocab): whether its argmax is llama.cpp's top-1, and KL(p || q)
    with p = llama.cpp's top-20 renormalised, q = ours on the same ids renormalised."""
    tops, kls = [], []
    for row, tid, lp in zip(logits.astype(np.float64), top_ids, top_logprobs):
        tid = np.asarray(tid)
        p = np.exp(np.asarray(lp, dtype=np.float64))
        p /= p.sum()
        q = np.exp(row[tid] - row.max())
        q /= q.sum()
        kls.append(float(np.sum(p * (np.log(p) - np.log(q)))))
        tops.append(int(np.argmax(row)) == tid[0])
    return tops, kls


def serve_process(*extra: str):
    """`edgekv serve` on SmolLM2 (ctx 256, f16 cache) on a free port of 127.0.0.1, as a child
    process with JSON logs: (the Popen, its first record, which gives the URL)."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "edgekv.cli", "serve", str(model_path("smollm2")), "--port", "0",
                          "--ctx", "256", "--kv", "f16", "-q", "--log-format", "json", *extra], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if not line:
        raise AssertionError(f"edgekv serve did not start: {p.stderr.read()}")
    return p, json.loads(line)


@pytest.fixture(params=sorted(MODELS))
def model_key(request) -> str:
    return request.param


@lru_cache(maxsize=None)
def get_llm(key: str = "smollm2", n_ctx: int = 512, kv: str = "f16"):
    """A loaded edgekv.LLM on the CPU backend, shared across tests (read-only use)."""
    from edgekv import LLM

    return LLM(model_path(key), n_ctx=n_ctx, kv=kv)


@pytest.fixture(autouse=True, scope="session")
def _prompt_cache_in_a_temporary_folder(tmp_path_factory):
    """No test writes into the user's prompt cache ($EDGEKV_HOME/prompt-cache): every LLM's disk
    entries go to a temporary folder (a test that wants its own sets llm.prompt_cache's)."""
    import edgekv.prompt_cache as pc

    d = tmp_path_factory.mktemp("prompt-cache")
    before = pc.default_dir
    pc.default_dir = lambda: d
    yield d
    pc.default_dir = before
