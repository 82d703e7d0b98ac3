"""edgekv in a script: load a model, complete, stream, chat with a cached conversation.

    python examples/quickstart.py [MODEL]     # a known name (pulled on first use) or a .gguf path
"""
import sys

import edgekv

llm = edgekv.load(sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m-instruct")
print(llm.complete("The capital of France is", max_tokens=8))            # greedy
for event in llm.generate("Once upon a time", max_tokens=24, temperature=0.8, seed=1):
    print(event.text, end="", flush=True)                                # last event: .finish_reason
print("\n", llm.stats.as_dict())                                         # tokens/s, KV bytes in use

chat = llm.session(system="You are terse.", temperature=0.7, seed=1, max_tokens=48)
print(chat.send("What is a KV cache?"))
print(chat.send("Why quantize it?"))                                     # only this turn is prefilled
print(f"prefilled {chat.stats.prefill_tokens} of {chat.stats.prompt_tokens} prompt tokens")
chat.save("chat.ekv")                                                    # cache included
again = edgekv.ChatSession.load("chat.ekv", llm)                        # continues where it stopped
print(len(again.history), "messages restored")
