"""Beam search (issue 17) against a plain reference written here: Hugging Face's rules over
`llm.forward` logits, every hypothesis run from the prompt again in a cache of its own."""
import numpy as np
import pytest

from edgekv import EdgekvError
from test_batch import llm_for
from test_samples import counting


def reference(llm, prompt: list[int], num_beams: int, max_tokens: int, length_penalty: float, early_stopping: bool):
    """[(score, tokens, finish_reason)] best first: beam search as transformers' BeamSearchScorer."""
    eos = llm.tokenizer.eot_ids
    keep = max(2, 1 + len(eos)) * num_beams

    def logprobs(tokens):  # a fresh cache: the prompt in one pass, then one token at a time
        cache = llm.new_cache()
        lg = llm.forward(prompt, cache, 0)[-1]
        for i, t in enumerate(tokens):
            lg = llm.forward([t], cache, len(prompt) + i)[-1]
        lg = lg.astype(np.float64)
        m = lg.max()
        return lg - m - np.log(np.sum(np.exp(lg - m)))

    def best(hyps):
        return sorted(hyps, key=lambda h: -h[0])[:num_beams]

    beams, finished = [([], 0.0)], []
    for step in range(1, max_tokens + 1):
        cands = []
        for b, (toks, s) in enumerate(beams):
            lp = logprobs(toks)
            cands += [(s + lp[t], b, int(t)) for t in np.argsort(-lp, kind="stable")[:keep]]
        cands = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:keep]
        going = []
        for rank, (score, b, t) in enumerate(cands):
            if t in eos:
                if rank < num_beams:
                    finished.append((score / step ** length_penalty, beams[b][0], "stop"))
            else:
                going.append((beams[b][0] + [t], score))
            if len(going) == num_beams:
                break
        if len(finished) >= num_beams and (early_stopping or
                                           best(finished)[-1][0] >= cands[0][0] / step ** length_penalty):
            return best(finished)
        beams = going
    return best(finished + [(s / len(toks) ** length_penalty, toks, "length") for toks, s in beams])


@pytest.mark.parametrize("kv,num_beams,max_tokens,length_penalty,early_stopping", [
    ("f16", 3, 11, 1.0, False), ("int8", 2, 11, 0.0, True), ("int4", 3, 11, 2.0, True)])
def test_beam_search_equals_the_reference(kv, num_beams, max_tokens, length_penalty, early_stopping, monkeypatch):
    llm = llm_for("smollm2", "cpu", kv, 256)
    prompt = llm.chat_ids(llm.template.render([{"role": "user", "content": "Hi"}],
                                              add_generation_prompt=True))
    want = reference(llm, prompt, num_beams, max_tokens, length_penalty, early_stopping)
    passes = counting(llm, monkeypatch)
    got = llm.beam_search(prompt, num_beams, max_tokens=max_tokens, length_penalty=length_penalty,
                          early_stopping=early_stopping)
    assert [(h.tokens, h.finish_reason) for h in got] == [(t, r) for _, t, r in want]
    assert [h.score for h in got] == pytest.approx([s for s, _, _ in want], rel=1e-9)
    assert [h.text for h in got] == [llm.detokenize(t) for _, t, _ in want]
    assert "stop" in {r for _, _, r in want}  # some hypothesis ended at EOS
    assert [p for p in passes if p[0] > 1 and p[1] == 1] == [(len(prompt), 1)]  # the prompt prefilled once
    assert max(p[1] for p in passes) == num_beams  # the beams decode as one batch


def test_beam_search_arguments_and_one_beam_is_greedy():
    llm = llm_for("llama", "cpu", "int8", 32)
    with pytest.raises(EdgekvError, match="num_beams"):
        llm.beam_search([1, 2], 0)
    with pytest.raises(EdgekvError, match="length_penalty"):
        llm.beam_search([1, 2], 2, length_penalty=float("nan"))
    (h,) = llm.beam_search([1, 2], 1, max_tokens=12)
    assert h.tokens == llm.sample([1, 2], max_tokens=12, temperature=0.0)[0].tokens
    assert llm.beam_search([1, 2], 2, max_tokens=0)[0].tokens == []
