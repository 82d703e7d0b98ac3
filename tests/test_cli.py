"""The command line as a person uses it: `edgekv info/run/list`, and `edgekv chat` driven
through a pseudo-terminal (typing, Ctrl-C mid-reply, /save and /load, Ctrl-D)."""
import json
import os
import pty
import re
import select
import signal
import sys
import time

import pytest

from conftest import model_path
from edgekv.cli import main


def test_info_both_models(capsys, model_key):
    assert main(["info", str(model_path(model_key)), "--ctx", "2048"]) == 0
    out = capsys.readouterr().out
    for label in ("architecture", "parameters", "tensor types", "context length", "vocab", "special tokens",
                  "chat template", "KV bytes / token", "KV cache @ 2048"):
        assert label in out
    if model_key == "gemma3":
        assert "sliding window" in out and "save" in out


def test_list_shows_known_models(capsys):
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m-instruct" in out and "gemma3-270m" in out


def test_run_json(capsys):
    assert main(["run", str(model_path("smollm2")), "The capital of France is", "-n", "6", "--json", "-q"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["generated_tokens"] <= 6 and rec["prompt_tokens"] > 0 and isinstance(rec["text"], str)


def test_errors_are_one_line(capsys, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\xff" * 40)
    assert main(["info", str(bad)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("edgekv: error:") and "\n" not in err
    assert main(["info", "no-such-model"]) == 1
    assert "no-such-model" in capsys.readouterr().err


class Terminal:
    """A child process on a pseudo-terminal; read() collects what it prints."""

    def __init__(self, argv, env):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child
            # Ctrl-C as a terminal delivers it: a test run started in the background by a
            # shell without job control inherits SIGINT ignored, and exec keeps that
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.execvpe(argv[0], argv, env)
        self.screen = ""
        self.cursor = 0  # what read_until has consumed

    def read_until(self, text: str, timeout: float = 240.0) -> str:
        """Everything printed from the cursor up to and including `text`."""
        end = time.time() + timeout
        start = self.cursor
        while text not in self.screen[start:]:
            left = end - time.time()
            if left <= 0:
                raise AssertionError(f"timed out waiting for {text!r}; screen:\n{self.screen[-2000:]}")
            r, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if r:
                try:
                    data = os.read(self.fd, 4096)
                except OSError:
                    break
                if not data:
                    break
                self.screen += data.decode("utf-8", "replace")
        self.cursor = self.screen.index(text, start) + len(text)
        return self.screen[start : self.cursor]

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 60.0) -> int:
        end = time.time() + timeout
        while time.time() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:
                os.read(self.fd, 4096)
            except OSError:
                pass
            time.sleep(0.1)
        os.kill(self.pid, 9)
        raise AssertionError("chat did not exit")


def test_chat_in_a_terminal(tmp_path):
    env = dict(os.environ, TERM="dumb", PYTHONUNBUFFERED="1")
    t = Terminal([sys.executable, "-m", "edgekv.cli", "chat", str(model_path("smollm2")), "--temp", "0",
                  "--ctx", "512", "-n", "300"], env)
    t.read_until("/help for commands")
    t.read_until("> ")
    t.send("Hi! What is 2+2?\r")
    t.read_until("2+2?")  # the terminal's echo of what was typed
    reply = t.read_until("> ")
    assert "4" in reply
    t.send("Write a very long story about a dragon and a knight.\r")
    t.read_until(" ", timeout=120)  # the reply has started streaming
    time.sleep(0.5)
    t.send("\x03")  # Ctrl-C: stop this reply, keep the chat
    t.read_until("(stopped)")
    t.read_until("> ")
    t.send("/stats\r")
    assert "prefill" in t.read_until("tokens cached")
    t.read_until("> ")
    save = tmp_path / "chat.ekv"
    t.send(f"/save {save}\r")
    t.read_until("(saved")
    t.read_until("> ")
    t.send("/reset\r")
    t.read_until("(conversation reset)")
    t.read_until("> ")
    t.send(f"/load {save}\r")
    assert "4 messages" in t.read_until("tokens cached)")
    t.read_until("> ")
    t.send("/kv\r")
    assert "kv int8" in t.read_until("tokens cached")  # the default cache type
    t.read_until("> ")
    t.send("\x04")  # Ctrl-D exits cleanly
    assert t.wait() == 0


def test_int4_chat_runs_far_past_the_ring():
    """`edgekv chat --kv int4 --ctx 512`: a conversation of well over 512 tokens keeps going
    through the ring buffer (sinks + most recent tokens), turn after turn, without an error."""
    env = dict(os.environ, TERM="dumb", PYTHONUNBUFFERED="1")
    t = Terminal([sys.executable, "-m", "edgekv.cli", "chat", str(model_path("smollm2")), "--temp", "0",
                  "--kv", "int4", "--ctx", "512", "-n", "160"], env)
    t.read_until("/help for commands")
    t.read_until("> ")
    topics = ["the sea", "a mountain village", "a clockmaker", "the first winter on Mars", "a lost violin"]
    for topic in topics:
        t.send(f"Tell me a long story about {topic}.\r")
        t.read_until("story about")
        reply = t.read_until("> ", timeout=300)
        assert "Traceback" not in reply and "edgekv: " not in reply, reply  # no error line
    t.send("/kv\r")
    line = t.read_until("tokens cached")
    m = re.search(r"kv int4: (\d+)/(\d+) tokens in the largest ring.* (\d+) tokens cached", line)
    assert m, line
    in_ring, capacity, cached = map(int, m.groups())
    assert capacity == 512 and in_ring == 512 and cached > 800  # the chat has wrapped the ring
    t.read_until("> ")
    t.send("\x04")
    assert t.wait() == 0


def test_ctrl_c_during_a_jit_compile_prints_no_llvmlite_traceback(monkeypatch):
    """Ctrl-C mid-compile leaves a half-made LLVM object whose cleanup raises in __del__; the
    CLI's unraisable hook drops exactly that, and passes every other one on."""
    import types

    from llvmlite.binding import ffi

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: seen.append(u.object))
    main(["list"])
    sys.unraisablehook(types.SimpleNamespace(object=ffi.ObjectRef.__del__, exc_value=AttributeError()))
    sys.unraisablehook(types.SimpleNamespace(object=len, exc_value=ValueError()))
    assert seen == [len]
