"""logprobs: each event's log-probability and top alternatives are the log-softmax of the model's
raw logits (a plain numpy reference), whatever the sampler's temperature, bias and filters."""
import numpy as np

from conftest import get_llm
from edgekv.sampling import Sampler, SamplingParams


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - x.max() - np.log(np.exp(x - x.max()).sum())


def test_sampler_logprobs_match_numpy():
    rng = np.random.default_rng(0)
    logits = (rng.standard_normal(5000) * 4).astype(np.float32)
    s = Sampler(SamplingParams(temperature=0.3, top_k=5, logit_bias={7: -np.inf}), 5000)
    ref = _log_softmax(logits)
    lp, top = s.logprobs(logits, 7, 6)  # a banned token still has the model's logprob
    assert abs(lp - ref[7]) < 1e-5
    want = np.argsort(-ref, kind="stable")[:6]
    assert [t for t, _ in top] == want.tolist()
    assert np.allclose([v for _, v in top], ref[want], atol=1e-5)
    assert s.logprobs(logits, 3, 0)[1] == []


def test_generate_events_carry_the_models_logprobs():
    llm = get_llm()
    prompt = llm.tokenize("The capital of France is")
    events = [e for e in llm.generate(prompt, max_tokens=6, temperature=0, logprobs=3) if e.token is not None]
    assert len(events) == 6
    cache = llm.new_cache()  # the logits each token was drawn from: the prompt as one pass, then one token a pass
    ref = [llm.forward(prompt, cache, 0)[-1]]
    for i, e in enumerate(events[:-1]):
        ref.append(llm.forward([e.token], cache, len(prompt) + i)[-1])
    for e, row in zip(events, ref):
        lr = _log_softmax(row)
        assert abs(e.logprob - lr[e.token]) < 1e-5
        assert e.top_logprobs[0][0] == e.token  # greedy: the likeliest token
        assert len(e.top_logprobs) == 3
        assert np.allclose([v for _, v in e.top_logprobs], np.sort(lr)[::-1][:3], atol=1e-5)
    hot = [e for e in llm.generate(prompt, max_tokens=3, temperature=1.5, seed=2, logprobs=0) if e.token is not None]
    assert all(e.logprob <= 0 and e.top_logprobs == [] for e in hot)
    plain = list(llm.generate(prompt, max_tokens=2, temperature=0))
    assert all(e.logprob is None and e.top_logprobs is None for e in plain)
