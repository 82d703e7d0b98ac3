"""`edgekv run` with several prompts (-p, --prompts FILE, --parallel), several samples of one
(--n-samples) and beam search (--beams): each result printed whole under a label, equal to what
the single-prompt run (or the API) gives it."""
import json

import pytest

from conftest import model_path
from edgekv import LLM
from edgekv.cli import main

COLD = ["-q", "--no-prompt-cache"]  # every run cold: results comparable across runs


def run(capsys, *argv) -> str:
    assert main(["run", str(model_path("smollm2")), *argv, *COLD]) == 0
    return capsys.readouterr().out


def sections(out: str) -> dict[str, str]:
    """label -> text of a labelled run's output (results are separated by a blank line)."""
    parts = {}
    for block in ("\n\n" + out).split("\n\n--- ")[1:]:
        label, _, text = block.partition(" ---\n")
        parts[label] = text.removesuffix("\n")
    return parts


def test_several_prompts_in_parallel_each_as_its_solo_run(capsys, tmp_path):
    prompts = ["Once upon a time", "The capital of France is", "1 2 3"]
    solo = [run(capsys, p, "-n", "6").removesuffix("\n") for p in prompts]
    want = {f"prompt {j + 1}": t for j, t in enumerate(solo)}
    assert sections(run(capsys, "-p", prompts[0], "-p", prompts[1], "-p", prompts[2], "-n", "6", "--parallel", "2")) == want
    listing = tmp_path / "prompts.txt"
    listing.write_text(f"{prompts[0]}\n\n{prompts[1]}\n")  # blank lines are no prompt
    assert sections(run(capsys, prompts[2], "--prompts", str(listing), "-n", "6", "--parallel", "3")) == {
        "prompt 1": solo[2], "prompt 2": solo[0], "prompt 3": solo[1]}


def test_samples_are_the_solo_runs_with_seed_plus_i(capsys):
    sampling = ["--temp", "0.9", "--chat", "-n", "8"]
    solo = [run(capsys, "Hi", *sampling, "--seed", str(5 + i)).removesuffix("\n") for i in range(3)]
    got = sections(run(capsys, "Hi", *sampling, "--seed", "5", "--n-samples", "3"))
    assert got == {f"sample {i + 1}": t for i, t in enumerate(solo)}


def test_beams_print_the_best_with_their_scores(capsys):
    llm = LLM(model_path("smollm2"), prompt_cache=False)
    ids = llm.chat_ids(llm.template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True))
    want = llm.beam_search(ids, 3, max_tokens=10)[:2]
    lines = run(capsys, "Hi", "--chat", "-n", "10", "--beams", "3", "--n-samples", "2", "--json").splitlines()
    got = [json.loads(line) for line in lines]
    assert [(r["sample"], r["text"], r["finish_reason"]) for r in got] == [
        (i, h.text, h.finish_reason) for i, h in enumerate(want)]
    assert [r["score"] for r in got] == pytest.approx([h.score for h in want], abs=1e-6)
    assert list(sections(run(capsys, "Hi", "--chat", "-n", "10", "--beams", "3"))) == [f"beam 1, score {want[0].score:.4f}"]


def test_an_empty_prompts_file_is_an_error(capsys, tmp_path):
    empty = tmp_path / "none.txt"
    empty.write_text("\n \n")
    assert main(["run", str(model_path("smollm2")), "--prompts", str(empty), "-q"]) == 1
    assert capsys.readouterr().err.strip() == f"edgekv: error: {empty} holds no prompts (one a line)"
