"""A minimal desktop chat window embedding edgekv (tkinter).

    python examples/tk_chat.py [MODEL] [--kv int8] [--ctx 4096]

The model runs in a worker thread so the window stays responsive; replies stream into the Text
widget, and Stop ends the reply within one token (edgekv's cancel event). `ChatController` is
the part without any GUI: a real app (Qt, a web view, ...) can drive it the same way.
"""
from __future__ import annotations

import argparse
import queue
import threading

import edgekv


class ChatController:
    """One chat session served by a worker thread. The GUI calls send() and stop() from its
    own thread and drains poll() from a timer; nothing here touches the GUI."""

    def __init__(self, llm: edgekv.LLM, system: str | None = None, **sampling):
        self.session = llm.session(system=system, **sampling)
        self.events: queue.Queue = queue.Queue()  # ("text", piece) ... then ("done", reason) or ("error", message)
        self._cancel = threading.Event()
        self._worker: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """A reply is being generated."""
        return self._worker is not None and self._worker.is_alive()

    def send(self, text: str) -> bool:
        """Start answering `text` in the background; False if a reply is still running."""
        if self.busy or not text.strip():
            return False
        self._cancel.clear()
        self._worker = threading.Thread(target=self._run, args=(text,), daemon=True)
        self._worker.start()
        return True

    def stop(self) -> None:
        """End the current reply after the token being computed (the session stays usable)."""
        self._cancel.set()

    def poll(self) -> list[tuple[str, str]]:
        """Everything the worker produced since the last call."""
        out = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the current reply is finished (for scripts and tests); False on timeout."""
        if self._worker is not None:
            self._worker.join(timeout)
        return not self.busy

    def _run(self, text: str) -> None:
        try:
            reason = None
            for e in self.session.send(text, stream=True, cancel=self._cancel):
                if e.text:
                    self.events.put(("text", e.text))
                reason = e.finish_reason or reason
            self.events.put(("done", reason))
        except edgekv.EdgekvError as e:
            self.events.put(("error", str(e)))
        except Exception as e:  # a bug must show in the window, not kill the worker silently
            self.events.put(("error", f"{type(e).__name__}: {e}"))


class ChatWindow:
    """The Tk window: a transcript, an entry line, Send and Stop."""

    POLL_MS = 30

    def __init__(self, root, controller: ChatController, title: str = "edgekv chat"):
        import tkinter as tk
        from tkinter import scrolledtext

        self.root, self.ctl = root, controller
        root.title(title)
        self.log = scrolledtext.ScrolledText(root, wrap="word", height=24, width=80, state="disabled")
        self.log.pack(fill="both", expand=True, padx=6, pady=6)
        bar = tk.Frame(root)
        bar.pack(fill="x", padx=6, pady=(0, 6))
        self.entry = tk.Entry(bar)
        self.entry.pack(side="left", fill="x", expand=True)
        self.entry.bind("<Return>", lambda _e: self.on_send())
        self.send_button = tk.Button(bar, text="Send", command=self.on_send)
        self.send_button.pack(side="left", padx=(6, 0))
        self.stop_button = tk.Button(bar, text="Stop", command=self.ctl.stop, state="disabled")
        self.stop_button.pack(side="left", padx=(6, 0))
        self.entry.focus_set()
        root.after(self.POLL_MS, self.pump)

    def write(self, text: str) -> None:
        self.log.configure(state="normal")
        self.log.insert("end", text)
        self.log.see("end")
        self.log.configure(state="disabled")

    def on_send(self) -> None:
        text = self.entry.get()
        if self.ctl.send(text):
            self.entry.delete(0, "end")
            self.write(f"\nYou: {text}\nAssistant: ")
            self.send_button.configure(state="disabled")
            self.stop_button.configure(state="normal")

    def pump(self) -> None:
        """Move what the worker produced into the window (Tk widgets belong to this thread)."""
        for kind, value in self.ctl.poll():
            if kind == "text":
                self.write(value)
            else:
                self.write(" [stopped]\n" if value == "cancelled" else f"\n[error: {value}]\n" if kind == "error" else "\n")
                self.send_button.configure(state="normal")
                self.stop_button.configure(state="disabled")
        self.root.after(self.POLL_MS, self.pump)


def main(argv: list[str] | None = None) -> None:
    import tkinter as tk

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    p.add_argument("--kv", default="int8")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--system", default="You are a helpful assistant.")
    args = p.parse_args(argv)
    llm = edgekv.load(args.model, n_ctx=args.ctx, kv=args.kv)
    root = tk.Tk()
    ChatWindow(root, ChatController(llm, system=args.system, temperature=0.7, max_tokens=512), title=f"edgekv: {llm.path.name}")
    root.mainloop()


if __name__ == "__main__":
    main()
