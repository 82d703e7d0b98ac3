"""`edgekv VERB --help` shows every default, and says why where run, chat and bench differ."""
import argparse

import pytest

from edgekv.cli import build_parser, main

VERBS = ["pull", "list", "info", "run", "chat", "bench", "perplexity", "synth"]


def _help(verb: str, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main([verb, "--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere


@pytest.mark.parametrize("verb", VERBS)
def test_help_shows_every_default(verb, capsys):
    text = _help(verb, capsys)
    sub = build_parser()._subparsers._group_actions[0].choices[verb]
    for action in sub._actions:
        if action.default in (None, False, argparse.SUPPRESS) or action.help is None:
            continue
        assert f"(default: {action.default})" in text, (action.option_strings, text)


def test_deliberate_differences_are_explained(capsys):
    run, chat, bench = (_help(v, capsys) for v in ("run", "chat", "bench"))
    assert "(default: 128)" in run and "chat's default is 512" in run
    assert "(default: 512)" in chat and "run's default is 128" in chat
    assert "(default: 0.0)" in run and "chat's is 0.7" in run
    assert "(default: 0.7)" in chat and "run's is 0" in chat
    assert "(default: f16)" in bench and "llama-bench" in bench and "int8" in bench
    assert "(default: int8)" in run and "(default: int8)" in chat


def test_chat_takes_runs_sampling_options():
    a = build_parser().parse_args(["chat", "m.gguf", "--top-k", "5", "--top-p", "0.9", "--min-p", "0.1",
                                   "--repeat-penalty", "1.1", "--stop", "A", "--stop", "B", "--seed", "3",
                                   "-f", "p.txt"])
    assert (a.top_k, a.top_p, a.min_p, a.repeat_penalty, a.stop, a.seed, a.file) == (5, 0.9, 0.1, 1.1, ["A", "B"], 3, "p.txt")
    a = build_parser().parse_args(["run", "m.gguf", "--system", "Be brief.", "-f", "p.txt"])
    assert (a.system, a.file, a.prompt) == ("Be brief.", "p.txt", None)
