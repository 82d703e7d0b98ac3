"""Chat with `edgekv serve` through the official OpenAI client: any app built on it works the
same way, pointed at the local server (base_url) with any API key (unless --api-key is set).

    pip install "edgekv[server]" openai
    edgekv serve                        # in one terminal (http://127.0.0.1:8080/v1)
    python examples/openai_chat.py      # in another: type a message, Enter; Ctrl-D quits
"""
import argparse
import os
import sys

from openai import OpenAI


def main() -> None:
    ap = argparse.ArgumentParser(description="chat with an OpenAI-compatible server")
    ap.add_argument("--base-url", default="http://127.0.0.1:8080/v1")
    ap.add_argument("--api-key", default=os.environ.get("EDGEKV_API_KEY", "none"))
    ap.add_argument("--model", default=None, help="default: the server's first model")
    ap.add_argument("--system", default=None, help="system prompt")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--temperature", type=float, default=0.7)
    args = ap.parse_args()

    client = OpenAI(base_url=args.base_url, api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    messages = [{"role": "system", "content": args.system}] if args.system else []
    tty = sys.stdin.isatty()
    while True:
        try:
            text = input("> " if tty else "")
        except EOFError:
            break
        if not text.strip():
            continue
        messages.append({"role": "user", "content": text})
        reply = []
        stream = client.chat.completions.create(model=model, messages=messages, stream=True,
                                                max_tokens=args.max_tokens, temperature=args.temperature)
        for chunk in stream:  # the reply as it is generated
            piece = chunk.choices[0].delta.content or ""
            print(piece, end="", flush=True)
            reply.append(piece)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})  # the next turn sends the whole chat


if __name__ == "__main__":
    main()
