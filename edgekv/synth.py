"""Synthetic GGUF models: the real shapes of Llama-2 7B/13B, a TinyLlama-sized 1B and Gemma 3,
filled with random quantized weights, for benchmarks that need a big model but not its text.

A file is written tensor by tensor in chunks of a few MiB, so a 13B model costs disk time, not
memory: quantized blocks are random bytes whose scale fields are then overwritten with small
f16 values, so every weight dequantizes to a zero-centred value of about `weight_std` (0.02,
like a trained layer's init) and a forward pass gives finite logits. The vocabulary is a small
but valid SentencePiece one (controls, 256 byte tokens, ASCII pieces, common English words,
filler pieces), so llama.cpp and edgekv both load and tokenize the file. The metadata key
`edgekv.synthetic = true` marks it so benchmark rows can say their model was synthetic
(`edgekv.synthetic_seed` records the seed).

Tensor types follow what llama.cpp's `quantize` does for the matching ftype:
  - 1-D tensors (norms) are F32;
  - the output projection (output.weight, or token_embd.weight when tied, as in Gemma 3) is
    Q6_K for q4_0/q5_0/q4_k, and the requested type for q8_0, q6_k, f16, f32;
  - every other 2-D weight, token_embd included, is the requested type;
  - a K-quant (256-element blocks) on rows whose width is not a multiple of 256 falls back
    as llama.cpp's does: Q4_K -> Q5_0, Q6_K -> Q8_0 (Gemma 3's 640/1152 widths hit this).
"""
from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import numpy as np

from .errors import UnsupportedModelError
from .quants import BY_NAME

# fmt: off
SIZES: dict[str, dict[str, dict]] = {
    "llama": {
        # a 256-wide toy: every quant type (K-quants need widths divisible by 256) in a few MB
        "tiny": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320, n_ctx=512),
        # TinyLlama-1.1B
        "1b":   dict(n_layer=22, n_embd=2048, n_head=32, n_head_kv=4, n_ff=5632, n_vocab=32000, n_ctx=2048),
        # Llama-2-7B / 13B
        "7b":   dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=32, n_ff=11008, n_vocab=32000, n_ctx=4096),
        "13b":  dict(n_layer=40, n_embd=5120, n_head=40, n_head_kv=40, n_ff=13824, n_vocab=32000, n_ctx=4096),
        # Llama-3.1-8B: GQA 32/8, llama3 RoPE frequency factors (rope_freqs.weight)
        "8b":   dict(n_layer=32, n_embd=4096, n_head=32, n_head_kv=8, n_ff=14336, n_vocab=128256, n_ctx=131072,
                     rope_base=500000.0, rope_llama3=(8.0, 1.0, 4.0, 8192)),
        # Mistral-Nemo-12B: head size 128 from attention.key_length, n_embd / n_head = 160
        "12b":  dict(n_layer=40, n_embd=5120, n_head=32, n_head_kv=8, head_dim=128, n_ff=14336, n_vocab=131072,
                     n_ctx=1024000, rope_base=1e6),
    },
    "qwen3": {
        # head size 128 with n_embd/n_head = 64: the key_length path
        "tiny": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, head_dim=128, n_ff=512, n_vocab=320, n_ctx=512),
        # Qwen3-8B
        "8b":   dict(n_layer=36, n_embd=4096, n_head=32, n_head_kv=8, head_dim=128, n_ff=12288, n_vocab=151936,
                     n_ctx=40960),
    },
    "granite": {
        "tiny": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320, n_ctx=512),
        # Granite-3.x-8B (its four multipliers as in the released config)
        "8b":   dict(n_layer=40, n_embd=4096, n_head=32, n_head_kv=8, n_ff=12800, n_vocab=49155, n_ctx=131072,
                     rope_base=10000000.0),
    },
    "gemma2": {
        # layers 0 and 2 slide over 16 tokens, 1 and 3 see everything
        "tiny": dict(n_layer=4, n_embd=256, n_head=4, n_head_kv=2, head_dim=64, n_ff=512, n_vocab=320,
                     n_ctx=512, sliding_window=16),
        # Gemma-2-9B
        "9b":   dict(n_layer=42, n_embd=3584, n_head=16, n_head_kv=8, head_dim=256, n_ff=14336, n_vocab=256000,
                     n_ctx=8192, sliding_window=4096),
    },
    "phi3": {
        # GQA 4/2 (Phi-4-mini has it; Phi-3.5-mini has 32/32), fused attn_qkv and gate/up ffn_up
        "tiny": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320, n_ctx=512),
        # Phi-4-mini's layout, small: RoPE over 48 of 64 dims, LongRoPE over an original context of
        # 8 (at n_ctx 512 the long factors, 1 .. 64, and attn_factor sqrt(3) on the rotated dims), tied
        "tiny-phi4": dict(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320, n_ctx=512,
                          rope_dim=48, rope_longrope=8, tied=True),
        # Phi-3.5-mini-instruct: LongRoPE over an original context of 4096 (attn_factor 1.19)
        "3.8b": dict(n_layer=32, n_embd=3072, n_head=32, n_head_kv=32, n_ff=8192, n_vocab=32064, n_ctx=131072,
                     rope_longrope=4096, sliding_window=262144),
        # Phi-4-mini-instruct: GQA 24/8, RoPE over 96 of 128 dims, LongRoPE over 4096, tied output
        # (its o200k BPE vocabulary of 200064 is stood in for by a SentencePiece one of that size)
        "4b":   dict(n_layer=32, n_embd=3072, n_head=24, n_head_kv=8, n_ff=8192, n_vocab=200064, n_ctx=131072,
                     rope_longrope=4096, rope_dim=96, sliding_window=262144, tied=True),
    },
    "gemma3": {
        # 7 layers so that layer 5 is global and the others slide over 8 tokens
        "tiny": dict(n_layer=7, n_embd=256, n_head=2, n_head_kv=1, head_dim=32, n_ff=512, n_vocab=320,
                     n_ctx=512, sliding_window=8),
        "270m": dict(n_layer=18, n_embd=640, n_head=4, n_head_kv=1, head_dim=256, n_ff=2048, n_vocab=262144,
                     n_ctx=32768, sliding_window=512),
        "1b":   dict(n_layer=26, n_embd=1152, n_head=4, n_head_kv=1, head_dim=256, n_ff=6912, n_vocab=262144,
                     n_ctx=32768, sliding_window=512),
    },
}
# Hyperparameters every size of an architecture shares (overridable like the sizes).
# rope_llama3: (factor, low_freq_factor, high_freq_factor, original context) -> rope_freqs.weight;
# rope_yarn: (factor, original context) -> rope.scaling.* keys; None = plain RoPE.
# rope_longrope (phi3): original context -> LongRoPE factor tensors and attention factor.
DEFAULTS = {
    "llama": dict(rope_base=10000.0, norm_eps=1e-5, rope_llama3=None, rope_yarn=None),
    "gemma2": dict(rope_base=10000.0, norm_eps=1e-6, attn_softcap=50.0, final_softcap=30.0, score_std=3.0),
    "gemma3": dict(rope_base=1e6, norm_eps=1e-6),
    "qwen3": dict(rope_base=1e6, norm_eps=1e-6, rope_yarn=None),
    "granite": dict(rope_base=10000.0, norm_eps=1e-5, rope_yarn=None, embedding_scale=12.0, residual_scale=0.22,
                    attention_scale=0.0078125, logit_scale=16.0),
    # rope_longrope: original context -> rope_factors_long/short.weight (synthetic ramps, longrope_factors)
    # and rope.scaling.attn_factor as convert_hf_to_gguf computes it; rope_dim: rotated dims (None: all);
    # tied: no output.weight (Phi-4-mini), the output reads token_embd
    "phi3": dict(rope_base=10000.0, norm_eps=1e-5, rope_longrope=None, rope_dim=None, sliding_window=0, tied=False),
}
# fmt: on

# requested type -> (GGML type of the bulk weights, llama.cpp ftype written to general.file_type)
QTYPES = {
    "f32": ("F32", 0),    # ALL_F32
    "f16": ("F16", 1),    # MOSTLY_F16
    "q4_0": ("Q4_0", 2),  # MOSTLY_Q4_0
    "q5_0": ("Q5_0", 8),  # MOSTLY_Q5_0
    "q8_0": ("Q8_0", 7),  # MOSTLY_Q8_0
    "q4_k": ("Q4_K", 14),  # MOSTLY_Q4_K_S: uniform Q4_K with a Q6_K output
    "q6_k": ("Q6_K", 18),  # MOSTLY_Q6_K
}
K_FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}  # llama.cpp's choice when ncols % 256 != 0
QK_K = 256
CHUNK_BYTES = 16 << 20  # bytes generated and written at a time

# Special tokens (all CONTROL) in the id order of each family's real tokenizer.
SPECIALS = {
    "llama": ["<unk>", "<s>", "</s>"],
    "qwen3": ["<unk>", "<s>", "</s>"],  # a SentencePiece vocabulary stands in for their BPE ones
    "granite": ["<unk>", "<s>", "</s>"],
    "gemma2": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
    # Phi-3's added tokens (ids 32000.. there) right after SentencePiece's three
    "phi3": ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>", "<|end|>", "<|user|>"],
    "gemma3": ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
}
SPECIAL_IDS = {  # unk, bos, eos, pad (None = no key)
    "llama": dict(unk=0, bos=1, eos=2, pad=None),
    "qwen3": dict(unk=0, bos=1, eos=2, pad=None),
    "granite": dict(unk=0, bos=1, eos=2, pad=None),
    "gemma2": dict(unk=3, bos=2, eos=1, pad=0),
    "phi3": dict(unk=0, bos=1, eos=3, pad=3),  # eos and pad <|endoftext|>, as Phi-3's
    "gemma3": dict(unk=3, bos=2, eos=1, pad=0),
}
TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_BYTE = 1, 3, 6  # llama.cpp's token types
WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if will up "
    "other about out many then them these so some her would make like him into time has look two more write "
    "go see number no way could people my than first water been call who its now find long down day did get "
    "come made may part hello world model cache token quick brown fox jumps over lazy dog once upon story "
    "The It In This A He She We They Hello What How"
).split()


def write_synthetic(path: str | os.PathLike, arch: str = "llama", size: str = "7b", qtype: str = "q4_0",
                    seed: int = 0, progress: bool = True, weight_std: float = 0.02, peaked: bool = False,
                    **overrides) -> Path:
    """Write a synthetic GGUF (v3) model to `path` and return the path.

    arch/size pick a row of SIZES; `overrides` replace any of its fields (n_layer, n_embd,
    n_head, n_head_kv, n_ff, n_vocab, n_ctx, head_dim, sliding_window, rope_base, norm_eps,
    rope_llama3, rope_yarn, granite's multipliers, gemma2's soft-caps and peaked score_std, phi3's rope_longrope and rope_dim). qtype is one of QTYPES. peaked: structured
    weights whose next-token distributions are peaked (`_peaked_weights`; f32, f16 or q8_0, small
    models: they are made in memory) instead of random blocks. Same arguments, same bytes. The
    file appears under its name only once complete (written to `<path>.part`, then renamed).
    """
    import gguf
    from tqdm import tqdm

    hp = _hparams(arch, size, overrides)
    qtype = qtype.lower()
    if qtype not in QTYPES:
        raise UnsupportedModelError(f"synthetic qtype {qtype!r} is not supported (choose {', '.join(QTYPES)})")
    bulk, ftype = QTYPES[qtype]
    if peaked and (bulk not in PEAKED_TYPES or arch == "gemma3"):
        raise UnsupportedModelError(f"peaked synthetic weights: not gemma3; as {', '.join(PEAKED_TYPES)}")
    plan = _tensor_plan(arch, hp, bulk)
    dense = (_peaked_gemma2 if arch == "gemma2" else _peaked_weights)(arch, hp, seed) if peaked else None
    tokens, scores, types = _vocab(arch, hp["n_vocab"])

    path = Path(path).expanduser()
    part = path.with_name(path.name + ".part")
    w = gguf.GGUFWriter(None, arch)
    _add_metadata(w, arch, size, qtype, ftype, hp, seed, tokens, scores, types)
    for name, shape, tname in plan:
        qt = BY_NAME[tname]
        nbytes = _nbytes(shape, qt)
        w.add_tensor_info(name, (*shape[:-1], qt.row_bytes(shape[-1])), np.dtype(np.uint8), nbytes,
                          raw_dtype=gguf.GGMLQuantizationType(qt.id))
    total = sum(_nbytes(shape, BY_NAME[t]) for _, shape, t in plan)
    try:
        w.write_header_to_file(part)
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        fout = w.fout[0]  # tensor data is streamed in chunks, not handed over whole
        w.write_padding(fout, fout.tell())
        with tqdm(total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress) as bar:
            for i, (name, shape, tname) in enumerate(plan):
                rng = np.random.default_rng([seed, i])  # per tensor, so one tensor's bytes never depend on another's
                nbytes = 0
                if dense is not None:
                    chunks = [_encode(dense[name], tname)]
                elif name == "rope_freqs.weight":
                    chunks = [_llama3_factors(hp).view(np.uint8)]
                elif name in LONGROPE_TENSORS:
                    chunks = [longrope_factors(hp)[name].view(np.uint8)]
                else:
                    chunks = _tensor_chunks(rng, arch, name, shape, BY_NAME[tname], weight_std)
                for chunk in chunks:
                    fout.write(chunk.data)
                    nbytes += chunk.nbytes
                    bar.update(chunk.nbytes)
                w.write_padding(fout, nbytes)
        w.close()
        os.replace(part, path)
    except BaseException:
        w.close()
        part.unlink(missing_ok=True)
        raise
    return path


def _hparams(arch: str, size: str, overrides: dict) -> dict:
    if arch not in SIZES:
        raise UnsupportedModelError(f"synthetic arch {arch!r} is not supported (choose {', '.join(SIZES)})")
    if size not in SIZES[arch]:
        raise UnsupportedModelError(f"synthetic {arch} size {size!r} is not known (choose {', '.join(SIZES[arch])})")
    hp = {**DEFAULTS[arch], **SIZES[arch][size]}
    unknown = set(overrides) - set(hp) - {"head_dim"}
    if unknown:
        raise ValueError(f"unknown synthetic model fields {sorted(unknown)} (known: {sorted(hp)})")
    hp.update(overrides)
    hp.setdefault("head_dim", hp["n_embd"] // hp["n_head"])
    if arch == "phi3":
        hp["rope_dim"] = hp["rope_dim"] or hp["head_dim"]
        if hp["rope_dim"] > hp["head_dim"] or hp["rope_dim"] % 2:
            raise ValueError(f"rope_dim {hp['rope_dim']} must be even and at most head_dim {hp['head_dim']}")
    if hp["n_head"] % hp["n_head_kv"] or hp["head_dim"] % 2:
        raise ValueError(f"n_head {hp['n_head']} must be a multiple of n_head_kv {hp['n_head_kv']} and head_dim even")
    if arch in ("granite", "phi3") and hp["head_dim"] * hp["n_head"] != hp["n_embd"]:
        raise ValueError(f"{arch} needs n_embd == n_head * head_dim")
    n_min = len(SPECIALS[arch]) + 256
    if hp["n_vocab"] < n_min:
        raise ValueError(f"n_vocab must be at least {n_min} ({arch} specials + 256 byte tokens)")
    return hp


def _tensor_plan(arch: str, hp: dict, bulk: str) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape, GGML type name) of every tensor, in file order."""
    e, ff, V = hp["n_embd"], hp["n_ff"], hp["n_vocab"]
    qd, kvd = hp["n_head"] * hp["head_dim"], hp["n_head_kv"] * hp["head_dim"]
    out_type = bulk if bulk in ("F32", "F16", "Q8_0", "Q6_K") else "Q6_K"

    def weight(name, shape, t=bulk):
        if t in K_FALLBACK and shape[-1] % QK_K:
            t = K_FALLBACK[t]
        return (name, shape, t)

    tied = arch in ("gemma2", "gemma3") or hp.get("tied")  # token_embd is also the output projection
    plan = [weight("token_embd.weight", (V, e), out_type if tied else bulk)]
    if hp.get("rope_llama3"):
        plan.append(("rope_freqs.weight", (hp["head_dim"] // 2,), "F32"))
    if hp.get("rope_longrope"):
        plan += [(name, (hp["rope_dim"] // 2,), "F32") for name in LONGROPE_TENSORS]
    norms = ["attn_norm", "ffn_norm"]
    if arch in ("gemma2", "gemma3"):
        norms += ["post_attention_norm", "post_ffw_norm"]
    for i in range(hp["n_layer"]):
        p = f"blk.{i}."
        plan += [(p + n + ".weight", (e,), "F32") for n in norms]
        if arch in ("gemma3", "qwen3"):
            plan += [(p + f"attn_{x}_norm.weight", (hp["head_dim"],), "F32") for x in "qk"]
        if arch == "phi3":  # q, k, v in one matrix; gate and up in ffn_up
            plan += [weight(p + "attn_qkv.weight", (qd + 2 * kvd, e)), weight(p + "attn_output.weight", (e, qd)),
                     weight(p + "ffn_up.weight", (2 * ff, e)), weight(p + "ffn_down.weight", (e, ff))]
            continue
        plan += [
            weight(p + "attn_q.weight", (qd, e)), weight(p + "attn_k.weight", (kvd, e)),
            weight(p + "attn_v.weight", (kvd, e)), weight(p + "attn_output.weight", (e, qd)),
            weight(p + "ffn_gate.weight", (ff, e)), weight(p + "ffn_up.weight", (ff, e)),
            weight(p + "ffn_down.weight", (e, ff)),
        ]
    plan.append(("output_norm.weight", (e,), "F32"))
    if not tied:
        plan.append(weight("output.weight", (V, e), out_type))
    return plan


def _nbytes(shape: tuple[int, ...], qt) -> int:
    return int(np.prod(shape[:-1], dtype=np.int64)) * qt.row_bytes(shape[-1])


# -- metadata and vocabulary ---------------------------------------------------------

def _add_metadata(w, arch, size, qtype, ftype, hp, seed, tokens, scores, types) -> None:
    a = arch
    w.add_string("general.type", "model")
    w.add_string("general.name", f"synthetic {arch} {size} {qtype}")
    w.add_bool("edgekv.synthetic", True)
    w.add_uint64("edgekv.synthetic_seed", seed)
    w.add_uint32(f"{a}.context_length", hp["n_ctx"])
    w.add_uint32(f"{a}.embedding_length", hp["n_embd"])
    w.add_uint32(f"{a}.block_count", hp["n_layer"])
    w.add_uint32(f"{a}.feed_forward_length", hp["n_ff"])
    w.add_uint32(f"{a}.attention.head_count", hp["n_head"])
    w.add_uint32(f"{a}.attention.head_count_kv", hp["n_head_kv"])
    w.add_float32(f"{a}.attention.layer_norm_rms_epsilon", hp["norm_eps"])
    w.add_float32(f"{a}.rope.freq_base", hp["rope_base"])
    if arch == "phi3":  # as convert_hf_to_gguf's Phi3MiniModel
        w.add_uint32(f"{a}.rope.dimension_count", hp["rope_dim"])
        w.add_uint32(f"{a}.rope.scaling.original_context_length", hp["rope_longrope"] or hp["n_ctx"])
        if hp["rope_longrope"]:
            w.add_float32(f"{a}.rope.scaling.attn_factor", longrope_attn_factor(hp["n_ctx"], hp["rope_longrope"]))
        w.add_uint32(f"{a}.attention.sliding_window", hp["sliding_window"])
    elif arch in ("llama", "granite"):
        w.add_uint32(f"{a}.rope.dimension_count", hp["head_dim"])
        w.add_uint32(f"{a}.vocab_size", hp["n_vocab"])
        if hp["head_dim"] * hp["n_head"] != hp["n_embd"]:  # Mistral-Nemo
            w.add_uint32(f"{a}.attention.key_length", hp["head_dim"])
            w.add_uint32(f"{a}.attention.value_length", hp["head_dim"])
    else:
        w.add_uint32(f"{a}.attention.key_length", hp["head_dim"])
        w.add_uint32(f"{a}.attention.value_length", hp["head_dim"])
    if arch in ("gemma2", "gemma3"):
        w.add_uint32(f"{a}.attention.sliding_window", hp["sliding_window"])
    if arch == "gemma2":
        w.add_float32(f"{a}.attn_logit_softcapping", hp["attn_softcap"])
        w.add_float32(f"{a}.final_logit_softcapping", hp["final_softcap"])
    if hp.get("rope_yarn"):
        factor, n_orig = hp["rope_yarn"]
        w.add_string(f"{a}.rope.scaling.type", "yarn")
        w.add_float32(f"{a}.rope.scaling.factor", factor)
        w.add_uint32(f"{a}.rope.scaling.original_context_length", n_orig)
    if arch == "granite":
        for key in ("embedding_scale", "residual_scale", "logit_scale"):
            w.add_float32(f"{a}.{key}", hp[key])
        w.add_float32(f"{a}.attention.scale", hp["attention_scale"])
    w.add_uint32("general.file_type", ftype)
    w.add_uint32("general.quantization_version", 2)

    ids = SPECIAL_IDS[arch]
    w.add_string("tokenizer.ggml.model", "llama")
    w.add_string("tokenizer.ggml.pre", "default")
    w.add_array("tokenizer.ggml.tokens", tokens)
    w.add_array("tokenizer.ggml.scores", scores)
    w.add_array("tokenizer.ggml.token_type", types)
    w.add_uint32("tokenizer.ggml.bos_token_id", ids["bos"])
    w.add_uint32("tokenizer.ggml.eos_token_id", ids["eos"])
    w.add_uint32("tokenizer.ggml.unknown_token_id", ids["unk"])
    if ids["pad"] is not None:
        w.add_uint32("tokenizer.ggml.padding_token_id", ids["pad"])
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_eos_token", False)
    # Llama's (and Phi-3's) SentencePiece prepends a space to the text; Gemma's does not.
    w.add_bool("tokenizer.ggml.add_space_prefix", arch in ("llama", "phi3"))


def _vocab(arch: str, n_vocab: int) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, token types) of a SentencePiece vocabulary of exactly n_vocab pieces.

    Every word comes with all its "▁"-prefixed prefixes, so SentencePiece's merges (which
    only join two pieces when the result is a piece) can build it from single characters.
    """
    specials = SPECIALS[arch]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)]
    types = [TOKEN_CONTROL] * len(specials) + [TOKEN_BYTE] * 256
    seen = set(tokens)
    pieces: list[str] = []

    def add(p: str) -> None:
        if p not in seen:
            seen.add(p)
            pieces.append(p)

    add("▁")
    chars = [chr(c) for c in range(33, 127)]  # printable ASCII, no space (that is "▁")
    for c in chars:
        add(c)
    for c in chars:
        add("▁" + c)
    for word in WORDS:
        for k in range(2, len(word) + 1):
            add("▁" + word[:k])
    lower = "abcdefghijklmnopqrstuvwxyz"
    n_need = n_vocab - len(tokens)
    for k in itertools.count(2):  # filler: every k-letter string, bare and word-initial
        if len(pieces) >= n_need:
            break
        for t in itertools.product(lower, repeat=k):
            s = "".join(t)
            add(s)
            add("▁" + s)
            if len(pieces) >= n_need:
                break
    pieces = pieces[:n_need]
    tokens += pieces
    types += [TOKEN_NORMAL] * len(pieces)
    # controls and bytes score 0 like llama's; pieces get decreasing scores (earlier = merged first)
    scores = [0.0] * (len(specials) + 256) + [-float(k + 1) for k in range(len(pieces))]
    return tokens, scores, types


# -- tensor data ---------------------------------------------------------------------

def _tensor_chunks(rng, arch, name, shape, qt, std):
    """uint8 chunks of the tensor's bytes, in file order, each at most ~CHUNK_BYTES."""
    if len(shape) == 1:
        n = shape[0]
        if arch in ("gemma2", "gemma3"):
            # Gemma's GGUF norm weights include the "+1"; keep them near 1 but not all equal.
            v = 1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)
        else:
            v = np.ones(n, np.float32)
        yield v.view(np.uint8)
        return
    n_rows, n_cols = int(np.prod(shape[:-1])), shape[-1]
    row_bytes = qt.row_bytes(n_cols)
    rows_per_chunk = max(1, CHUNK_BYTES // row_bytes)
    for r0 in range(0, n_rows, rows_per_chunk):
        rows = min(rows_per_chunk, n_rows - r0)
        if qt.name in ("F32", "F16"):
            v = rng.standard_normal(rows * n_cols, dtype=np.float32) * np.float32(std)
            yield v.astype(np.float16 if qt.name == "F16" else np.float32).view(np.uint8)
        else:
            yield BLOCK_MAKERS[qt.name](rng, rows * n_cols // qt.block_elems, std).reshape(-1)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """float array (n,) -> uint8 (n, 2), little-endian f16."""
    return x.astype("<f2").view(np.uint8).reshape(-1, 2)


def _jitter(rng, n: int, signed: bool = False) -> np.ndarray:
    # Blocks in a real model have different scales; +-25% around the target keeps that.
    j = rng.uniform(0.75, 1.25, n).astype(np.float32)
    if signed:  # llama.cpp's Q4_0/Q5_0 d = max/-8 (or -16) takes the sign of the block's extreme
        j *= rng.integers(0, 2, n).astype(np.float32) * 2 - 1
    return j


# Each maker returns uint8 (n_blocks, block_bytes). Quant codes are random bytes; the scales
# are chosen so that rms(code * scale) is `std`. Constants are the rms of the uniform codes:
# 4.64 = rms(q - 8), q in 0..15; 9.25 = rms(q - 16), q in 0..31; 73.9 = rms(int8);
# 4.61 = rms(q - 7.5), q in 0..15; 18.5 = rms(q - 32), q in 0..63.

def _q4_0(rng, n, std):
    # Q4_0: 32 weights in 18 bytes: d f16, 16 bytes of 4-bit q (low nibbles first); w = d * (q - 8)
    b = rng.integers(0, 256, (n, 18), dtype=np.uint8)
    b[:, 0:2] = _f16_bytes(std / 4.64 * _jitter(rng, n, signed=True))  # q - 8 leans negative; the sign evens it
    return b


def _q5_0(rng, n, std):
    # Q5_0: 32 weights in 22 bytes: d f16, qh u32 (5th bits), 16 bytes of low nibbles; w = d * (q - 16)
    b = rng.integers(0, 256, (n, 22), dtype=np.uint8)
    b[:, 0:2] = _f16_bytes(std / 9.25 * _jitter(rng, n, signed=True))
    return b


def _q8_0(rng, n, std):
    # Q8_0: 32 weights in 34 bytes: d f16, 32 int8; w = d * q
    b = rng.integers(0, 256, (n, 34), dtype=np.uint8)
    b[:, 0:2] = _f16_bytes(std / 73.9 * _jitter(rng, n))
    return b


def _q4_k(rng, n, std):
    # Q4_K: 256 weights in 144 bytes: d f16, dmin f16, 12 bytes of eight 6-bit (scale, min) pairs,
    # 128 bytes of 4-bit q; sub-block j: w = d * sc_j * q - dmin * m_j.
    # With m_j = sc_j and dmin = 7.5 d, w = d * sc_j * (q - 7.5): zero-centred like a real layer.
    b = rng.integers(0, 256, (n, 144), dtype=np.uint8)
    sc = rng.integers(32, 64, (n, 8), dtype=np.uint8)  # rms 48.4
    m = sc
    d = (std / (48.4 * 4.61) * _jitter(rng, n)).astype(np.float16)
    b[:, 0:2] = _f16_bytes(d)
    b[:, 2:4] = _f16_bytes(d.astype(np.float32) * 7.5)
    # scale bytes 0-3: sc[0:4] low 6 bits, sc[4:8] bits 4-5 on top; 4-7: the same for m;
    # 8-11: sc[4:8] low nibble | m[4:8] low nibble << 4
    b[:, 4:8] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    b[:, 8:12] = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    b[:, 12:16] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return b


def _q6_k(rng, n, std):
    # Q6_K: 256 weights in 210 bytes: 128 bytes ql (low 4 bits), 64 bytes qh (high 2 bits),
    # 16 int8 scales (one per 16 weights), d f16 last; w = d * scale * (q - 32).
    b = rng.integers(0, 256, (n, 210), dtype=np.uint8)
    # |scale| in 64..127 like llama.cpp's (it maps the largest sub-block to +-127), random sign
    mag = rng.integers(64, 128, (n, 16), dtype=np.int16)  # rms 97.3
    sign = rng.integers(0, 2, (n, 16), dtype=np.int16) * 2 - 1
    b[:, 192:208] = (mag * sign).astype(np.int8).view(np.uint8)
    b[:, 208:210] = _f16_bytes(std / (97.3 * 18.5) * _jitter(rng, n))
    return b


BLOCK_MAKERS = {"Q4_0": _q4_0, "Q5_0": _q5_0, "Q8_0": _q8_0, "Q4_K": _q4_k, "Q6_K": _q6_k}


LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def longrope_factors(hp: dict) -> dict[str, np.ndarray]:
    """Synthetic LongRoPE factors, (rope_dim/2,) float32 each, shaped like Phi-3.5's: long ones
    rising geometrically from 1 (fast pairs) to n_ctx / original context (slowest pair), short
    ones within 10% of 1."""
    n = hp["rope_dim"] // 2
    ramp = np.arange(n, dtype=np.float64) / max(n - 1, 1)
    scale = hp["n_ctx"] / hp["rope_longrope"]
    return {"rope_factors_long.weight": np.power(scale, ramp).astype(np.float32),
            "rope_factors_short.weight": (1.0 + 0.1 * ramp**2).astype(np.float32)}


def longrope_attn_factor(n_ctx: int, n_ctx_orig: int) -> float:
    """rope.scaling.attn_factor as convert_hf_to_gguf writes it for LongRoPE ('su'/'longrope')."""
    scale = n_ctx / n_ctx_orig
    return math.sqrt(1 + math.log(scale) / math.log(n_ctx_orig)) if scale > 1.0 else 1.0


def _llama3_factors(hp: dict) -> np.ndarray:
    from .rope import llama3_factors

    factor, low, high, n_orig = hp["rope_llama3"]
    return llama3_factors(hp["rope_base"], hp["head_dim"], factor, low, high, n_orig)


# -- peaked weights ------------------------------------------------------------------
# Random weights give flat next-token distributions whose top two logits are closer than the
# rounding of an 8-bit activation, so no two implementations agree on them. These are built so
# that each token has a likely successor and the context moves the rest of the distribution:
#   token_embd E ~ N(0, 1); the output row of token u is P * E[pred(u)] (its predecessor under a
#   random permutation) plus noise, so the successor of the current token leads by ~PEAK nats;
#   the noise part reads the whole residual, so what attention added moves every other logit;
#   each layer adds a fraction of the residual (ATTN_OUT, FFN_OUT rms against E's 1);
#   q and k give attention scores of std ~SCORE_STD, sharp enough that where a query looks
#   (its RoPE angles, its scale, its norms) matters.
PEAKED_TYPES = ("F32", "F16", "Q8_0")
PEAK, SPREAD = 8.0, 2.0  # successor's logit; std of the other logits (nats)
SCORE_STD, ATTN_OUT, FFN_OUT = 3.0, 1.0, 0.3
QK_NORM_GAIN = 1.7  # qwen3's q/k norm weights: scores come from these, not from the raw q/k size
# A tied output (phi3 tied=True) has no row to put the successor in. Instead tokens come in
# pairs (a, b) with E[b] = sign * E[a] and output_norm = gain * sign (random signs): the logit
# of b after a (and of a after b) is gain * E[a].E[a], while a token's own logit and the
# others' sum signs and stay small. What the layers add moves the others by ~|c| / sqrt(e) of
# the peak, so attention adds more here (TIED_ATTN_OUT: at 2.5 it barely moved them; at 4 an
# int4 cache is at the edge of its KL 0.02 from f16).
TIED_ATTN_OUT = 3.5


def _peaked_weights(arch: str, hp: dict, seed: int) -> dict[str, np.ndarray]:
    """float32 arrays by tensor name (numpy shapes), deterministic in (arch, hp, seed)."""
    e, ff, V, hd = hp["n_embd"], hp["n_ff"], hp["n_vocab"], hp["head_dim"]
    H, Hkv, L = hp["n_head"], hp["n_head_kv"], hp["n_layer"]
    rng = np.random.default_rng([seed, 0x9EA4ED])
    gauss = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    g = {k: hp.get(k, 1.0) for k in ("embedding_scale", "residual_scale", "logit_scale")}
    # granite: attention.scale replaces 1/sqrt(head_dim); q and k make up the difference
    qk_mul = np.sqrt((1.0 / np.sqrt(hd)) / hp["attention_scale"]) if "attention_scale" in hp else 1.0
    E = gauss(V, e)
    tied = hp.get("tied")
    attn_out = TIED_ATTN_OUT if tied else ATTN_OUT
    if tied:
        sign = np.where(rng.random(e) < 0.5, -1.0, 1.0).astype(np.float32)
        pairs = rng.permutation(V)[: V // 2 * 2].reshape(-1, 2)
        E[pairs[:, 1]] = E[pairs[:, 0]] * sign
    out: dict[str, np.ndarray] = {"token_embd.weight": E / g["embedding_scale"]}
    if hp.get("rope_llama3"):
        out["rope_freqs.weight"] = _llama3_factors(hp)
    if hp.get("rope_longrope"):
        out.update(longrope_factors(hp))
    qk_std = np.sqrt(SCORE_STD / e)  # q_i, k_i of std sqrt(SCORE_STD): scores q.k/sqrt(hd) of std SCORE_STD
    if arch == "qwen3":
        qk_std = 0.3 / np.sqrt(e)  # raw q, k small: the norms set the scale
    qk_dims = np.full(hd, qk_std)  # per dim of a head (float64 until the weights are made)
    if arch == "phi3" and hp.get("rope_longrope"):  # LongRoPE's attn_factor on rotated q and k: scores keep SCORE_STD
        af, n_rot = longrope_attn_factor(hp["n_ctx"], hp["rope_longrope"]), hp["rope_dim"]
        if n_rot == hd:
            qk_dims /= af
        else:  # rotated and pass-through dims give half the score variance each, so either matters
            qk_dims[:n_rot] *= (hd / (2 * n_rot)) ** 0.25 / af
            qk_dims[n_rot:] *= (hd / (2 * (hd - n_rot))) ** 0.25
    qk_rows = lambda n: (np.tile(qk_dims, n) * qk_mul).astype(np.float32)[:, None]  # noqa: E731  (n * hd, 1)
    for i in range(L):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = np.ones(e, np.float32)
        out[p + "ffn_norm.weight"] = np.ones(e, np.float32)
        if arch == "qwen3":
            for x in "qk":
                out[p + f"attn_{x}_norm.weight"] = np.float32(QK_NORM_GAIN) * (1 + 0.2 * gauss(hd))
        out[p + "attn_q.weight"] = gauss(H * hd, e) * qk_rows(H)
        out[p + "attn_k.weight"] = gauss(Hkv * hd, e) * qk_rows(Hkv)
        out[p + "attn_v.weight"] = gauss(Hkv * hd, e) / np.float32(np.sqrt(e))
        out[p + "attn_output.weight"] = gauss(e, H * hd) * np.float32(attn_out / np.sqrt(H * hd) / g["residual_scale"])
        out[p + "ffn_gate.weight"] = gauss(ff, e) / np.float32(np.sqrt(e))
        out[p + "ffn_up.weight"] = gauss(ff, e) / np.float32(np.sqrt(e))
        out[p + "ffn_down.weight"] = gauss(e, ff) * np.float32(FFN_OUT / (0.5 * np.sqrt(ff)) / g["residual_scale"])
        if arch == "phi3":  # the same matrices, stacked as phi3 stores them
            out[p + "attn_qkv.weight"] = np.concatenate([out.pop(p + f"attn_{x}.weight") for x in "qkv"])
            out[p + "ffn_up.weight"] = np.concatenate([out.pop(p + "ffn_gate.weight"), out.pop(p + "ffn_up.weight")])
    share = 1.0 / np.sqrt(1.0 + L * (attn_out**2 + FFN_OUT**2))  # E[t]'s part of the normed residual
    if tied:
        out["output_norm.weight"] = sign * np.float32(PEAK / (share * e))
        return out
    out["output_norm.weight"] = np.ones(e, np.float32)
    pred = np.argsort(rng.permutation(V))  # pred[u]: the token whose successor is u
    out["output.weight"] = (E[pred] * np.float32(PEAK / (share * e)) + gauss(V, e) * np.float32(SPREAD / np.sqrt(e))) \
        * np.float32(g["logit_scale"])
    return out


# gemma2 is tied (llama.cpp always reads its output from token_embd), so the successor has to
# come from a layer: the last FFN is made (nearly) linear, M xn, and M maps each token's
# embedding to s * E[succ] where s are random signs on output_norm (which also cancel the
# token's own |E[t]|^2). The gate reads N_CONST embedding dims that hold the same value for
# every token (an equal shift of every logit) and that no layer writes: gelu(gate) is a
# positive constant per token, which the post-FFN norm divides out.
N_CONST, SUCC_GAIN, SUCC_LOGIT, G2_ATTN_OUT = 8, 2.5, 3.0, 0.6  # constant dims; rms of the successor
# branch and of each attention branch; output gain (nats of logit std)


def _peaked_gemma2(arch: str, hp: dict, seed: int) -> dict[str, np.ndarray]:
    """float32 arrays by tensor name for a peaked, tied gemma2 (see above); attention scores
    of std hp["score_std"] so that a small attn_softcap in the metadata is reached."""
    e, ff, V, hd = hp["n_embd"], hp["n_ff"], hp["n_vocab"], hp["head_dim"]
    H, Hkv, L = hp["n_head"], hp["n_head_kv"], hp["n_layer"]
    rng = np.random.default_rng([seed, 0x9E2A2])
    gauss = lambda *shape: rng.standard_normal(shape, dtype=np.float32)  # noqa: E731
    c = e - N_CONST  # the token-specific dims
    E = gauss(V, e)
    E[:, c:] = 1.0
    out: dict[str, np.ndarray] = {"token_embd.weight": E / np.float32(np.sqrt(e))}  # x = E after sqrt(e)
    qk_std = np.sqrt(hp["score_std"] / e)
    sign = np.where(rng.random(e) < 0.5, -1.0, 1.0).astype(np.float32)
    pred = np.argsort(rng.permutation(V))  # pred[u]: the token whose successor is u
    succ = np.argsort(pred)
    # M (c, c): E[t] -> sign * E[succ[t]] on the token dims, least squares with a ridge of V
    # (plain least squares blows up the small directions, and with them what attention added)
    A, T = E[:, :c].astype(np.float64), (E[succ][:, :c] * sign[:c]).astype(np.float64)
    M = np.linalg.solve(A.T @ A + V * np.eye(c), A.T @ T).T.astype(np.float32)
    for i in range(L):
        p = f"blk.{i}."
        last = i == L - 1
        out[p + "attn_norm.weight"] = np.ones(e, np.float32)
        out[p + "ffn_norm.weight"] = np.ones(e, np.float32)
        out[p + "post_attention_norm.weight"] = np.full(e, G2_ATTN_OUT, np.float32)
        out[p + "post_ffw_norm.weight"] = np.full(e, SUCC_GAIN if last else FFN_OUT, np.float32)
        out[p + "attn_q.weight"] = gauss(H * hd, e) * np.float32(qk_std)
        out[p + "attn_k.weight"] = gauss(Hkv * hd, e) * np.float32(qk_std)
        out[p + "attn_v.weight"] = gauss(Hkv * hd, e) / np.float32(np.sqrt(e))
        wo = gauss(e, H * hd) / np.float32(np.sqrt(H * hd))
        wo[c:] = 0  # the constant dims stay constant
        out[p + "attn_output.weight"] = wo
        if last:  # gelu(gate) a positive constant, up: the token dims, down: M on them
            gate = np.zeros((ff, e), np.float32)
            gate[:, c:] = 2.0 / N_CONST
            up = np.zeros((ff, e), np.float32)
            up[:c, :c] = np.eye(c, dtype=np.float32)
            down = np.zeros((e, ff), np.float32)
            down[:c, :c] = M
        else:
            gate = gauss(ff, e) / np.float32(np.sqrt(e))
            up = gauss(ff, e) / np.float32(np.sqrt(e))
            down = gauss(e, ff) / np.float32(np.sqrt(ff))
            down[c:] = 0
        out[p + "ffn_gate.weight"], out[p + "ffn_up.weight"], out[p + "ffn_down.weight"] = gate, up, down
    out["output_norm.weight"] = sign * np.float32(SUCC_LOGIT)
    return out


def _encode(w: np.ndarray, tname: str) -> np.ndarray:
    """uint8 bytes of a float32 array as F32, F16, or Q8_0 quantized from its F16 rounding (what
    llama.cpp's quantizer makes of the F16 file)."""
    if tname == "F32":
        return np.ascontiguousarray(w, np.float32).view(np.uint8).reshape(-1)
    h = w.astype(np.float16)
    if tname == "F16":
        return h.view(np.uint8).reshape(-1)
    import gguf
    from gguf.quants import quantize

    return quantize(h.astype(np.float32), gguf.GGMLQuantizationType.Q8_0).reshape(-1)
