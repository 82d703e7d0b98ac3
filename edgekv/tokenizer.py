"""Tokenizers built from GGUF metadata that give exactly llama.cpp's token ids.

Two kinds, chosen by `tokenizer.ggml.model`:
- "gpt2": byte-level BPE. Text is split by the pre-tokenizer regexes named by `tokenizer.ggml.pre`,
  each piece is mapped byte -> printable char (GPT-2's bytes_to_unicode) and merged by rank.
- "llama": SentencePiece-style. Spaces become U+2581, then adjacent symbols are merged by
  highest token score over the whole text fragment; unknown chars fall back to <0xXX> byte tokens.

Both first cut the text on special-token strings (llama.cpp's tokenizer_st_partition): longest
special text first, control/unknown tokens only when special=True, user-defined tokens always.
Facts (regexes, attribute rules, detokenizer clean-up) come from llama.cpp's src/llama-vocab.cpp
and src/unicode.cpp; the code is written from those facts.

Known differences from llama.cpp: character classes come from the `regex` package, whose Unicode
version is newer than llama.cpp's tables (15.1), so codepoints assigned after 15.1 may be split
differently; lone surrogates in the input are replaced by U+FFFD. A `tokenizer.ggml.pre` name not in
PRE_TOKENIZERS is refused (UnsupportedModelError), as llama.cpp refuses names it does not know; a
missing one means "default", with a warning, as in llama.cpp.
"""
from __future__ import annotations

import codecs
import heapq
import re
import warnings
from dataclasses import dataclass

import regex

from .errors import EdgekvError, ModelFileError, UnsupportedModelError

# tokenizer.ggml.token_type values -> llama.cpp token attribute bits.
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5
ATTR_LSTRIP = 1 << 7
ATTR_RSTRIP = 1 << 8
_TYPE_TO_ATTR = {0: ATTR_UNDEFINED, 1: ATTR_NORMAL, 2: ATTR_UNKNOWN, 3: ATTR_CONTROL,
                 4: ATTR_USER_DEFINED, 5: ATTR_UNUSED, 6: ATTR_BYTE}

# Pre-tokenizer regexes as llama.cpp effectively runs them (its hand-written splitters for the
# gpt2/llama3/qwen2/qwen35 expressions also split a lone whitespace before a non-space, hence `|\s+`).
# The `regex` package's \s is the Unicode White_Space set, the same set llama.cpp uses. llama.cpp
# runs its other expressions through std::regex on text where each non-ASCII char is collapsed to
# one byte per category, so \p{Lu}, \p{Ll}, ... all mean "letter": hence tekken/gpt-4o's "[^a-z] letter".
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_CONTRACTIONS_CI = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_LLAMA3 = _CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_NOT_LOWER, _NOT_UPPER = r"(?:(?=\p{L})[^a-z])", r"(?:(?=\p{L})[^A-Z])"  # a letter outside a-z / A-Z


def _cased_words(suffix: str) -> str:
    """tekken/gpt-4o's words: an upper-then-lower run, or an upper run, each with an optional prefix."""
    prefix = r"[^\r\n\p{L}\p{N}]?"
    return (prefix + _NOT_LOWER + "*" + _NOT_UPPER + "+" + suffix + "|"
            + prefix + _NOT_LOWER + "+" + _NOT_UPPER + "*" + suffix + "|")


_TEKKEN = _cased_words("") + r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_GPT4O = _cased_words(_CONTRACTIONS_CI + "?") + r"\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# Expressions with non-ASCII literals run through std::wregex on text whose non-ASCII whitespace
# became \v, so such whitespace never matches their literal ranges: hence `(?!\s)` before them.
_CJK_HANGUL = "(?:(?!\\s)[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff])+"  # deepseek's: CJK, U+0800..U+4E00, Hangul
_DEEPSEEK_LETTERS = (  # deepseek-llm's cased-letter ranges (from its tokenizer.json)
    "A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-"
    "\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-"
    "\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-"
    "\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc"
    "\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-"
    "\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-"
    "\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-"
    "\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-"
    "\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-"
    "\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-"
    "\U000118df\U0001e900-\U0001e943")
_DEEPSEEK_PUNCT = "\\s?(?:(?!\\s)[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002])+"  # incl. fullwidth
_DEEPSEEK3 = (r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
              r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SEED_CODER = _CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+"
_MINICPM5 = _CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_JAIS2 = (_CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)"
          r"|\s{8}(?!\S)|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]|\s+(?!\S)|\s+")
_EXAONE_MOE = (_CONTRACTIONS_CI + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
               r"|\s*[\r\n]|\s+(?!\S)|\s+")
_BLOOM = " ?[^(\\s|.,!?\u2026\u3002\uff0c\u3001\u0964\u06d4\u060c)]+"  # anything up to a space or sentence mark
_PRE_PATTERNS = {  # family -> regexes applied in turn, each splitting the pieces of the previous
    "default": (r"[\p{P}$+<=>^~|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
    "gpt2": (_GPT2,),
    "starcoder": (r"\p{N}", _GPT2),
    "falcon": (r"[\p{P}$+<=>^~|`]+", _GPT2, r"[0-9][0-9][0-9]"),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
    "qwen35": (_QWEN35,),
    "tekken": (_TEKKEN,),
    "gpt-4o": (_GPT4O,),
    "deepseek-llm": ("[\r\n]", r"\s?[" + _DEEPSEEK_LETTERS + "]+", _DEEPSEEK_PUNCT, r"\s+\Z", _CJK_HANGUL, r"\p{N}+"),
    "deepseek-coder": ("[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK_HANGUL, r"\p{N}"),
    "deepseek-v3": (r"\p{N}{1,3}", "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+", _DEEPSEEK3),
    "seed-coder": (_SEED_CODER,),
    "minicpm5": (r"\p{N}{1,3}", _MINICPM5),
    "jais-2": (_JAIS2,),
    "bailingmoe": (_BAILINGMOE,),
    "exaone-moe": (_EXAONE_MOE,),
    "laguna": (r"[^\n]+|\n+", _QWEN2),
    "bloom": (_BLOOM,),
    "viking": (_BLOOM, r"\p{N}"),
}


@dataclass(frozen=True)
class PreTokenizer:
    family: str  # key of _PRE_PATTERNS
    clean_spaces: bool = True  # detokenizer drops " " before ?!., and in " 's" etc. (BPE default)
    ignore_merges: bool = False  # a piece that is itself a token is emitted without merging
    add_bos: bool = False  # default when the file has no tokenizer.ggml.add_bos_token


# tokenizer.ggml.pre -> how llama.cpp configures that name ("gpt2" is not a llama.cpp name;
# accepted as an alias of "gpt-2"). Any other name is refused: llama.cpp refuses it too, or it
# needs splitting or normalization edgekv does not implement.
PRE_TOKENIZERS = {
    "default": PreTokenizer("default"),
    **{n: PreTokenizer("gpt2") for n in ("gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es",
                                        "jina-v2-de", "a.x-4.0", "mellum", "modern-bert", "mpt", "olmo", "jais",
                                        "exaone4")},
    **{n: PreTokenizer("gpt2", clean_spaces=False) for n in ("trillion", "granite-docling")},
    **{n: PreTokenizer("starcoder") for n in ("starcoder", "refact", "codeshell", "exaone", "minerva-7b", "mellum2")},
    **{n: PreTokenizer("starcoder", clean_spaces=False) for n in ("smollm", "command-r")},
    "falcon": PreTokenizer("falcon"),
    **{n: PreTokenizer("llama3", ignore_merges=True, add_bos=True)
       for n in ("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                 "jina-v5-nano")},
    **{n: PreTokenizer("llama3") for n in ("dbrx", "smaug-bpe")},
    **{n: PreTokenizer("qwen2", clean_spaces=False)
       for n in ("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "hunyuan", "solar-open", "grok-2")},
    **{n: PreTokenizer("qwen2") for n in ("stablelm2", "megrez")},
    "qwen35": PreTokenizer("qwen35", clean_spaces=False),
    "tekken": PreTokenizer("tekken", clean_spaces=False, ignore_merges=True, add_bos=True),
    **{n: PreTokenizer("gpt-4o", clean_spaces=False) for n in ("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2")},
    **{n: PreTokenizer(n, clean_spaces=False) for n in ("deepseek-llm", "deepseek-coder")},
    **{n: PreTokenizer("deepseek-v3", clean_spaces=False) for n in ("deepseek-v3", "hunyuan-dense", "joyai-llm")},
    **{n: PreTokenizer(n, clean_spaces=False) for n in ("seed-coder", "laguna", "viking")},
    **{n: PreTokenizer("bailingmoe", clean_spaces=False) for n in ("bailingmoe", "bailingmoe2", "llada-moe")},
    "minicpm5": PreTokenizer("minicpm5", ignore_merges=True),
    **{n: PreTokenizer(n) for n in ("jais-2", "exaone-moe", "bloom")},
    "gpt3-finnish": PreTokenizer("bloom"),
    "poro-chat": PreTokenizer("bloom", clean_spaces=False),
}

# Token texts llama.cpp treats as special roles when the file does not name them.
_EOT_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>", "<EOT>",
              "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>")
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
_FIM_OTHER_TEXTS = (  # fim pre/suf/mid: only their CONTROL marking matters here
    ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>", "▁<PRE>", "<|code_prefix|>",
     "<|prefix|>"),
    ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>", "▁<SUF>", "<|code_suffix|>",
     "<|suffix|>"),
    ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>", "▁<MID>", "<|code_middle|>",
     "<|middle|>"),
)
_EOG_TEXTS = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
_ALWAYS_USER_DEFINED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")  # gpt-oss: always rendered

_SPACE = "\u2581"  # SentencePiece's visible space
_C_ISSPACE = " \t\n\v\f\r"


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable char map: printable Latin-1 bytes map to themselves, the other
    68 bytes to U+0100.. in byte order, so every byte string is a string of visible chars."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, n = [""] * 256, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + n)
            n += 1
    return out


_BYTE_CHARS = _bytes_to_unicode()
_BYTE_TRANSLATE = {i: c for i, c in enumerate(_BYTE_CHARS)}  # latin-1 char -> gpt2 char
_UNICODE_TO_BYTE = {c: i for i, c in enumerate(_BYTE_CHARS)}

# llama.cpp's detokenizer clean-up for most BPE vocabs, as three passes over the bytes.
_CLEAN_PASSES = (
    (re.compile(rb" (?=[?!.,])"), b""),  # " ?" " !" " ." " ," -> drop the space
    (re.compile(rb" ' "), b"'"),  # a lone apostrophe between spaces
    (re.compile(rb" '(?=[sm]|re|ve)"), b"'"),  # " 's" " 'm" " 're" " 've" (not 't 'd 'll)
)


def _clean_spaces(b: bytes) -> bytes:
    for pat, repl in _CLEAN_PASSES:
        b = pat.sub(repl, b)
    return b


def _as_list(v) -> list:
    return v.tolist() if hasattr(v, "tolist") else list(v)


class Tokenizer:
    """Encode/decode text with a GGUF model's vocabulary, matching llama.cpp id for id."""

    # ---------------------------------------------------------------- construction

    @classmethod
    def from_metadata(cls, meta: dict) -> "Tokenizer":
        """Build from GGUF metadata (key -> python value); no network, no other files."""
        model = meta.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFileError("GGUF metadata has no tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise UnsupportedModelError(
                f"tokenizer model {model!r} is not supported (edgekv runs 'gpt2' BPE and 'llama' SPM)")
        return cls(meta)

    def __init__(self, meta: dict):
        self.model: str = meta["tokenizer.ggml.model"]
        self._spm = self.model == "llama"
        tokens = meta.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ModelFileError("GGUF metadata has no tokenizer.ggml.tokens")
        n = len(tokens)
        self.n_vocab: int = n
        # llama.cpp renames empty tokens so that every text maps to one id (the last one wins).
        self._texts: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self._vocab: dict[str, int] = {t: i for i, t in enumerate(self._texts)}

        scores = meta.get("tokenizer.ggml.scores")
        self._scores: list[float] = [0.0] * n if scores is None else [float(s) for s in _as_list(scores)]
        types = meta.get("tokenizer.ggml.token_type")
        self._attrs: list[int] = ([ATTR_NORMAL] * n if types is None
                                  else [_TYPE_TO_ATTR.get(int(t), ATTR_UNDEFINED) for t in _as_list(types)])
        if len(self._scores) < n or len(self._attrs) < n:
            raise ModelFileError(f"tokenizer scores/token_type arrays are shorter than the {n}-token vocabulary")

        self._set_options(meta)
        self._set_special_ids(meta)
        self._mark_roles_and_eog()
        self._apply_name_rules(meta)
        # special-token splitting order: longest text (in bytes) first
        special_attrs = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
        self._specials = sorted((i for i in range(n) if self._attrs[i] & special_attrs),
                                key=lambda i: (-len(self._texts[i].encode("utf-8", "surrogateescape")), i))
        # 3-char prefix -> (lengths, texts) of the special tokens starting with it, to find which
        # of them occur in a text without searching the text once per special token
        groups: dict[str, tuple[set[int], set[str]]] = {}
        for i in self._specials:
            t = self._texts[i]
            lengths, texts = groups.setdefault(t[:3], (set(), set()))
            lengths.add(len(t))
            texts.add(t)
        self._special_groups = {k: (sorted(ls), frozenset(ts)) for k, (ls, ts) in groups.items()}
        self._special_order = {}  # text -> its place in self._specials (first id with that text)
        for k, i in enumerate(self._specials):
            self._special_order.setdefault(self._texts[i], k)
        self._pieces: list[bytes | None] = [None] * n  # token_to_piece(special=True), filled lazily
        self._word_cache: dict[str, tuple[int, ...]] = {}

    def _set_options(self, meta: dict) -> None:
        pre_name = meta.get("tokenizer.ggml.pre", "")
        self.pre: str = pre_name
        if self._spm:
            self._pre = None
            self._byte_ids = self._spm_byte_ids()
            add_bos, self._clean, space_prefix = True, False, True
        else:
            merges = meta.get("tokenizer.ggml.merges")
            if merges is None:
                raise ModelFileError("BPE tokenizer without tokenizer.ggml.merges")
            pre = PRE_TOKENIZERS.get(pre_name or "default")
            if pre is None:  # llama.cpp refuses unknown names too; approximating would give other ids
                raise UnsupportedModelError(f"tokenizer.ggml.pre {pre_name!r} is not supported by edgekv "
                                            "(its pre-tokenizer would give other token ids than llama.cpp)")
            if not pre_name:
                warnings.warn("GGUF has no tokenizer.ggml.pre; using the 'default' pre-tokenizer regexes, "
                              "as llama.cpp does", stacklevel=4)
            self._pre = pre
            self._patterns = [regex.compile(p) for p in _PRE_PATTERNS[pre.family]]
            self._ranks = self._parse_merges(merges)
            add_bos, self._clean, space_prefix = pre.add_bos, pre.clean_spaces, False
        self.add_bos: bool = bool(meta.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos: bool = bool(meta.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix: bool = bool(meta.get("tokenizer.ggml.add_space_prefix", space_prefix))

    @staticmethod
    def _parse_merges(merges) -> dict[tuple[str, str], int]:
        ranks: dict[tuple[str, str], int] = {}
        for rank, m in enumerate(merges):
            pos = m.find(" ", 1)  # from 1: a merge's left side may itself start with a space
            pair = (m[:pos], m[pos + 1:]) if pos >= 0 else ("", "")
            ranks.setdefault(pair, rank)  # the first occurrence keeps its rank
        return ranks

    def _spm_byte_ids(self) -> list[int | None]:
        out: list[int | None] = []
        for b in range(256):
            tid = self._vocab.get(f"<0x{b:02X}>")
            if tid is None and b < 0x80:
                tid = self._vocab.get(chr(b))
            out.append(tid)
        return out

    def _set_special_ids(self, meta: dict) -> None:
        n = self.n_vocab
        defaults = {"bos": 1, "eos": 2, "unk": 0} if self._spm else {"bos": 11, "eos": 11}
        keys = {"bos": "bos_token_id", "eos": "eos_token_id", "unk": "unknown_token_id", "eot": "eot_token_id",
                "eom": "eom_token_id", "pad": "padding_token_id", "fim_pad": "fim_pad_token_id",
                "fim_rep": "fim_rep_token_id", "fim_sep": "fim_sep_token_id"}
        ids: dict[str, int | None] = {}
        for role, key in keys.items():
            tid = defaults.get(role)
            if tid is not None and tid >= n:
                tid = None
            v = meta.get("tokenizer.ggml." + key)
            if v is not None and 0 <= int(v) < n:
                tid = int(v)
            ids[role] = tid
        self._ids = ids
        self.bos_id: int | None = ids["bos"]
        self.eos_id: int | None = ids["eos"]
        self.unk_id: int | None = ids["unk"]
        self.pad_id: int | None = ids["pad"]

    def _mark_roles_and_eog(self) -> None:
        """Role detection by token text and the end-of-generation set, as llama_vocab::load does.
        Where several texts could fill one role, the lowest id wins (llama.cpp's pick follows
        hash-map order)."""
        attrs, ids, vocab = self._attrs, self._ids, self._vocab

        def detect(role: str | None, texts) -> int | None:
            if role is not None and ids.get(role) is not None:
                return ids[role]
            found = sorted(vocab[t] for t in texts if t in vocab)
            if not found:
                return None
            attrs[found[0]] |= ATTR_CONTROL
            if role is not None:
                ids[role] = found[0]
            return found[0]

        detect("eot", _EOT_TEXTS)
        detect("eom", _EOM_TEXTS)
        for texts in _FIM_OTHER_TEXTS:
            detect(None, texts)
        eog = {t for t in (detect("fim_pad", _FIM_PAD_TEXTS), detect("fim_rep", _FIM_REP_TEXTS),
                           detect("fim_sep", _FIM_SEP_TEXTS)) if t is not None}
        for i, text in enumerate(self._texts):
            if vocab[text] != i:
                continue  # a duplicate text: llama.cpp only sees the last id of each text
            if attrs[i] & ATTR_CONTROL and "unused" in text:
                attrs[i] |= ATTR_UNUSED
            if text in _EOG_TEXTS:
                eog.add(i)
                attrs[i] |= ATTR_CONTROL
        for text in _ALWAYS_USER_DEFINED:
            if text in vocab:
                attrs[vocab[text]] = ATTR_USER_DEFINED
        eog.update(t for t in (ids["eos"], ids["eot"], ids["eom"]) if t is not None)
        by_text = {self._texts[t]: t for t in eog}
        if "<|end|>" in by_text and (("<|return|>" in by_text and "<|call|>" in by_text)
                                     or ("<|calls|>" in by_text and "<|flush|>" in by_text)):
            end = by_text["<|end|>"]  # gpt-oss / solar-open: <|end|> separates messages, it is no EOG
            eog.discard(end)
            attrs[end] = ATTR_USER_DEFINED
        if "</s>" in by_text and ("<|tool_response>" in by_text or "<|plamo:eos|>" in by_text):
            eog.discard(by_text["</s>"])
            attrs[by_text["</s>"]] = ATTR_NORMAL
        self.eot_ids: frozenset[int] = frozenset(eog)

    def _apply_name_rules(self, meta: dict) -> None:
        """Per-model strip attributes llama.cpp sets by model name (they change special-token splitting)."""
        name = str(meta.get("general.name", "")).lower()
        if "phi-3" in name or "phi3" in name:
            for i in range(self.n_vocab):
                if self._attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN):
                    self._attrs[i] |= ATTR_RSTRIP
            for text, on in (("</s>", True), ("<unk>", False), ("<s>", False), ("<|endoftext|>", False)):
                if text in self._vocab:
                    i = self._vocab[text]
                    self._attrs[i] = self._attrs[i] | ATTR_RSTRIP if on else self._attrs[i] & ~ATTR_RSTRIP
        elif "modern-bert" in name and "[MASK]" in self._vocab:
            self._attrs[self._vocab["[MASK]"]] |= ATTR_LSTRIP

    # ---------------------------------------------------------------- encoding

    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`. add_bos None: the model's default (BOS and, if the model asks for
        it, EOS); False: neither; True: BOS even if the model does not add one by default.
        special=True turns special-token strings in the text into their ids (llama.cpp parse_special)."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates have no UTF-8 form
            text = re.sub("[\ud800-\udfff]", "\ufffd", text)
        add_special = True if add_bos is None else add_bos
        want_bos = self.add_bos if add_bos is None else add_bos
        out: list[int] = []
        if want_bos:
            if self.bos_id is None:
                raise EdgekvError("this model has no BOS token")
            out.append(self.bos_id)
        frags = self._partition(text, special) if text else []
        if self._spm:
            prev_special = True  # SPM prefixes a space to text at the start or after a special token
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    prev_special = True
                    continue
                if self.add_space_prefix and prev_special:
                    f = " " + f
                out.extend(self._spm_encode(f.replace(" ", _SPACE)))
                prev_special = False
        else:
            for f in frags:
                if isinstance(f, int):
                    out.append(f)
                    continue
                for word in self._pretokenize(f):
                    out.extend(self._bpe_word(word))
        if add_special and self.add_eos:
            if self.eos_id is None:
                raise EdgekvError("this model has no EOS token")
            out.append(self.eos_id)
        return out

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Cut text on special-token strings, longest first (llama.cpp's tokenizer_st_partition)."""
        frags: list[str | int] = [text]
        order = self._special_order
        # only the special tokens that occur, in llama.cpp's order (longest text first)
        todo = sorted((order[t] for t in self._special_texts_in(text)))
        for k in todo:
            tid = self._specials[k]
            t = self._texts[tid]
            attr = self._attrs[tid]
            if not special and attr & (ATTR_CONTROL | ATTR_UNKNOWN):
                continue  # user-defined tokens are split out even when special=False
            new: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or t not in f:
                    new.append(f)
                    continue
                parts = f.split(t)
                last = len(parts) - 1
                for j, p in enumerate(parts):
                    if j > 0 and attr & ATTR_RSTRIP:
                        p = p.lstrip(_C_ISSPACE)
                    if j < last and attr & ATTR_LSTRIP:
                        p = p.rstrip(_C_ISSPACE)
                    if p:
                        new.append(p)
                    if j < last:
                        new.append(tid)
            frags = new
        return frags

    def _special_texts_in(self, text: str) -> set[str]:
        """The special-token texts that occur in text. Per prefix group, either look at each
        place the prefix occurs (few places, many tokens: "<unused*>") or search each text
        (many places, few tokens: runs of spaces)."""
        found: set[str] = set()
        for key, (lengths, texts) in self._special_groups.items():
            count = text.count(key)
            if count == 0:
                continue
            if count * len(lengths) > 4 * len(texts):
                found.update(t for t in texts if t in text)
                continue
            p = text.find(key)
            while p >= 0:
                for n in lengths:
                    if text[p:p + n] in texts:
                        found.add(text[p:p + n])
                p = text.find(key, p + 1)
        return found

    def _pretokenize(self, text: str) -> list[str]:
        pieces = [text]
        for pat in self._patterns:
            out: list[str] = []
            for piece in pieces:
                pos = 0
                for m in pat.finditer(piece):
                    if m.start() > pos:
                        out.append(piece[pos:m.start()])  # unmatched stretches stay pieces too
                    out.append(m.group())
                    pos = m.end()
                if pos < len(piece):
                    out.append(piece[pos:])
            pieces = out
        return pieces

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        cached = self._word_cache.get(word)
        if cached is not None:
            return cached
        enc = word.encode("utf-8").decode("latin-1").translate(_BYTE_TRANSLATE)
        vocab = self._vocab
        tid = vocab.get(enc) if self._pre.ignore_merges or len(enc) == 1 else None
        if tid is not None:
            ids: tuple[int, ...] = (tid,)
        else:
            ids = tuple(self._bpe_merge(enc))
        if len(self._word_cache) > 200_000:
            self._word_cache.clear()
        self._word_cache[word] = ids
        return ids

    def _bpe_merge(self, enc: str) -> list[int]:
        """Merge adjacent symbols, lowest merge rank first, leftmost on ties (llama.cpp's bigram queue)."""
        ranks = self._ranks
        syms = list(enc)  # current text of each symbol; "" once merged into its left neighbour
        n = len(syms)
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []
        for i in range(n - 1):
            r = ranks.get((syms[i], syms[i + 1]))
            if r is not None:
                heap.append((r, i, i + 1, 2))
        heapq.heapify(heap)
        while heap:
            _, left, right, size = heapq.heappop(heap)
            ls, rs = syms[left], syms[right]
            if not ls or not rs or len(ls) + len(rs) != size:
                continue  # stale: one side changed since this pair was queued
            syms[left] = ls + rs
            syms[right] = ""
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
            before = prv[left]
            if before >= 0:
                r = ranks.get((syms[before], syms[left]))
                if r is not None:
                    heapq.heappush(heap, (r, before, left, len(syms[before]) + len(syms[left])))
            if after >= 0:
                r = ranks.get((syms[left], syms[after]))
                if r is not None:
                    heapq.heappush(heap, (r, left, after, len(syms[left]) + len(syms[after])))
        out: list[int] = []
        vocab = self._vocab
        i = 0
        while i >= 0:
            s = syms[i]
            tid = vocab.get(s)
            if tid is not None:
                out.append(tid)
            else:  # llama.cpp then looks up each single byte of the symbol's UTF-8 text
                out.extend(vocab[chr(b)] for b in s.encode("utf-8") if b < 0x80 and chr(b) in vocab)
            i = nxt[i]
        return out

    def _spm_encode(self, text: str) -> list[int]:
        """SentencePiece-style merge over one fragment: highest score first, leftmost on ties."""
        n = len(text)
        if n == 0:
            return []
        get, scores = self._vocab.get, self._scores
        pop, push = heapq.heappop, heapq.heappush
        # Symbols are contiguous runs: symbol i spans text[i : i + lens[i]]; lens[i] = 0 once it
        # was merged into its left neighbour, so a live symbol's right neighbour starts at i + lens[i].
        lens = [1] * n
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        prv = list(range(-1, n - 1))
        heap = []  # (-score, left, merged length): best score first, leftmost on ties
        for i in range(n - 1):
            tid = get(text[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, 2))
        heapq.heapify(heap)
        while heap:
            _, left, size = pop(heap)
            ll = lens[left]
            right = left + ll
            if ll == 0 or right >= n or ll + lens[right] != size:
                continue  # stale: one side changed since this pair was queued
            lens[left] = size
            lens[right] = 0
            after = nxt[right]
            nxt[left] = after
            if after >= 0:
                prv[after] = left
                end = after + lens[after]
                tid = get(text[left:end])
                if tid is not None:
                    push(heap, (-scores[tid], left, end - left))
            before = prv[left]
            if before >= 0:
                tid = get(text[before:left + size])
                if tid is not None:
                    push(heap, (-scores[tid], before, left + size - before))
        out: list[int] = []
        i = 0
        while i >= 0:
            s = text[i:i + lens[i]]
            tid = get(s)
            if tid is not None:
                out.append(tid)
            else:  # no token for this char: one <0xXX> token per UTF-8 byte
                for b in s.encode("utf-8"):
                    bid = self._byte_ids[b]
                    if bid is None:
                        raise EdgekvError(f"SPM vocabulary has no byte token <0x{b:02X}> for {s!r}")
                    out.append(bid)
            i = nxt[i]
        return out

    # ---------------------------------------------------------------- decoding

    def control_ids(self) -> list[int]:
        """Ids of the control tokens: BOS, EOS and the chat template's role and turn markers."""
        return [i for i, a in enumerate(self._attrs) if a & ATTR_CONTROL]

    def token_text(self, id: int) -> str:
        """The vocabulary string of a token (e.g. 'Ġthe', '▁the', '<0x0A>')."""
        return self._texts[self._check(id)]

    def token_bytes(self, id: int) -> bytes:
        """The bytes a token stands for, special tokens rendered as their text (llama.cpp
        token_to_piece with special=True). May be part of a UTF-8 sequence."""
        return self._piece(self._check(id))

    def _check(self, id) -> int:
        i = int(id)
        if not 0 <= i < self.n_vocab:
            raise EdgekvError(f"token id {i} is outside the vocabulary (0..{self.n_vocab - 1})")
        return i

    def _piece(self, i: int) -> bytes:
        p = self._pieces[i]
        if p is None:
            p = self._pieces[i] = self._make_piece(i)
        return p

    def _make_piece(self, i: int) -> bytes:
        attr, text = self._attrs[i], self._texts[i]
        if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            return text.encode("utf-8", "surrogateescape")
        if attr & ATTR_NORMAL:
            if self._spm:
                return text.replace(_SPACE, " ").encode("utf-8", "surrogateescape")
            out = bytearray()
            for ch in text:
                b = _UNICODE_TO_BYTE.get(ch)
                if b is None:  # not a byte-level char: llama.cpp writes a visible marker instead
                    out += b"[UNK_BYTE_0x" + ch.encode("utf-8", "surrogateescape").hex().encode() + text.encode("utf-8", "surrogateescape") + b"]"
                else:
                    out.append(b)
            return bytes(out)
        if attr & ATTR_BYTE:
            try:
                return bytes([int(text[3:5], 16)])
            except ValueError:
                return b"\0"
        return b""  # unused / undefined tokens render as nothing

    def _render(self, i: int, special: bool) -> bytes:
        if not special and self._attrs[i] & (ATTR_UNKNOWN | ATTR_CONTROL):
            return b""
        return self._piece(i)

    def decode_bytes(self, ids, special: bool = True) -> bytes:
        """llama.cpp's llama_detokenize(remove_special=False, unparse_special=special), as bytes."""
        parts = []
        strip_first = self.add_space_prefix  # undo the space SPM prepended to the first word
        for t in ids:
            p = self._render(self._check(t), special)
            if strip_first and p[:1] == b" ":
                p = p[1:]
            strip_first = False
            parts.append(p)
        out = b"".join(parts)
        return _clean_spaces(out) if self._clean else out

    def decode(self, ids, special: bool = True) -> str:
        """Text of `ids`; special=True renders control tokens (e.g. '<|im_end|>') as their text.
        Bytes that do not form valid UTF-8 become U+FFFD."""
        return self.decode_bytes(ids, special).decode("utf-8", "replace")

    def stream(self, special: bool = True) -> "StreamDecoder":
        """An incremental decoder whose outputs concatenate to decode(all ids, special)."""
        return StreamDecoder(self, special)

    def __repr__(self) -> str:
        kind = "SPM" if self._spm else f"BPE pre={self.pre!r}"
        return f"Tokenizer({kind}, n_vocab={self.n_vocab}, bos={self.bos_id}, eos={self.eos_id})"


class _HoldSpaceBefore:
    """Streaming form of the first clean-up pass: drop a space that precedes ?!.,"""

    def __init__(self):
        self.held = False

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        for c in data:
            if self.held:
                self.held = False
                if c not in b"?!.,":
                    out.append(0x20)
            if c == 0x20:
                self.held = True
            else:
                out.append(c)
        return bytes(out)

    def flush(self) -> bytes:
        held, self.held = self.held, False
        return b" " if held else b""


class _ReplaceStream:
    """Streaming left-to-right replacement of fixed byte patterns (like re.sub on the whole text).
    A match is `pattern` (replaced by `repl`) followed by one of `lookahead` (kept)."""

    def __init__(self, pattern: bytes, repl: bytes, lookahead: tuple[bytes, ...] = (b"",)):
        self.full = [pattern + la for la in lookahead]
        self.prefixes = {f[:k] for f in self.full for k in range(1, len(f))}
        self.cut, self.repl = len(pattern), repl
        self.buf = b""

    def feed(self, data: bytes) -> bytes:
        out = bytearray()
        for c in data:
            self.buf += bytes((c,))
            while self.buf:
                if self.buf in self.full:
                    out += self.repl + self.buf[self.cut:]  # lookahead bytes never start a new match
                    self.buf = b""
                elif self.buf in self.prefixes:
                    break
                else:
                    out.append(self.buf[0])
                    self.buf = self.buf[1:]
        return bytes(out)

    def flush(self) -> bytes:
        buf, self.buf = self.buf, b""
        return buf


class StreamDecoder:
    """Turns generated ids into text as they arrive. push() returns only complete UTF-8 text:
    trailing bytes of a split multi-byte character (and, for vocabularies with llama.cpp's
    space clean-up, a space whose fate depends on the next bytes) are held back until known."""

    def __init__(self, tok: Tokenizer, special: bool = True):
        self._tok, self._special = tok, special
        self._first = True
        self._passes = [_HoldSpaceBefore(), _ReplaceStream(b" ' ", b"'"),
                        _ReplaceStream(b" '", b"'", (b"s", b"m", b"re", b"ve"))] if tok._clean else []
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, id: int) -> str:
        p = self._tok._render(self._tok._check(id), self._special)
        if self._first:
            self._first = False
            if self._tok.add_space_prefix and p[:1] == b" ":
                p = p[1:]
        for stage in self._passes:
            p = stage.feed(p)
        return self._utf8.decode(p)

    def flush(self) -> str:
        """The held-back rest (an incomplete UTF-8 tail becomes U+FFFD); the decoder is then reset."""
        tail = b""
        for stage in self._passes:
            tail = stage.feed(tail) + stage.flush()
        out = self._utf8.decode(tail, final=True)
        self._first = True
        return out
