"""Every subcommand with bad arguments: a non-zero exit and exactly one line on stderr, never a
traceback. Argument values are argparse's (exit 2, before anything loads), the rest edgekv's
errors (exit 1). In process, on a tiny synthetic model: nothing here compiles or generates."""
import subprocess
import sys

import pytest

from edgekv.cli import build_parser, main


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from edgekv.synth import write_synthetic

    d = tmp_path_factory.mktemp("cli")
    (d / "text.txt").write_text("not a model\n")
    return dict(M=str(write_synthetic(d / "tiny.gguf", size="tiny", progress=False)), TXT=str(d / "text.txt"),
                DIR=str(d), NEW=str(d / "new.gguf"), MISSING=str(d / "missing.txt"))


# (argv, a fragment the one line must contain); M, TXT, DIR, NEW, MISSING are filled in.
CASES = [
    ("bench M -p abc", "argument -p: 'abc' is not a whole number"),
    ("bench M -p -5", "argument -p: must be >= 0, got -5"),
    ("bench M -p 0 -n 0 -q", "nothing to benchmark"),
    ("bench M -p , -n 4", "argument -p: needs at least one value"),
    ("bench M -n 4x", "argument -n: '4x' is not a whole number"),
    ("bench M -d -3", "argument -d: must be >= 0"),
    ("bench M -r 0", "argument -r: must be >= 1, got 0"),
    ("bench M -r -1", "argument -r: must be >= 1"),
    ("bench M -t 0", "argument -t: must be >= 1, got 0"),
    ("bench M -t 2,-1", "argument -t: must be >= 1, got -1"),
    ("bench M -t auto,x", "argument -t: 'x' is not a whole number"),
    ("bench M --background-load -1", "argument --background-load: must be >= 0, got -1"),
    ("bench M --kv int3", "unknown KV cache type 'int3'"),
    ("bench M --kv f16,int3", "unknown KV cache type 'int3'"),
    ("bench M -o xml", "argument -o: invalid choice"),
    ("bench M --compare vllm", "argument --compare: invalid choice"),
    ("bench no-such-model -q", "'no-such-model' is neither a known model"),
    ("bench TXT -q", "not a GGUF file"),
    ("bench", "required: MODEL"),
    ("warmup M --kv int3", "unknown KV cache type 'int3'"),
    ("warmup no-such-model -q", "'no-such-model' is neither a known model"),
    ("synth /proc/nope/x.gguf --size tiny -q", "cannot write /proc/nope/x.gguf"),
    ("synth DIR --size tiny -q", "is a folder"),
    ("synth NEW --size huge", "size 'huge' is not known"),
    ("synth NEW --size tiny --type q9", "qtype 'q9' is not supported"),
    ("synth NEW --arch mamba", "argument --arch: invalid choice"),
    ("synth NEW --seed -1", "argument --seed: must be in [0, 2**64 - 1], got -1"),
    ("synth NEW --seed abc", "argument --seed: 'abc' is not a whole number"),
    ("run M hi --threads 0", "argument --threads: must be >= 1, got 0"),
    ("run M hi --threads -1", "argument --threads: must be >= 1, got -1"),
    ("run M hi --ctx 0", "argument --ctx: must be >= 8, got 0"),
    ("run M hi --ctx abc", "argument --ctx: 'abc' is not a whole number"),
    ("run M hi -n -1", "argument -n/--max-tokens: must be >= 0"),
    ("run M hi --temp -1", "argument --temp: must be in [0.0, inf)"),
    ("run M hi --temp nan", "argument --temp: must be in [0.0, inf)"),
    ("run M hi --top-k -1", "argument --top-k: must be >= 0"),
    ("run M hi --top-p 0", "argument --top-p: must be in (0.0, 1.0]"),
    ("run M hi --top-p 2", "argument --top-p: must be in (0.0, 1.0]"),
    ("run M hi --min-p 1.5", "argument --min-p: must be in [0.0, 1.0]"),
    ("run M hi --repeat-penalty 0", "argument --repeat-penalty: must be in (0.0, inf)"),
    ("run M hi --seed -1", "argument --seed: must be in [0, 2**128 - 1]"),
    ("run M hi --kv int3", "argument --kv: unknown KV cache type 'int3'"),
    ("run M hi --device tpu", "argument --device: invalid choice: 'tpu'"),
    ("run M hi --gpu-layers -2", "argument --gpu-layers: must be >= 0"),
    ("run M hi --gpu-layers 2 --ctx 256 -q", "gpu_layers needs device cuda or auto"),
    ("run M -q", "no prompt: give PROMPT, - to read stdin, -f FILE, -p TEXT or --prompts FILE"),
    ("run M --n-samples 2 -q", "no prompt"),
    ("run M hi --n-samples 0", "argument --n-samples: must be >= 1, got 0"),
    ("run M hi --parallel 0", "argument --parallel: must be >= 1, got 0"),
    ("run M hi --beams 0", "argument --beams: must be >= 1, got 0"),
    ("run M hi --beams 2 --parallel 2 -q", "--parallel does not apply to --beams"),
    ("run M hi --beams 2 --n-samples 3 -q", "--n-samples 3 with --beams 2: at most the 2 beams"),
    ("run M hi --beams 2 --stop . -q", "--stop does not apply to --beams"),
    ("run M --prompts MISSING -q", "cannot read"),
    ("run M hi -f TXT -q", "give PROMPT or -f FILE, not both"),
    ("run M -f MISSING -q", "cannot read"),
    ("run M hi --bogus", "unrecognized arguments: --bogus"),
    ("run", "required: MODEL"),
    ("chat M --threads 0", "argument --threads: must be >= 1"),
    ("chat M --ctx 2", "argument --ctx: must be >= 8, got 2"),
    ("chat M --temp -1", "argument --temp: must be in [0.0, inf)"),
    ("chat M --top-p 2", "argument --top-p: must be in (0.0, 1.0]"),
    ("chat M --seed x", "argument --seed: 'x' is not a whole number"),
    ("chat M -n 0", "argument -n/--max-tokens: must be >= 1, got 0"),
    ("chat M --kv int3", "argument --kv: unknown KV cache type 'int3'"),
    ("chat M -f MISSING", "cannot read"),
    ("chat no-such-model", "'no-such-model' is neither a known model"),
    ("info M --ctx 0", "argument --ctx: must be >= 8, got 0"),
    ("info M --ctx -5", "argument --ctx: must be >= 8"),
    ("info TXT", "not a GGUF file"),
    ("info MISSING", "is neither a known model nor an existing file"),
    ("pull", "required: MODEL"),
    ("pull no-such-model", "unknown model 'no-such-model'"),
    ("list extra", "unrecognized arguments: extra"),
    ("perplexity M MISSING -q", "cannot read"),
    ("perplexity M TXT --ctx 0", "argument --ctx: must be >= 8"),
    ("perplexity M TXT --kv int3", "argument --kv: unknown KV cache type 'int3'"),
    ("perplexity M TXT --kl-base int3", "argument --kl-base: unknown KV cache type 'int3'"),
    ("perplexity M TXT --threads 0", "argument --threads: must be >= 1"),
    ("perplexity M TXT --evict lru", "argument --evict: unknown eviction policy 'lru'"),
    ("perplexity M TXT --evict h2o", "--evict needs --ring N"),
    ("perplexity M TXT --ring 4", "argument --ring: must be >= 8, got 4"),
    ("run M hi --evict lru", "argument --evict: unknown eviction policy 'lru'"),
    ("bench M --evict lru", "argument --evict: unknown eviction policy 'lru'"),
    ("serve M --port 70000", "argument --port: must be in [0, 65535], got 70000"),
    ("serve M --port x", "argument --port: 'x' is not a whole number"),
    ("serve M --parallel 0", "argument --parallel: must be >= 1, got 0"),
    ("serve M --log-format xml", "argument --log-format: invalid choice: 'xml'"),
    ("serve M --ctx 2", "argument --ctx: must be >= 8, got 2"),
    ("serve no-such-model -q", "'no-such-model' is neither a known model"),
    ("nosuchverb", "invalid choice: 'nosuchverb'"),
    ("--bogus", "unrecognized arguments: --bogus"),
]


def _argv(case: str, files: dict) -> list[str]:
    return [files.get(word, word) for word in case.split()]


def _status(argv) -> int:
    try:
        return main(argv)
    except SystemExit as e:  # argparse's errors
        return e.code


@pytest.mark.parametrize("case, says", CASES, ids=[c for c, _ in CASES])
def test_bad_argument_is_one_line(case, says, files, capsys):
    status = _status(_argv(case, files))
    out, err = capsys.readouterr()
    assert status not in (0, None), (status, out, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert says in err, err
    assert err.startswith("edgekv"), err
    assert out == ""


def test_every_subcommand_has_a_bad_argument_case():
    verbs = set(build_parser()._subparsers._group_actions[0].choices)
    assert verbs <= {case.split()[0] for case, _ in CASES}


def test_the_installed_command_prints_no_traceback(files):
    """The same, as a process: what a shell user sees, start-up included."""
    for case in ("bench M -p abc", "synth /proc/nope/x.gguf --size tiny -q", "run M hi --threads 0"):
        p = subprocess.run([sys.executable, "-m", "edgekv.cli", *_argv(case, files)], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode != 0 and p.stdout == "", (case, p)
        assert len(p.stderr.splitlines()) == 1 and "Traceback" not in p.stderr, (case, p.stderr)


def test_an_error_after_a_progress_bar_starts_on_its_own_line(files, capsys):
    """`bench` (progress on) failing once its bar is drawn: the error line is not glued to the bar."""
    assert main(["bench", files["TXT"], "-p", "4", "-n", "2"]) == 1
    last = capsys.readouterr().err.split("\n")[-2]  # the text ends with a newline
    assert last.startswith("edgekv: error:") and "not a GGUF file" in last, last
