"""`edgekv chat`'s commands and options in process (the Chat that reads each line, on the
real SmolLM2, greedy), and its colours through a pseudo-terminal."""
import builtins
import fcntl
import os
import struct
import sys
import termios

import pytest

from conftest import get_llm, model_path
from edgekv.cli import Chat, Style, main

STORY = "Tell me a long story about the sea."


def _chat(capsys, **kw):
    llm = get_llm("smollm2", n_ctx=512)
    chat = Chat(llm, llm.session(**{"temperature": 0, "max_tokens": 8, **kw}))
    capsys.readouterr()
    return chat


def _say(chat, line, capsys) -> str:
    assert chat.step(line)
    return capsys.readouterr().out


def test_a_reply_cut_at_n_is_marked(capsys):
    chat = _chat(capsys, max_tokens=5)
    out = _say(chat, STORY, capsys)
    assert out.endswith(" […]\n(cut at -n 5 tokens)\n"), out
    assert chat.sess.stats.generated_tokens == 5


def test_a_reply_that_ends_by_itself_is_not_marked(capsys):
    chat = _chat(capsys)
    chat.stop = (" ",)  # chat --stop: the first space ends the reply, well before -n
    out = _say(chat, STORY, capsys)
    assert "[…]" not in out and "cut at" not in out and chat.sess.stats.generated_tokens < 8, out


def test_system_shows_sets_and_clears(capsys):
    chat = _chat(capsys, system="You are terse.")
    _say(chat, STORY, capsys)
    assert _say(chat, "/system", capsys) == "(system prompt: You are terse.)\n"
    assert len(chat.sess.history) == 2  # showing it kept the conversation
    assert "system prompt set" in _say(chat, "/system Speak like a pirate.", capsys)
    assert chat.sess.system == "Speak like a pirate." and chat.sess.history == []
    assert _say(chat, "/system", capsys) == "(system prompt: Speak like a pirate.)\n"
    assert "removed" in _say(chat, "/system --clear", capsys)
    assert chat.sess.system is None
    assert "no system prompt" in _say(chat, "/system", capsys)
    assert "/system --clear" in _say(chat, "/help", capsys)


def test_undo_drops_the_last_exchange_and_rolls_the_cache_back(capsys):
    chat = _chat(capsys)
    assert "nothing to undo" in _say(chat, "/undo", capsys)
    first = _say(chat, "What is the capital of France?", capsys)
    after_first = list(chat.sess.seq.tokens)
    second = _say(chat, "And of Italy?", capsys)
    after_second = list(chat.sess.seq.tokens)
    assert "2 messages left" in _say(chat, "/undo", capsys)
    assert chat.sess.history[0]["content"] == "What is the capital of France?" and len(chat.sess.history) == 2
    kept = chat.sess.seq.tokens
    # rolled back to the first exchange (and the turn's end tokens fed after it), not emptied
    assert len(after_first) - 4 < len(kept) < len(after_first) + 4 and kept == after_second[: len(kept)]
    assert _say(chat, "And of Italy?", capsys) == second  # the same reply from the rolled-back cache
    st = chat.sess.stats
    assert st.prefill_tokens < st.prompt_tokens - len(kept) // 2  # the kept prefix was reused
    _say(chat, "/undo", capsys)
    _say(chat, "/undo", capsys)
    assert chat.sess.history == [] and chat.sess.n_cached == 0
    assert _say(chat, "What is the capital of France?", capsys) == first


def test_regen_answers_the_last_message_again(capsys):
    chat = _chat(capsys, temperature=0.9, seed=1)
    assert "nothing to regenerate" in _say(chat, "/regen", capsys)
    _say(chat, STORY, capsys)
    before = [dict(m) for m in chat.sess.history]
    again = _say(chat, "/regen", capsys)
    assert len(chat.sess.history) == 2 and chat.sess.history[0] == before[0]
    assert chat.sess.history[1]["content"] != before[1]["content"]  # sampled anew (the seed's stream moved on)
    assert again.startswith(chat.sess.history[1]["content"][:10])


def test_chat_options_and_prompt_file(tmp_path, monkeypatch, capsys):
    """`edgekv chat -f FILE` sends the file as the first message; the sampling options and
    --stop reach the session like run's."""
    from edgekv.llm import LLM

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Name three colours.")
    made = []
    real = LLM.session
    monkeypatch.setattr(LLM, "session", lambda self, **kw: made.append(real(self, **kw)) or made[-1])
    lines = iter(["/system", "/exit"])
    monkeypatch.setattr(builtins, "input", lambda prompt="": next(lines))
    assert main(["chat", str(model_path("smollm2")), "--ctx", "256", "-n", "16", "--temp", "0.5", "--top-k", "7",
                 "--top-p", "0.8", "--min-p", "0.1", "--repeat-penalty", "1.2", "--seed", "11", "--stop", "\n",
                 "--system", "Be brief.", "-f", str(prompt)]) == 0
    out = capsys.readouterr().out
    assert f"> (the text of {prompt}, 19 characters)" in out and "(system prompt: Be brief.)" in out
    sess = made[0]
    p = sess.params
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.repeat_penalty, p.seed) == (0.5, 7, 0.8, 0.1, 1.2, 11)
    assert sess.history[0] == {"role": "user", "content": "Name three colours."}
    assert "\n" not in sess.history[1]["content"]  # --stop "\n" ended the reply at its first line


def test_run_reads_a_prompt_file_and_takes_a_system_prompt(tmp_path, capsys):
    import json

    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The capital of France is")
    m = str(model_path("smollm2"))
    runs = {}
    for name, args in (("file", ["-f", str(prompt)]), ("system", ["-f", str(prompt), "--system", "You are terse."])):
        assert main(["run", m, *args, "-n", "2", "--json", "-q", "--ctx", "256"]) == 0
        runs[name] = json.loads(capsys.readouterr().out)
    n_text = len(get_llm("smollm2", n_ctx=512).tokenize("The capital of France is"))
    assert runs["file"]["prompt_tokens"] == n_text
    assert runs["system"]["prompt_tokens"] > n_text + 5  # the chat template and the system turn


def test_style_is_plain_off_a_terminal_and_with_no_color(monkeypatch):
    assert Style.for_stdout().user == ""  # pytest's stdout is not a terminal
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True, raising=False)
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    assert Style.for_stdout().user
    monkeypatch.setenv("NO_COLOR", "1")
    assert Style.for_stdout().user == ""


@pytest.mark.parametrize("no_color", [False, True])
def test_typed_text_is_coloured_on_a_terminal(no_color):
    from test_cli import Terminal

    env = dict(os.environ, TERM="xterm", PYTHONUNBUFFERED="1")
    env.pop("NO_COLOR", None)
    if no_color:
        env["NO_COLOR"] = "1"
    t = Terminal([sys.executable, "-m", "edgekv.cli", "chat", str(model_path("smollm2")), "--ctx", "64"], env)
    fcntl.ioctl(t.fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    t.read_until("/help for commands")
    t.read_until("> ")
    t.send("/system\r")
    t.read_until("(no system prompt")
    t.read_until("> ")
    t.send("\x04")
    assert t.wait() == 0
    coloured = "\x1b[1;32m> " in t.screen and "\x1b[0m" in t.screen
    assert coloured != no_color, repr(t.screen[-500:])


def test_summarize_folds_the_oldest_turns_before_the_context_is_outgrown(capsys, tmp_path):
    """A chat of n_ctx 512 that would outgrow it: the oldest turns become a summary (the model's
    greedy answer to the summary request, checked against that request made directly), the ring
    never wraps, /history shows the summary, and the next turn's cache holds the conversation with
    the summary in its system prompt (the cache rebuilt from the summary)."""
    from edgekv.sampling import Sampler, SamplingParams
    from edgekv.generate import Sequence, generate
    from edgekv.session import SUMMARY_ASK, SUMMARY_SYSTEM

    llm = get_llm("smollm2", n_ctx=512)
    chat = _chat(capsys, max_tokens=48, summarize=True)
    sess = chat.sess
    # turns until the first fold (how many depends on the greedy replies' lengths, which the
    # machine's prefill path moves: float or int8 activations)
    words = ["apples", "rivers", "engines", "castles", "violins", "deserts", "comets", "glaciers", "forests",
             "islands", "bridges", "lanterns", "harbors", "meadows", "canyons", "volcanoes"]
    seen = []
    for w in words:
        before = [dict(m) for m in sess.history]
        _say(chat, f"Write two sentences about {w}.", capsys)
        assert all(lk.n_written <= lk.capacity for lk in sess.seq.cache.layers)  # nothing dropped by the ring
        if sess.summary and not seen:
            seen, first_summary = before, sess.summary  # the turns as they were before the first fold
            break
    assert sess.folded >= 1 and sess.summary
    # the first summary is what the model answers to the request over the folded turns
    turns = (len(seen) + 1 - 1) // 2
    k = max(1, turns // 2)
    lines = [f"{m['role'].capitalize()}: {m['content']}" for m in seen[: 2 * k]]
    ask = [{"role": "system", "content": SUMMARY_SYSTEM}, {"role": "user", "content": SUMMARY_ASK + "\n\n" + "\n".join(lines)}]
    ids = llm.chat_ids(llm.template.render(ask, add_generation_prompt=True))
    first = "".join(e.text for e in generate(llm, Sequence(llm), ids, Sampler(SamplingParams(temperature=0.0),
                                                                                 llm.cfg.n_vocab), max_tokens=128)).strip()
    out = _say(chat, "/history", capsys)
    assert out.startswith(f"[summary of {sess.folded} earlier turn") and sess.summary in out
    assert f"user: Write two sentences about {w}." in out  # the last turn, not folded
    assert first_summary == first
    # the next turn runs on a cache rebuilt from the summary: it holds the summarized conversation
    folded, msgs = sess.folded, sess.messages() + [{"role": "user", "content": "And one about moons."}]
    want = llm.chat_ids(llm.template.render(msgs, add_generation_prompt=True))
    _say(chat, "And one about moons.", capsys)
    assert sess.folded == folded and sess.seq.tokens[: len(want)] == want
    sess.save(tmp_path / "s.session")  # a saved session keeps its summary
    back = type(sess).load(tmp_path / "s.session", llm)
    assert (back.summary, back.folded, back.summarize, back.messages()) == (sess.summary, folded, True, sess.messages())
