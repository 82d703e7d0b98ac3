"""edgekv.chat_template: real templates against llama.cpp's renderings, the fallback formats,
and hostile templates (each must fail with TemplateError, quickly)."""

import json
import sys
import time
from functools import lru_cache
from pathlib import Path

import jinja2
import pytest

from edgekv.chat_template import ChatTemplate
from edgekv.errors import TemplateError
from edgekv.hub import KNOWN_MODELS, models_dir

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "chat_templates.json").read_text(encoding="utf-8"))


def real_model(name: str) -> Path:
    from conftest import pulled

    path = pulled(name)  # pulled on first use, like `edgekv pull NAME`
    assert path == models_dir() / KNOWN_MODELS[name].filename
    return path


@lru_cache(maxsize=None)
def smollm2_template() -> ChatTemplate:
    # gguf's own reader, independent of edgekv's GGUF parser.
    import gguf

    r = gguf.GGUFReader(real_model("smollm2-135m-instruct"))
    meta = {"tokenizer.chat_template": r.fields["tokenizer.chat_template"].contents()}
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    bos = r.fields["tokenizer.ggml.bos_token_id"].contents()
    eos = r.fields["tokenizer.ggml.eos_token_id"].contents()
    return ChatTemplate.from_metadata(meta, tokens, bos, eos)


@lru_cache(maxsize=None)
def gemma3_template() -> ChatTemplate:
    # edgekv's parser: gguf.GGUFReader takes ~10 s on this 262k-token vocabulary.
    from edgekv.gguf_file import read_metadata

    meta = read_metadata(real_model("gemma3-270m"))
    assert ("tokenizer.chat_template" in meta) == FIXTURE["gemma3"]["gguf_has_chat_template"]
    return ChatTemplate.from_metadata(
        meta, meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.bos_token_id"], meta["tokenizer.ggml.eos_token_id"]
    )


# --- real templates vs llama.cpp ---------------------------------------------------------------


@pytest.mark.parametrize("case", FIXTURE["smollm2"]["cases"], ids=lambda c: c["name"])
def test_smollm2_template_matches_llama_cpp(case):
    ct = smollm2_template()
    assert ct.kind == "gguf"
    assert ct.bos_token == FIXTURE["smollm2"]["bos_token"] and ct.eos_token == FIXTURE["smollm2"]["eos_token"]
    out = ct.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert out == case["llama_cpp_jinja"]
    if case["messages"][0]["role"] == "system":
        # llama.cpp's C ChatML formatter knows nothing of the template's default system
        # message, so it is a reference only when the conversation brings its own.
        assert out == case["llama_cpp_c"]


@pytest.mark.parametrize("case", FIXTURE["gemma3"]["cases"], ids=lambda c: c["name"])
def test_gemma3_fallback_matches_official_template(case):
    ct = gemma3_template()
    assert ct.kind == "gemma"
    bos = FIXTURE["gemma3"]["bos_token"]
    assert ct.bos_token == bos
    if case["official_error"] is not None:
        with pytest.raises(TemplateError, match=case["official_error"].replace(".", r"\.")):
            ct.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        return
    out = ct.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
    assert out == case["official"]
    if case["c_comparable"]:
        assert out == bos + case["llama_cpp_c"]  # llama.cpp leaves BOS to the tokenizer


def test_chatml_fallback_matches_llama_cpp():
    ct = ChatTemplate(None, vocab_tokens=["<unk>", "<|im_start|>", "<|im_end|>"])
    assert ct.kind == "chatml"
    for case in FIXTURE["smollm2"]["cases"]:
        out = ct.render(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert out == case["llama_cpp_c"], case["name"]


def test_plain_fallback_is_the_documented_format():
    ct = ChatTemplate("  \n", vocab_tokens=["<s>", "</s>"])  # blank template -> fallback
    assert ct.kind == "plain"
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    assert ct.render(msgs) == "System: Be brief.\nUser: Hi\nAssistant: Hello\nUser: Bye\nAssistant:"
    assert ct.render(msgs[:2], add_generation_prompt=False) == "System: Be brief.\nUser: Hi\n"


# --- transformers-compatible environment -------------------------------------------------------


def test_block_whitespace_matches_transformers_settings():
    # The same benign template through plain jinja2 with transformers' settings is the oracle.
    src = (
        "{% for m in messages %}\n"
        "    {% if m.role == 'user' %}\n"
        "U: {{ m.content }}\n"
        "    {% else %}\n"
        "A: {{ m.content }}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}A:{% endif %}\n"
    )
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    oracle = jinja2.Environment(trim_blocks=True, lstrip_blocks=True).from_string(src)
    assert ChatTemplate(src).render(msgs) == oracle.render(messages=msgs, add_generation_prompt=True)


def test_helpers_templates_use():
    msgs = [{"role": "user", "content": "<b>é</b>", "name": "x"}]
    src = (
        "{{ bos_token }}{% for m in messages %}{% if loop.first %}{{ m|tojson }}{% continue %}{% endif %}"
        "{% endfor %}{% generation %}|{{ strftime_now('%Y') }}|{% endgeneration %}{{ eos_token }}"
    )
    out = ChatTemplate(src, bos_token="<s>", eos_token="</s>").render(msgs)
    year = time.strftime("%Y")
    assert out == "<s>" + json.dumps(msgs[0], ensure_ascii=False) + f"|{year}|</s>"


def test_raise_exception_carries_the_templates_message():
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match="bad"):
        ChatTemplate("{{ raise_exception('bad') }}").render([{"role": "user", "content": "x"}])
    assert time.perf_counter() - t0 < 2


def test_large_legitimate_content_renders():
    content = "word " * 40_000  # 200k characters, a fifth of the output limit
    out = smollm2_template().render([{"role": "system", "content": "s"}, {"role": "user", "content": content}])
    assert content in out


def test_messages_are_validated():
    ct = ChatTemplate(None)
    for bad in ([], "hi", [{"role": "user"}], [{"role": "", "content": "x"}],
                [{"role": "user", "content": 3}], ["user: hi"], None):
        with pytest.raises(TemplateError, match="messages must be a non-empty list"):
            ct.render(bad)


def test_bad_template_source():
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate("{% for %}")
    with pytest.raises(TemplateError, match="must be a string"):
        ChatTemplate(b"{{ 1 }}")


# --- hostile templates -------------------------------------------------------------------------

HOSTILE = {
    "mro": ("{{ ''.__class__.__mro__ }}", "unsafe"),
    "subclasses": ("{{ ().__class__.__base__.__subclasses__() }}", "unsafe"),
    "ssti_via_cycler": ("{{ cycler.__init__.__globals__.os.popen('id').read() }}", "unsafe"),
    "mutate_a_list": ("{% set l = [1] %}{{ l.append(2) }}", "unsafe"),
    "range_1e9": ("{% for i in range(10**9) %}x{% endfor %}", "integer beyond"),
    "range_just_over_cap": ("{% for i in range(100001) %}{% endfor %}", "Range too big"),
    "nested_loops_output": (
        # 1,000-character pieces: the 1M-character cap comes after ~1,000 iterations, far inside
        # the time limit even on a loaded machine (10-character pieces took > 1 s there)
        "{% for i in range(100000) %}{% for j in range(100000) %}" + "x" * 1000 + "{% endfor %}{% endfor %}",
        "output exceeds",
    ),
    "nested_loops_silent": (
        "{% set r = range(100000) %}{% for a in r %}{% for b in r %}{% for c in r %}"
        "{% endfor %}{% endfor %}{% endfor %}",
        "time limit",
    ),
    "nested_loops_into_filter_block": (
        "{% filter upper %}{% for i in range(100000) %}{% for j in range(100000) %}x"
        "{% endfor %}{% endfor %}{% endfilter %}",
        "time limit",
    ),
    "string_doubling_concat": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
        "longer than",
    ),
    "string_doubling_plus": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
        "longer than",
    ),
    "string_times_huge": ("{{ 'a' * 10**10 }}", "longer than"),
    "list_times_huge": ("{{ ([1] * 100000) * 100000 }}", "longer than"),
    "power_tower": ("{{ 10 ** (10 ** 10) }}", "integer that is too large"),
    "integer_squaring": (
        "{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
        "integer that is too large",
    ),
    "replace_squared": ("{% set s = 'a' * 100000 %}{{ s|replace('a', s) }}", "longer than"),
    "replace_method": ("{% set s = 'a' * 100000 %}{{ s.replace('a', s) }}", "longer than"),
    "join_filter": ("{% set s = 'a' * 100000 %}{{ range(100000)|join(s) }}", "longer than"),
    "join_method": ("{% set s = 'a' * 100000 %}{{ s.join(['x'] * 100000) }}", "longer than"),
    "indent_wide": ("{% set s = '\n' * 100000 %}{{ s|indent(100000) }}", "longer than"),
    "center_wide": ("{{ 'a'|center(10**10) }}", "integer beyond"),
    "format_width": ("{{ '{:>999999999}'.format(1) }}", "longer than"),
    "format_repeats_arg": ("{% set s = 'a' * 100000 %}{{ '{0}{0}{0}{0}{0}{0}{0}{0}{0}{0}{0}'.format(s) }}", "longer than"),
    "percent_width": ("{{ '%0999999999d' % 1 }}", "longer than"),
    "shared_references_printed": (
        "{% set s = 'a' * 100000 %}{% set l = [s, s, s, s, s, s, s, s, s, s] %}"
        "{% set l = [l, l, l, l, l, l, l, l, l, l] %}{{ l }}",
        "longer than",
    ),
    "shared_references_tojson": (
        "{% set s = 'a' * 100000 %}{% set l = [s, s, s, s, s, s, s, s, s, s] %}{{ l|tojson }}",
        "longer than",
    ),
    "namespace_underscore_kwarg": ("{% set ns = namespace(_Namespace__attrs=1) %}", "underscore"),
    "namespace_underscore_set": ("{% set ns = namespace() %}{% set ns.__class__ = 1 %}", "underscore"),
    "dict_type_escape": ("{{ dict.__class__.__mro__ }}", "unsafe"),
    "recursive_macro": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "RecursionError"),
    "include": ("{% include 'x' %}", "failed"),
    "raise_exception": ("{{ raise_exception('bad') }}", "bad"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_template_fails_quickly(name):
    src, message = HOSTILE[name]
    trace_before = sys.gettrace()
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match=message):
        ChatTemplate(src).render([{"role": "user", "content": "x"}])
    assert time.perf_counter() - t0 < 2
    assert sys.gettrace() is trace_before  # the time-limit tracer is removed again


def test_time_limit_is_configurable():
    src = "{% set r = range(100000) %}{% for a in r %}{% for b in r %}{% endfor %}{% endfor %}"
    t0 = time.perf_counter()
    with pytest.raises(TemplateError, match=r"time limit \(0.2 s\)"):
        ChatTemplate(src, time_limit_s=0.2).render([{"role": "user", "content": "x"}])
    assert time.perf_counter() - t0 < 1


def test_output_limit_is_configurable():
    ct = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}", max_output_chars=10)
    assert ct.render([{"role": "user", "content": "0123456789"}]) == "0123456789"
    with pytest.raises(TemplateError, match="output exceeds 10 characters"):
        ct.render([{"role": "user", "content": "0123456789x"}])
