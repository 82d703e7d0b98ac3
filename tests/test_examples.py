"""examples/: the scripts run on the real 135M model (the OpenAI-client chat against `edgekv
serve` in a child process, its first reply the library's own); the desktop chat's controller is driven
without a display (send, stream, Stop within a token, send again); its Tk window is built
only where a display exists."""
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import get_llm, model_path

EXAMPLES = Path(__file__).parent.parent / "examples"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_quickstart_script_runs(tmp_path):
    r = subprocess.run([sys.executable, str(EXAMPLES / "quickstart.py"), str(model_path("smollm2"))],
                       cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert "Paris" in lines[0]  # the greedy completion of "The capital of France is"
    assert "decode_tokens_per_s" in r.stdout and "kv_bytes_used" in r.stdout
    assert "prefilled" in r.stdout and lines[-1] == "4 messages restored"
    assert (tmp_path / "chat.ekv").exists()


def test_openai_chat_script_talks_to_the_server():
    pytest.importorskip("openai")
    pytest.importorskip("uvicorn")
    from edgekv import LLM
    from conftest import serve_process

    proc, start = serve_process()
    try:
        r = subprocess.run([sys.executable, str(EXAMPLES / "openai_chat.py"), "--base-url", start["url"],
                            "--max-tokens", "8", "--temperature", "0"], input="What is 2+2?\nThanks!\n",
                           capture_output=True, text=True, timeout=300)
    finally:
        proc.terminate()
        proc.wait(60)
    assert r.returncode == 0, r.stderr[-2000:]
    ref = LLM(model_path("smollm2"), n_ctx=256, kv="f16", prompt_cache=False)  # the server's settings
    first = ref.chat([{"role": "user", "content": "What is 2+2?"}], max_tokens=8, temperature=0)
    reply = first["choices"][0]["message"]["content"]
    assert r.stdout.startswith(reply + "\n") and len(r.stdout) > len(reply) + 2, r.stdout  # two replies


def _drain(ctl, timeout=300.0):
    assert ctl.wait(timeout)
    return ctl.poll()


def test_chat_controller_streams_stops_and_continues():
    tk_chat = _module("tk_chat")
    llm = get_llm()
    ctl = tk_chat.ChatController(llm, system="You are brief.", temperature=0, max_tokens=16)
    assert ctl.send("What is 2+2?")
    events = _drain(ctl)
    text = "".join(v for k, v in events if k == "text")
    assert events[-1][0] == "done" and events[-1][1] in ("stop", "length")
    same = llm.session(system="You are brief.", temperature=0, max_tokens=16)
    assert text == same.send("What is 2+2?")  # what the worker streamed is the session's reply

    # Stop pressed while the reply streams: it ends within one token, the chat goes on.
    ctl.session.max_tokens = 400
    assert ctl.send("Write a very long story about a dragon.")
    got, end = [], time.time() + 300
    while not got:
        got = [e for e in ctl.poll() if e[0] == "text"]
        assert time.time() < end
        time.sleep(0.01)
    ctl.stop()
    n_at_stop = ctl.session.stats.generated_tokens
    rest = _drain(ctl)
    assert rest[-1] == ("done", "cancelled")
    assert ctl.session.stats.generated_tokens <= n_at_stop + 1  # at most the token being computed
    assert ctl.session.history[-1]["role"] == "assistant"
    assert ctl.send("Thanks!")
    assert _drain(ctl)[-1][0] == "done" and len(ctl.session.history) == 6


def test_chat_controller_reports_errors_without_raising():
    from edgekv import EdgekvError

    tk_chat = _module("tk_chat")
    ctl = tk_chat.ChatController(get_llm(), max_tokens=4)
    for exc, shown in ((EdgekvError("boom"), "boom"), (ValueError("bug"), "ValueError: bug")):
        def failing(*a, exc=exc, **k):
            raise exc

        ctl.session.send = failing
        assert ctl.send("Hi")
        assert _drain(ctl) == [("error", shown)]
    assert not ctl.send("   ")  # nothing to send


@pytest.mark.skipif(not os.environ.get("DISPLAY"), reason="the Tk window needs a display (no DISPLAY set); "
                    "its controller is tested above")
def test_tk_window_builds_and_streams():
    import tkinter as tk

    tk_chat = _module("tk_chat")
    root = tk.Tk()
    try:
        win = tk_chat.ChatWindow(root, tk_chat.ChatController(get_llm(), temperature=0, max_tokens=8))
        win.entry.insert(0, "Hi")
        win.on_send()
        end = time.time() + 300
        while win.ctl.busy or win.send_button["state"] != "normal":
            root.update()
            assert time.time() < end
        assert "Assistant:" in win.log.get("1.0", "end")
    finally:
        root.destroy()
