"""Chat templates: turn [{"role", "content"}, ...] into the prompt text a model was tuned on.

A GGUF carries its template as Jinja source (`tokenizer.chat_template`). That text comes from
the model file, so it is untrusted: it renders in jinja2's ImmutableSandboxedEnvironment (no
underscore attributes, no mutation of lists or dicts), under a wall-clock limit and an output
size limit, and the operations that can allocate a huge value in one step (`*`, `**`, `+`, `%`,
`~`, str.replace/join/format and the filters that widen text) are checked before they run.
Environment and inputs follow Hugging Face transformers' apply_chat_template (trim_blocks,
lstrip_blocks, loopcontrols, `{% generation %}`, raise_exception, strftime_now, tojson as
json.dumps, namespace() refusing underscore names; the template sees messages with None-valued
keys dropped and `reasoning`/`thinking` copied to `reasoning_content`, tools, documents,
add_generation_prompt, bos_token, eos_token and any extra variables such as enable_thinking or
date_string), so templates written for transformers render the same here. One deliberate
difference: no `lipsum` global (a text generator no chat template uses).

Without a template, the format is chosen from the vocabulary:
  gemma   (vocab has <start_of_turn> and <end_of_turn>): Gemma 3's official template, exactly:
          bos_token, then per turn "<start_of_turn>{role}\\n{content.strip()}<end_of_turn>\\n"
          with role "assistant" written "model"; a leading system message is not a turn, its
          content + "\\n\\n" opens the first user turn; after the system message roles must
          alternate user/assistant; generation prompt "<start_of_turn>model\\n".
  chatml  (vocab has <|im_start|>): "<|im_start|>{role}\\n{content}<|im_end|>\\n" per message,
          generation prompt "<|im_start|>assistant\\n".
  plain   (anything else): "{Role}: {content}\\n" per message (role capitalized, e.g.
          "System: ...\\nUser: ...\\n"), generation prompt "Assistant:".
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import datetime
from functools import wraps

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace, _PassArg

from edgekv.errors import TemplateError

__all__ = ["ChatTemplate"]

_MAX_SOURCE_CHARS = 1_000_000  # real templates are under ~30 KB
_MAX_INT_BITS = 1 << 16  # integers beyond ~20k digits have no place in a prompt
_TEMPLATE_FILE = "<template>"  # the filename jinja compiles from_string() code under


# --- size estimates ---------------------------------------------------------------------------


def _text_size(value, limit: int) -> int:
    """Upper estimate of len(str(value)); stops counting once past `limit`.

    Containers matter: a list can hold one large string many times over, so str() or tojson of
    it may need far more memory than anything it holds. Every visit adds at least 1, so the walk
    takes at most `limit` steps even on self-referencing namespaces.
    """
    total = 0
    stack = [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str):
            total += len(v) + 2  # + quotes when inside a container's repr
        elif isinstance(v, bool) or v is None:
            total += 5
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2  # decimal digits <= bits/3.32, plus sign
        elif isinstance(v, Mapping):
            total += 2
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, (list, tuple, set, frozenset)):
            total += 2
            stack.extend(v)
        elif isinstance(v, Namespace):
            total += 16
            stack.append(v._Namespace__attrs)
        else:
            total += 24  # numbers, ranges, loop objects, macros: short reprs
    return total


def _format_size(fmt: str, args: Sequence, kwargs: Mapping, limit: int) -> int:
    """Upper estimate of the length of `fmt` formatted (str.format or %): every field may repeat
    the largest argument, and widths written in the format string add their value."""
    widths = re.findall(r"\d+", fmt)
    if any(len(w) > 7 for w in widths):
        return limit + 1
    fields = fmt.count("{") + fmt.count("%")
    biggest = max((_text_size(a, limit) for a in (*args, *kwargs.values())), default=0)
    return len(fmt) + sum(int(w) for w in widths) + fields * biggest


# --- the sandbox ------------------------------------------------------------------------------


class _CheckedConcat(CodeGenerator):
    """Compiles `a ~ b` into a size-checked join instead of jinja's unchecked str_join."""

    def visit_Concat(self, node: nodes.Concat, frame) -> None:
        self.write("environment.checked_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _GenerationBlock(Extension):
    """transformers' `{% generation %}...{% endgeneration %}` marks assistant text for training
    masks; for rendering it is transparent."""

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


class _LimitedSandbox(ImmutableSandboxedEnvironment):
    """The immutable sandbox plus a deadline and per-operation size checks.

    The deadline is checked on every sandboxed call and filter, and (through a trace function
    installed by `render`) on every line the template executes, so loops without output or
    calls stop too. Sizes are checked before an operation allocates, since a single C-level
    str.replace or list repetition cannot be interrupted once started.
    """

    code_generator_class = _CheckedConcat
    intercepted_binops = frozenset({"*", "**", "+", "%"})

    def __init__(self, max_chars: int, clock: Callable[[], datetime]) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=[loopcontrols, _GenerationBlock],
            finalize=self._finalize,
        )
        self.max_chars = max_chars
        self._state = threading.local()  # .deadline per rendering thread
        self.globals.pop("lipsum", None)  # a text generator; no chat template uses it
        self.globals["raise_exception"] = _raise_exception
        self.globals["strftime_now"] = lambda fmt: clock().strftime(fmt)
        self.globals["namespace"] = _TemplateNamespace
        self.globals["dict"] = _TemplateDict()
        self.filters["tojson"] = _tojson
        self.filters = {name: self._guard_filter(name, f) for name, f in self.filters.items()}

    # Deadline

    def start(self, seconds: float) -> None:
        self._state.deadline = time.perf_counter() + seconds
        self._state.seconds = seconds

    def stop(self) -> None:
        self._state.deadline = None

    def tick(self) -> None:
        deadline = getattr(self._state, "deadline", None)
        if deadline is not None and time.perf_counter() > deadline:
            self._state.deadline = None  # raise once; cleanup code must not trip it again
            raise TemplateError(f"chat template exceeded its time limit ({self._state.seconds:g} s)")

    # Size checks

    def _too_big(self, what: str) -> TemplateError:
        return TemplateError(f"chat template builds {what} longer than {self.max_chars} characters")

    def _check_args(self, args: Sequence, kwargs: Mapping) -> None:
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool):
                if abs(a) > self.max_chars:
                    raise TemplateError(f"chat template passes an integer beyond {self.max_chars} to a function")
            elif _text_size(a, self.max_chars) > self.max_chars:
                raise self._too_big("an argument")

    def _check_result(self, value) -> None:
        if isinstance(value, (str, list, tuple)) and len(value) > self.max_chars:
            raise self._too_big("a value")

    def _check_widening(self, name: str, value, args: Sequence, kwargs: Mapping, method: bool) -> None:
        """Operations whose output can be a product of their input sizes: str methods (`value`
        is the string the method is bound to) and the filters of the same names (`value` is
        the filtered value, `args` the rest)."""
        lim = self.max_chars

        def arg(i, key, default):
            return args[i] if len(args) > i else kwargs.get(key, default)

        if name == "replace" and isinstance(value, str):
            old, new = str(arg(0, "old", "")), str(arg(1, "new", ""))
            count = value.count(old) if old else len(value) + 1
            if len(value) + count * max(0, len(new) - len(old)) > lim:
                raise self._too_big("a string")
        elif name == "join":
            # The filter is value|join(sep); the str method is sep.join(items).
            sep, items = (value, arg(0, "iterable", ())) if method else (arg(0, "d", ""), value)
            if isinstance(sep, str) and isinstance(items, (str, list, tuple)):
                if len(sep) * len(items) > lim:
                    raise self._too_big("a string")
        elif name == "indent" and isinstance(value, str):
            width = arg(0, "width", 4)
            w = len(width) if isinstance(width, str) else int(width)
            if len(value) + w * (value.count("\n") + 1) > lim:
                raise self._too_big("a string")
        elif name == "wordwrap" and isinstance(value, str):
            wrap = arg(2, "wrapstring", None)
            if isinstance(wrap, str) and len(value) + len(wrap) * len(value) > lim:
                raise self._too_big("a string")
        elif name in ("format", "format_map") and isinstance(value, str):
            if _format_size(value, args, kwargs, lim) > lim:
                raise self._too_big("a string")

    def _guard_filter(self, name: str, func):
        # Filters are called directly by compiled code, not through `call`, so wrap each one.
        # functools.wraps keeps jinja's pass_context/pass_environment marker.
        skip = 1 if _PassArg.from_obj(func) is not None else 0

        @wraps(func)
        def guarded(*args, **kwargs):
            self.tick()
            value, rest = args[skip], args[skip + 1:]
            self._check_args(args[skip:], kwargs)
            if name == "join" and not isinstance(value, (str, list, tuple)):
                value = list(value)  # so its length is known before joining
                args = (*args[:skip], value, *rest)
            self._check_widening(name, value, rest, kwargs, method=False)
            result = func(*args, **kwargs)
            self._check_result(result)
            return result

        return guarded

    # Hooks jinja's sandbox calls

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        __self.tick()
        __self._check_args(args, kwargs)
        # The sandbox hands out str.format wrapped (functools.update_wrapper); look through it.
        target = getattr(__obj, "__wrapped__", __obj)
        owner, name = getattr(target, "__self__", None), getattr(target, "__name__", "")
        if isinstance(owner, str):
            if name == "join" and args and not isinstance(args[0], (str, list, tuple)):
                args = (list(args[0]), *args[1:])  # so its length is known before joining
            __self._check_widening(name, owner, args, kwargs, method=True)
        result = super().call(__context, __obj, *args, **kwargs)
        __self._check_result(result)
        return result

    def call_binop(self, context, operator: str, left, right):
        lim = self.max_chars
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and n > 0:
                    if _text_size(seq, lim) * n > lim:
                        raise self._too_big("a repeated value")
            if isinstance(left, int) and isinstance(right, int):
                if left.bit_length() + right.bit_length() > _MAX_INT_BITS:
                    raise TemplateError("chat template computes an integer that is too large")
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
                if right * left.bit_length() > _MAX_INT_BITS:
                    raise TemplateError("chat template computes an integer that is too large")
        elif operator == "+":
            if isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
                if _text_size(left, lim) + _text_size(right, lim) > lim:
                    raise self._too_big("a value")
        elif operator == "%" and isinstance(left, str):
            args = right if isinstance(right, tuple) else (right,)
            if _format_size(left, args, {}, lim) > lim:
                raise self._too_big("a string")
        return super().call_binop(context, operator, left, right)

    def checked_concat(self, values: tuple) -> str:
        if sum(_text_size(v, self.max_chars) for v in values) > self.max_chars:
            raise self._too_big("a string")
        return "".join(map(str, values))

    def _finalize(self, value):
        # Runs on every {{ expression }} before str(): catches a container that is small in
        # memory but whose text (shared references repeated) is not.
        if not isinstance(value, str) and _text_size(value, self.max_chars) > self.max_chars:
            raise self._too_big("an output value")
        return value


def _raise_exception(message) -> None:
    raise TemplateError(f"chat template raised an error: {message}")


class _TemplateNamespace(Namespace):
    """namespace() as transformers has it: no underscore-prefixed names stored on it."""

    def __init__(*args, **kwargs):  # jinja's signature, so that namespace(self=...) works
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat templates cannot store underscore-prefixed names on a namespace ({name!r})")


class _TemplateDict:
    """dict() and dict.fromkeys() as transformers exposes them: calls that build dicts, not the type."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # transformers' tojson: plain json.dumps, unlike jinja's HTML-escaping built-in.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


# --- fallback formats -------------------------------------------------------------------------


def _render_gemma(messages: list[dict], add_generation_prompt: bool, bos_token: str) -> str:
    # Gemma 3's official template, step for step (including its role check and its trim()).
    if messages[0]["role"] == "system":
        first_user_prefix = messages[0]["content"] + "\n\n"
        turns = messages[1:]
    else:
        first_user_prefix = ""
        turns = messages
    out = [bos_token]
    for i, m in enumerate(turns):
        if (m["role"] == "user") != (i % 2 == 0):
            raise TemplateError(
                "chat template raised an error: Conversation roles must alternate "
                "user/assistant/user/assistant/..."
            )
        role = "model" if m["role"] == "assistant" else m["role"]
        prefix = first_user_prefix if i == 0 else ""
        out.append(f"<start_of_turn>{role}\n{prefix}{m['content'].strip()}<end_of_turn>\n")
    if add_generation_prompt:
        out.append("<start_of_turn>model\n")
    return "".join(out)


def _render_chatml(messages: list[dict], add_generation_prompt: bool) -> str:
    out = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
    if add_generation_prompt:
        out.append("<|im_start|>assistant\n")
    return "".join(out)


def _render_plain(messages: list[dict], add_generation_prompt: bool) -> str:
    out = [f"{m['role'].capitalize()}: {m['content']}\n" for m in messages]
    if add_generation_prompt:
        out.append("Assistant:")
    return "".join(out)


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names, first is standard


def _plain(value, where: str):
    """A copy of `value` built only from JSON types (tuples become lists, str/int/float subclasses
    such as enums their base type): whatever else a caller passes could carry methods the sandbox
    does not know to be unsafe."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base, to_base in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):  # bool cannot be subclassed, so only int's own subclasses land here
            return to_base(value)
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise TemplateError(f"chat template input {where} has a key that is not a string")
        return {k: _plain(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise TemplateError(f"chat template input {where} has type {type(value).__name__}; pass str, numbers, "
                        "bool, None, lists and dicts")


def _validated(messages) -> list[dict]:
    """Plain copies of the messages as transformers' apply_chat_template hands them to a template:
    keys whose value is None dropped, a message's reasoning copied under `reasoning_content` and
    `thinking`. Content is a string, a list of parts or a dict, or absent beside tool_calls."""
    shape = "messages must be a non-empty list of {'role': str, 'content': str} dicts"
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TemplateError(shape)
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TemplateError(f"{shape}; messages[{i}] is a {type(m).__name__}")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise TemplateError(f"{shape}; messages[{i}]['role'] is {m.get('role')!r}")
        content = m.get("content")
        if not isinstance(content, (str, list, tuple, Mapping)) and not (content is None and m.get("tool_calls")):
            raise TemplateError(f"{shape}; messages[{i}]['content'] is a {type(content).__name__}")
        msg = {k: v for k, v in _plain(m, f"messages[{i}]").items() if v is not None}
        reasoning = next((msg[k] for k in _REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        out.append(msg)
    return out


def _text_only(messages: list[dict], kind: str) -> list[dict]:
    for i, m in enumerate(messages):
        if not isinstance(m.get("content"), str):
            raise TemplateError(f"the built-in {kind} format needs string contents; messages[{i}] has none")
    return messages


# --- public -----------------------------------------------------------------------------------


class ChatTemplate:
    """Renders chat messages to prompt text, from a GGUF's Jinja template or a built-in format.

    kind: "gguf" (the model's own template), or the fallback "gemma", "chatml" or "plain"
    (see the module docstring). Rendering a "gguf" template stops with TemplateError after
    `time_limit_s` seconds or `max_output_chars` characters of output. `clock` is what the
    template's strftime_now reads (Llama 3.2 and Granite print today's date); fix it for
    reproducible prompts.
    """

    def __init__(
        self,
        source: str | None,
        *,
        bos_token: str = "",
        eos_token: str = "",
        vocab_tokens: Collection[str] = (),
        time_limit_s: float = 1.0,
        max_output_chars: int = 1_000_000,
        clock: Callable[[], datetime] = datetime.now,
    ) -> None:
        if source is not None and not isinstance(source, str):
            raise TemplateError(f"chat template must be a string, not {type(source).__name__}")
        if not time_limit_s > 0 or not max_output_chars > 0:
            raise ValueError("time_limit_s and max_output_chars must be positive")
        self.source = source if source and source.strip() else None
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.time_limit_s = float(time_limit_s)
        self.max_output_chars = int(max_output_chars)
        self.clock = clock
        if self.source is not None:
            self.kind = "gguf"
            self._compile()
        elif "<start_of_turn>" in vocab_tokens and "<end_of_turn>" in vocab_tokens:
            self.kind = "gemma"
        elif "<|im_start|>" in vocab_tokens:
            self.kind = "chatml"
        else:
            self.kind = "plain"

    def _compile(self) -> None:
        if len(self.source) > _MAX_SOURCE_CHARS:
            raise TemplateError(f"chat template is longer than {_MAX_SOURCE_CHARS} characters")
        self._env = _LimitedSandbox(self.max_output_chars, self.clock)
        # Compiling runs constant folding (filters on literals), so it gets the deadline too.
        self._env.start(self.time_limit_s)
        try:
            self._template = self._env.from_string(self.source)
        except TemplateError:
            raise
        except TemplateSyntaxError as e:
            raise TemplateError(f"chat template does not parse: {e.message} (line {e.lineno})") from None
        except Exception as e:  # RecursionError on absurd nesting, and the like
            raise TemplateError(f"chat template does not compile: {type(e).__name__}: {e}") from None
        finally:
            self._env.stop()

    @classmethod
    def from_metadata(
        cls, meta: Mapping, token_texts: Sequence[str], bos_id, eos_id, **options
    ) -> ChatTemplate:
        """From GGUF metadata (key -> python value) and the vocabulary's token texts; `options` are
        the constructor's keywords (time_limit_s, max_output_chars, clock)."""

        def text(i) -> str:
            return token_texts[int(i)] if i is not None and 0 <= int(i) < len(token_texts) else ""

        return cls(
            meta.get("tokenizer.chat_template"),
            bos_token=text(bos_id),
            eos_token=text(eos_id),
            vocab_tokens=token_texts,
            **options,
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = True, *, tools: list | None = None,
               documents: list | None = None, **variables) -> str:
        """The prompt text for `messages`. tools, documents and `variables` (e.g. enable_thinking=False
        for Qwen3, date_string="05 Dec 2026" for Llama 3.x) reach a "gguf" template as transformers'
        apply_chat_template passes them; variables may also replace bos_token / eos_token. The
        built-in formats have no use for them and ignore them, as a template that never reads them does."""
        msgs = _validated(messages)
        if self.kind == "gemma":
            return _render_gemma(_text_only(msgs, self.kind), add_generation_prompt, self.bos_token)
        if self.kind == "chatml":
            return _render_chatml(_text_only(msgs, self.kind), add_generation_prompt)
        if self.kind == "plain":
            return _render_plain(_text_only(msgs, self.kind), add_generation_prompt)
        context = {
            "messages": msgs,
            "tools": _plain(tools, "tools"),
            "documents": _plain(documents, "documents"),
            "add_generation_prompt": bool(add_generation_prompt),
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **{name: _plain(v, name) for name, v in variables.items()},
        }
        return self._render_sandboxed(context)

    def _render_sandboxed(self, context: dict) -> str:
        env, limit = self._env, self.max_output_chars

        # A loop with neither output nor calls (`{% for a in r %}{% for b in r %}...`) never
        # returns to us or to a sandbox hook; a line-trace on the template's own frames does
        # reach it. Other frames get only their call event checked, which is cheap.
        def trace_line(frame, event, arg):
            env.tick()
            return trace_line

        def trace_call(frame, event, arg):
            env.tick()
            return trace_line if frame.f_code.co_filename == _TEMPLATE_FILE else None

        pieces, size = [], 0
        previous_trace = sys.gettrace()
        env.start(self.time_limit_s)
        chunks = self._template.generate(context)
        sys.settrace(trace_call)
        try:
            for piece in chunks:
                size += len(piece)
                if size > limit:
                    raise TemplateError(f"chat template output exceeds {limit} characters")
                env.tick()
                pieces.append(piece)
        except TemplateError:
            raise
        except SecurityError as e:
            raise TemplateError(f"chat template attempted an unsafe operation: {e}") from None
        except Exception as e:
            raise TemplateError(f"chat template failed: {type(e).__name__}: {e}") from None
        finally:
            env.stop()
            sys.settrace(previous_trace)
            chunks.close()
        return "".join(pieces)

    def __repr__(self) -> str:
        return f"ChatTemplate(kind={self.kind!r})"
