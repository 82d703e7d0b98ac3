"""The official chat templates of Llama 3.1/3.2/3.3, Qwen3, Qwen2.5, Phi-3.5, Phi-4(-mini),
Gemma 2, Mistral-Nemo and Granite 3.3 (tests/fixtures/templates/, sources in its README) render in
edgekv's sandbox exactly as plain jinja2 and transformers' apply_chat_template render them
(renderings.json, recorded by tests/fixtures/record_templates.py); and each family's end-of-turn
tokens end generation."""

import json
from datetime import datetime
from pathlib import Path

import pytest
from test_peer_vocab import PEER  # ../shared/peer_vocab, or None

from edgekv.chat_template import ChatTemplate
from edgekv.errors import TemplateError
from edgekv.gguf_file import read_metadata
from edgekv.tokenizer import Tokenizer

TEMPLATES = Path(__file__).parent / "fixtures" / "templates"
RECORDED = json.loads((TEMPLATES / "renderings.json").read_text(encoding="utf-8"))
CLOCK = datetime.fromisoformat(RECORDED["clock"])
CASES = [(stem, c) for stem, t in RECORDED["templates"].items() for c in t["cases"]]


def template(stem: str, **options) -> ChatTemplate:
    t = RECORDED["templates"][stem]
    source = (TEMPLATES / f"{stem}.jinja").read_text(encoding="utf-8")
    return ChatTemplate(source, bos_token=t["bos_token"], eos_token=t["eos_token"], clock=lambda: CLOCK, **options)


def render(ct: ChatTemplate, case: dict) -> str:
    return ct.render(case["messages"], case["add_generation_prompt"], tools=case["tools"],
                     documents=case["documents"], **case["variables"])


@pytest.mark.parametrize("stem,case", CASES, ids=[f"{s}-{c['name']}" for s, c in CASES])
def test_template_renders_as_plain_jinja2(stem, case):
    ct = template(stem)
    assert ct.kind == "gguf"
    if case["error"] is not None:
        with pytest.raises(TemplateError, match="raised an error: " + case["error"].replace(".", r"\.")):
            render(ct, case)
    else:
        assert render(ct, case) == case["expected"]


def test_every_template_file_is_recorded():
    files = {p.stem for p in TEMPLATES.glob("*.jinja")}
    assert files == set(RECORDED["templates"])
    readme = (TEMPLATES / "README.md").read_text(encoding="utf-8")
    assert all(f"`{stem}.jinja`" in readme for stem in files), "each template's source is in the README"


def test_cases_cover_what_the_families_need():
    names = {(stem, c["name"]) for stem, c in CASES}
    for stem in ("meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.3-70B-Instruct"):
        assert {(stem, "date_with_system"), (stem, "date_without_system"), (stem, "tools_in_user_message"),
                (stem, "builtin_tools_eom")} <= names
    qwen3 = [c for stem, c in CASES if stem == "Qwen-Qwen3-0.6B"]
    assert {c["variables"].get("enable_thinking") for c in qwen3} >= {False, True, None}
    assert any("<think>" in m["content"] for c in qwen3 for m in c["messages"] if m["role"] == "assistant")


def test_qwen3_thinking_switch():
    ct = template("Qwen-Qwen3-0.6B")
    msgs = [{"role": "user", "content": "Hi"}]
    assert ct.render(msgs, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ct.render(msgs, enable_thinking=True).endswith("<|im_start|>assistant\n")
    assert ct.render(msgs) == ct.render(msgs, enable_thinking=True)


def test_llama31_date_preamble():
    ct = template("meta-llama-Llama-3.1-8B-Instruct")
    msgs = [{"role": "user", "content": "Hi"}]
    assert "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>" in ct.render(msgs)
    assert "Today Date: 01 Jan 2027\n\n" in ct.render(msgs, date_string="01 Jan 2027")


def test_strftime_now_reads_the_clock():
    msgs = [{"role": "user", "content": "Hi"}]
    assert "Today Date: 05 Dec 2026\n" in template("meta-llama-Llama-3.2-3B-Instruct").render(msgs)
    src = (TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja").read_text(encoding="utf-8")
    before = datetime.now().strftime("%d %b %Y")
    out = ChatTemplate(src).render(msgs)  # default clock: now
    assert f"Today Date: {before}\n" in out or f"Today Date: {datetime.now():%d %b %Y}\n" in out


def test_template_inputs_are_plain_data():
    ct = template("Qwen-Qwen3-0.6B")
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(TemplateError, match=r"tools\[0\] has type object"):
        ct.render(msgs, tools=[object()])
    with pytest.raises(TemplateError, match="enable_thinking has type builtin_function"):
        ct.render(msgs, enable_thinking=len)
    with pytest.raises(TemplateError, match="messages must be a non-empty list"):
        ct.render([{"role": "assistant", "content": None}])  # no content and no tool_calls
    # Tuples arrive as lists; the caller's messages are not modified.
    msgs = ({"role": "user", "content": "Hi", "extra": None},)
    ct.render(msgs)
    assert msgs[0] == {"role": "user", "content": "Hi", "extra": None}


def test_builtin_formats_need_text_content():
    ct = ChatTemplate(None, vocab_tokens=["<|im_start|>"])
    with pytest.raises(TemplateError, match="built-in chatml format needs string contents"):
        ct.render([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}])
    assert ct.render([{"role": "user", "content": "Hi"}], enable_thinking=False, tools=[]) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_namespace_and_dict_as_transformers_has_them():
    # (underscore names on a namespace are refused: see test_chat_template's HOSTILE)
    ok = ("{% set ns = namespace(n=1) %}{% set ns.n = ns.n + 1 %}{{ ns.n }}"
          "{{ dict(a=1)|tojson }}{{ dict.fromkeys('ab') }}")
    assert ChatTemplate(ok).render([{"role": "user", "content": "x"}]) == "2{\"a\": 1}{'a': None, 'b': None}"


# --- templates inside GGUF files -----------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen2", "phi-3"])
def test_gguf_embedded_template_is_the_fixture(name):
    if PEER is None:
        pytest.skip("../shared/peer_vocab (llama.cpp's vocab-only files) is absent")
    path = PEER / f"ggml-vocab-{name}.gguf"
    meta = read_metadata(path)
    stem = f"gguf-{name}-vocab"
    assert meta["tokenizer.chat_template"] == (TEMPLATES / f"{stem}.jinja").read_text(encoding="utf-8")
    tokens = meta["tokenizer.ggml.tokens"]
    ct = ChatTemplate.from_metadata(meta, tokens, meta["tokenizer.ggml.bos_token_id"],
                                    meta["tokenizer.ggml.eos_token_id"])
    if name == "phi-3":  # the template prints bos_token: the GGUF's must be the recorded one
        assert ct.bos_token == RECORDED["templates"][stem]["bos_token"]
    for case in RECORDED["templates"][stem]["cases"]:
        assert ct.render(case["messages"], case["add_generation_prompt"]) == case["expected"], case["name"]


# --- end of generation -----------------------------------------------------------------------------

CONTROL, NORMAL = 3, 1  # GGUF token types

# Per family: tokenizer model, pre-tokenizer, the special tokens of its real vocabulary (in id
# order; a subset), which ones the GGUF names as bos/eos, and the tokens llama.cpp (hence edgekv)
# ends generation on. The chat end-of-turn token of each family must be among them; the tokens
# that open a turn or a role must not.
FAMILIES = {
    "llama-3.1": ("gpt2", "llama-bpe", ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                        "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"],
                  "<|begin_of_text|>", "<|eot_id|>", {"<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"}),
    "qwen2.5/qwen3": ("gpt2", "qwen2", ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                                        "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                                        "<|repo_name|>", "<|file_sep|>", "<think>", "</think>"],
                      "<|endoftext|>", "<|im_end|>",
                      {"<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}),
    "phi-3/3.5": ("llama", "default", ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|assistant|>", "<|system|>",
                                       "<|end|>", "<|user|>"],
                  "<s>", "<|endoftext|>", {"</s>", "<|endoftext|>", "<|end|>"}),
    "phi-4": ("gpt2", "dbrx", ["<|endoftext|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|im_start|>",
                               "<|im_end|>", "<|im_sep|>"],
              "<|endoftext|>", "<|im_end|>", {"<|endoftext|>", "<|im_end|>"}),
    "phi-4-mini": ("gpt2", "gpt-4o", ["<|endoftext|>", "<|endofprompt|>", "<|assistant|>", "<|end|>", "<|user|>",
                                      "<|system|>", "<|tool|>", "<|/tool|>", "<|tool_call|>", "<|/tool_call|>",
                                      "<|tool_response|>", "<|tag|>"],
                   "<|endoftext|>", "<|endoftext|>", {"<|endoftext|>", "<|end|>"}),
    "gemma-2": ("llama", "default", ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>",
                                     "<end_of_turn>"],
                "<bos>", "<eos>", {"<eos>", "<end_of_turn>"}),
    "mistral-nemo": ("gpt2", "tekken", ["<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]",
                                        "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[TOOL_CALLS]"],
                     "<s>", "</s>", {"</s>"}),
    "granite-3": ("gpt2", "refact", ["<|end_of_text|>", "<fim_prefix>", "<fim_middle>", "<fim_suffix>", "<fim_pad>",
                                     "<filename>", "<reponame>", "<|start_of_role|>", "<|end_of_role|>",
                                     "<|tool_call|>"],
                  "<|end_of_text|>", "<|end_of_text|>", {"<|end_of_text|>", "<fim_pad>", "<reponame>"}),
}
TURN_ENDS = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "</s>", "<|end_of_text|>"}


def family_vocab(model: str, pre: str, specials: list[str], bos: str, eos: str) -> dict:
    """Vocab-only GGUF metadata: the specials (CONTROL) first, then single characters."""
    chars = [chr(c) for c in range(0x21, 0x7F)]
    tokens = specials + chars
    meta = {"tokenizer.ggml.model": model, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [CONTROL] * len(specials) + [NORMAL] * len(chars),
            "tokenizer.ggml.bos_token_id": tokens.index(bos), "tokenizer.ggml.eos_token_id": tokens.index(eos)}
    if model == "gpt2":
        meta |= {"tokenizer.ggml.pre": pre, "tokenizer.ggml.merges": []}
    else:
        meta["tokenizer.ggml.scores"] = [0.0] * len(tokens)
    return meta


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_end_of_turn_tokens_end_generation(family):
    model, pre, specials, bos, eos, expected = FAMILIES[family]
    tok = Tokenizer.from_metadata(family_vocab(model, pre, specials, bos, eos))
    eog = {tok.token_text(i) for i in tok.eot_ids}
    assert eog == expected
    assert TURN_ENDS & set(specials) <= eog  # every end-of-turn text the family has
    assert tok.eos_id in tok.eot_ids


@pytest.mark.parametrize("name,expected", [
    ("llama-bpe", {"<|end_of_text|>", "<|eot_id|>"}),  # Llama 3.0's vocabulary: no <|eom_id|> yet
    ("qwen2", {"<|endoftext|>", "<|im_end|>", "</s>"}),  # "</s>" is an ordinary BPE token here; llama.cpp's list has it
    ("phi-3", {"</s>", "<|endoftext|>", "<|end|>"}),
])
def test_peer_vocab_end_of_turn_tokens(name, expected):
    if PEER is None:
        pytest.skip("../shared/peer_vocab (llama.cpp's vocab-only files) is absent")
    tok = Tokenizer.from_metadata(read_metadata(PEER / f"ggml-vocab-{name}.gguf"))
    assert {tok.token_text(i) for i in tok.eot_ids} == expected


def test_generation_stops_at_an_end_of_turn_token_that_is_not_eos(tmp_path):
    # Tiny synthetic Gemma-3 file: eos is <eos>, the turn ends with <end_of_turn>.
    import edgekv
    from edgekv.synth import write_synthetic

    path = write_synthetic(tmp_path / "g.gguf", arch="gemma3", size="tiny", qtype="q8_0", progress=False)
    llm = edgekv.load(path, n_ctx=64)
    end = llm.tokenizer.encode("<end_of_turn>", add_bos=False)
    assert len(end) == 1 and end[0] != llm.tokenizer.eos_id and end[0] in llm.tokenizer.eot_ids
    events = list(llm.generate("Hello", max_tokens=8, temperature=0, logit_bias={end[0]: 1e4}))
    assert [e.text for e in events] == [""] and events[-1].finish_reason == "stop"
