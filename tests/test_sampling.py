"""edgekv.sampling against a naive numpy oracle of llama.cpp's sampler chain.

The oracle sorts the whole vocabulary and follows the chain step by step in float64; the sampler
under test avoids full sorts, bins mass, reuses buffers. Exact comparisons use
Sampler.distribution(); the draws themselves are checked with fixed seeds against it.
"""
import json
import math

import numpy as np
import pytest

from edgekv.errors import EdgekvError, SessionFileError
from edgekv.sampling import Sampler, SamplingParams

PLAIN = dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)  # no filter: softmax of the adjusted logits


# ---- the oracle ------------------------------------------------------------------------------


def oracle_adjust(logits, history, p: SamplingParams):
    """Logit bias, then llama.cpp's penalty formulas, in float32 as llama.cpp computes them."""
    x = np.array(logits, dtype=np.float32)
    for tok, b in (p.logit_bias or {}).items():
        x[tok] = x[tok] + np.float32(b)
    if p.penalty_last_n == 0:
        return x
    window = list(history) if p.penalty_last_n < 0 else list(history)[-p.penalty_last_n :]
    for tok in set(window):
        count = window.count(tok)
        l = x[tok]
        l = l / np.float32(p.repeat_penalty) if l > 0 else l * np.float32(p.repeat_penalty)
        l = l - (np.float32(count) * np.float32(p.frequency_penalty) + np.float32(1.0) * np.float32(p.presence_penalty))
        x[tok] = l
    return x


def oracle_distribution(x, p: SamplingParams) -> dict[int, float]:
    """token -> probability after top-k, top-p, min-p, temperature, following the chain literally."""
    x = np.asarray(x, dtype=np.float64)
    if p.temperature <= 0:
        return {int(np.argmax(x)): 1.0}
    order = np.lexsort((np.arange(x.size), -x))  # full sort, descending, ties by id
    if 0 < p.top_k < x.size:
        order = order[: p.top_k]

    def softmax(ids):
        e = np.exp(x[ids] - x[ids].max())
        return e / e.sum()

    # llama.cpp holds top_p and min_p as C floats
    top_p, min_p = float(np.float32(p.top_p)), float(np.float32(p.min_p))
    if top_p < 1.0:
        cum = np.cumsum(softmax(order))
        n_keep = next((i + 1 for i, c in enumerate(cum) if c >= top_p), len(order))
        order = order[:n_keep]
    if min_p > 0.0:
        pr = softmax(order)
        order = order[pr >= min_p * pr.max()]
    order = order[np.isfinite(x[order])]
    z = x[order] / p.temperature
    e = np.exp(z - z.max())
    return dict(zip(order.tolist(), (e / e.sum()).tolist()))


def assert_matches_oracle(sampler, logits, history, params, rtol=1e-5):
    ids, probs = sampler.distribution(logits, history)
    want = oracle_distribution(oracle_adjust(logits, history, params), params)
    want_ids = np.fromiter(want, dtype=np.int64, count=len(want))
    want_p = np.fromiter(want.values(), dtype=np.float64, count=len(want))
    order = np.argsort(ids)
    assert np.array_equal(ids[order], np.sort(want_ids)), "kept token set differs from the oracle"
    np.testing.assert_allclose(probs[order], want_p[np.argsort(want_ids)], rtol=rtol, atol=1e-12)
    assert probs.sum() == pytest.approx(1.0, abs=1e-9)


def logits_for(n, scale, seed):
    return (np.random.default_rng(seed).standard_normal(n) * scale).astype(np.float32)


def chi2_upper(df, z=4.0):
    """Wilson-Hilferty upper quantile of chi-square(df) at normal deviate z (z=4: p ~ 3e-5)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# ---- validation --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-0.1), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_k=-1), "top_k"),
        (dict(top_k=2.5), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.01), "top_p"),
        (dict(top_p=-0.5), "top_p"),
        (dict(min_p=-0.01), "min_p"),
        (dict(min_p=1.5), "min_p"),
        (dict(repeat_penalty=0.0), "repeat_penalty"),
        (dict(presence_penalty=float("inf")), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(penalty_last_n=-2), "penalty_last_n"),
        (dict(seed=-1), "seed"),
        (dict(seed="7"), "seed"),
        (dict(logit_bias={-3: 1.0}), "logit_bias"),
        (dict(logit_bias={3: float("nan")}), "logit_bias"),
        (dict(logit_bias={3: float("inf")}), "logit_bias"),
        (dict(logit_bias=[(3, 1.0)]), "logit_bias"),
    ],
)
def test_invalid_params_raise_naming_the_field(kwargs, field):
    with pytest.raises(EdgekvError, match=field) as info:
        SamplingParams(**kwargs)
    assert "\n" not in str(info.value)


def test_valid_edges_accepted():
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, penalty_last_n=-1, seed=0)
    SamplingParams(top_p=1e-9, min_p=1.0, presence_penalty=-2.0, logit_bias={5: float("-inf")})


def test_sampler_rejects_bad_vocab_and_inputs():
    with pytest.raises(EdgekvError, match="logit_bias"):
        Sampler(SamplingParams(logit_bias={10: 1.0}), n_vocab=10)
    with pytest.raises(EdgekvError, match="n_vocab"):
        Sampler(SamplingParams(), n_vocab=0)
    s = Sampler(SamplingParams(seed=0, repeat_penalty=1.1), n_vocab=10)
    with pytest.raises(EdgekvError, match="shape"):
        s(np.zeros(11, np.float32), [])
    bad = np.zeros(10, np.float32)
    bad[3] = np.nan
    with pytest.raises(EdgekvError, match="NaN"):
        s(bad, [])
    with pytest.raises(EdgekvError, match="history"):
        s(np.zeros(10, np.float32), [1, 10])
    banned = Sampler(SamplingParams(seed=0, logit_bias={i: float("-inf") for i in range(4)}), n_vocab=4)
    with pytest.raises(EdgekvError, match="banned"):
        banned(np.zeros(4, np.float32), [])


def test_params_are_frozen_copies():
    bias = {1: 2.0}
    p = SamplingParams(logit_bias=bias)
    bias[1] = -5.0
    bias[2] = 1.0
    assert dict(p.logit_bias) == {1: 2.0}
    hash(p)  # usable as a dict key / cache key
    with pytest.raises(Exception):
        p.temperature = 1.0


# ---- exact distributions against the oracle -------------------------------------------------------


FILTERS = [
    dict(),  # llama.cpp defaults: top_k 40, top_p 0.95, min_p 0.05, temperature 0.8
    dict(top_k=5, top_p=1.0, min_p=0.0),
    dict(top_k=0, top_p=0.5, min_p=0.0),
    dict(top_k=0, top_p=0.9, min_p=0.0, temperature=1.7),
    dict(top_k=0, top_p=1.0, min_p=0.2),
    dict(top_k=0, top_p=1.0, min_p=0.0, temperature=0.3),
    dict(top_k=100, top_p=0.8, min_p=0.1, temperature=2.0),
    dict(top_k=3, top_p=0.3, min_p=0.9),
]


@pytest.mark.parametrize("kw", FILTERS)
@pytest.mark.parametrize("scale", [0.5, 2.0, 6.0])
def test_distribution_matches_oracle_small_vocab(kw, scale):
    n = 700
    params = SamplingParams(seed=1, **kw)
    s = Sampler(params, n)
    for seed in range(3):
        assert_matches_oracle(s, logits_for(n, scale, seed), [], params)


@pytest.mark.parametrize("n", [49152, 262144])
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(top_k=0),  # top-p over the whole vocabulary: head path or binned path, by flatness
        dict(top_k=0, min_p=0.0, top_p=0.9),
        dict(top_k=0, top_p=1.0),  # min-p alone
        dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.3),  # plain temperature over everything
    ],
)
def test_distribution_matches_oracle_large_vocab(n, kw):
    params = SamplingParams(seed=1, **kw)
    s = Sampler(params, n)
    for scale in (1.0, 3.0, 12.0):  # flat (tens of thousands kept) ... peaked (a handful kept)
        assert_matches_oracle(s, logits_for(n, scale, int(scale * 10)), [], params, rtol=1e-4)


def test_top_k_keeps_only_the_k_highest():
    n, k = 5000, 7
    x = logits_for(n, 1.0, 3)
    top = set(np.argsort(-x)[:k].tolist())
    s = Sampler(SamplingParams(seed=4, top_k=k, top_p=1.0, min_p=0.0, temperature=5.0), n)
    drawn = {s(x, []) for _ in range(3000)}
    assert drawn <= top
    assert drawn == top  # at temperature 5 all seven are likely enough to appear in 3000 draws


def test_top_p_keeps_smallest_set_reaching_p():
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    x = np.log(probs).astype(np.float32)
    keep = lambda p, **kw: sorted(Sampler(SamplingParams(top_p=p, top_k=0, min_p=0.0, seed=0, **kw), 4).distribution(x)[0].tolist())
    assert keep(0.49) == [0]
    assert keep(0.51) == [0, 1]
    assert keep(0.79) == [0, 1]
    assert keep(0.81) == [0, 1, 2]
    assert keep(0.96) == [0, 1, 2, 3]
    # top-p sees temperature-1 probabilities: temperature only reshapes the survivors
    assert keep(0.79, temperature=5.0) == [0, 1]
    # after top-k, top-p renormalises over the survivors: 0.5/0.8 = 0.625 >= 0.6 keeps one
    assert sorted(Sampler(SamplingParams(top_k=2, top_p=0.6, min_p=0.0, seed=0), 4).distribution(x)[0].tolist()) == [0]


def test_min_p_removes_tokens_below_fraction_of_max():
    probs = np.array([0.4, 0.3, 0.2, 0.06, 0.04])
    x = np.log(probs).astype(np.float32)
    keep = lambda mp: sorted(Sampler(SamplingParams(min_p=mp, top_k=0, top_p=1.0, seed=0), 5).distribution(x)[0].tolist())
    assert keep(0.125) == [0, 1, 2, 3]  # bound 0.05
    assert keep(0.16) == [0, 1, 2]  # bound 0.064
    assert keep(0.74) == [0, 1]  # bound 0.296
    assert keep(1.0) == [0]


def test_temperature_zero_is_argmax_after_bias_and_penalties():
    n = 300
    params = SamplingParams(temperature=0.0, repeat_penalty=1.5, presence_penalty=0.7, logit_bias={11: 3.0, 12: -1.0})
    s = Sampler(params, n)
    rng = np.random.default_rng(5)
    for _ in range(50):
        x = (rng.standard_normal(n) * 2).astype(np.float32)
        hist = rng.integers(0, n, 40).tolist()
        assert s(x, hist) == int(np.argmax(oracle_adjust(x, hist, params)))
    assert Sampler(SamplingParams(temperature=0.0), n)(x, []) == int(np.argmax(x))


# ---- penalties and bias ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(repeat_penalty=1.3),
        dict(frequency_penalty=0.4),
        dict(presence_penalty=0.9),
        dict(repeat_penalty=0.8, frequency_penalty=-0.3, presence_penalty=0.5),
        dict(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.5, penalty_last_n=-1),
        dict(repeat_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.5, penalty_last_n=0),
    ],
)
def test_penalties_follow_llama_cpp_formulas(kw):
    n = 60
    x = logits_for(n, 2.0, 8)  # positive and negative logits
    assert (x[:10] > 0).any() and (x[:10] < 0).any()
    # tokens 0..9 repeat inside the last 8; tokens 20..24 appear only earlier than the window
    history = [20, 21, 22, 23, 24, 20, 1, 2, 3, 3, 3, 4, 5, 5, 9, 0]
    params = SamplingParams(seed=0, penalty_last_n=kw.pop("penalty_last_n", 8), **kw, **PLAIN)
    ids, probs = Sampler(params, n).distribution(x, history)
    expect = oracle_adjust(x, history, params).astype(np.float64)
    got_logp = np.full(n, -np.inf)
    got_logp[ids] = np.log(probs)
    want_logp = expect - expect.max() - np.log(np.exp(expect - expect.max()).sum())
    np.testing.assert_allclose(got_logp, want_logp, rtol=0, atol=2e-6)
    if params.penalty_last_n == 8:  # the out-of-window tokens are untouched
        assert (expect[20:25] == x[20:25]).all()
    if params.penalty_last_n == 0:
        assert (expect == x).all()


def test_logit_bias_is_added_and_minus_inf_bans():
    n = 50
    x = logits_for(n, 1.0, 2)
    best = int(np.argmax(x))
    params = SamplingParams(seed=3, logit_bias={best: float("-inf"), 7: 2.5}, **PLAIN)
    s = Sampler(params, n)
    ids, probs = s.distribution(x)
    assert best not in ids.tolist()
    assert_matches_oracle(s, x, [], params, rtol=1e-6)
    assert best not in {s(x, []) for _ in range(2000)}
    greedy = Sampler(SamplingParams(temperature=0.0, logit_bias={best: float("-inf")}), n)
    assert greedy(x, []) == int(np.argsort(-x)[1])


def test_history_may_be_a_numpy_array():
    n = 40
    x = logits_for(n, 2.0, 6)
    params = SamplingParams(seed=0, repeat_penalty=1.5, frequency_penalty=0.3, penalty_last_n=5, **PLAIN)
    hist = [3, 3, 7, 1, 2, 3, 9]
    a = Sampler(params, n).distribution(x, hist)
    b = Sampler(params, n).distribution(x, np.array(hist, dtype=np.int32))
    assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("kw", [dict(), dict(top_k=0, top_p=1.0, min_p=0.0), dict(top_k=0, top_p=0.9)])
def test_tiny_temperature_acts_greedy_without_nan(kw):
    n = 100000  # > a chunk: the whole-vocabulary paths
    x = logits_for(n, 1.0, 9)
    s = Sampler(SamplingParams(seed=1, temperature=1e-40, **kw), n)
    assert {s(x, []) for _ in range(20)} == {int(np.argmax(x))}
    ids, probs = s.distribution(x)
    assert not np.isnan(probs).any() and probs.max() == 1.0


def test_input_logits_are_not_modified():
    x = logits_for(1000, 2.0, 1)
    before = x.copy()
    s = Sampler(SamplingParams(seed=0, repeat_penalty=1.4, logit_bias={3: -2.0}), 1000)
    for _ in range(3):
        s(x, [3, 4, 5])
    assert np.array_equal(x, before)


# ---- the draws ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(top_k=0, top_p=1.0, min_p=0.0, temperature=1.5),
        dict(top_k=12, top_p=0.9, min_p=0.02, temperature=1.0),
    ],
)
def test_draw_frequencies_follow_the_distribution(kw):
    n, draws = 64, 20000
    x = logits_for(n, 1.5, 11)
    params = SamplingParams(seed=12345, **kw)
    s = Sampler(params, n)
    want = oracle_distribution(oracle_adjust(x, [], params), params)
    counts = np.bincount([s(x, []) for _ in range(draws)], minlength=n)
    assert set(np.flatnonzero(counts).tolist()) <= set(want)
    exp = np.array([want[t] * draws for t in want])
    obs = counts[list(want)]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert chi2 < chi2_upper(len(want) - 1)


def test_draws_over_a_vocabulary_longer_than_a_chunk():
    # plain temperature sampling over 200000 tokens draws through the chunked cumulative sums
    n, draws = 200000, 10000
    x = np.full(n, -30.0, np.float32)
    hot = np.array([3, 65535, 65536, 70000, 131072, 199999])
    x[hot] = np.log([0.1, 0.2, 0.15, 0.25, 0.2, 0.1])
    params = SamplingParams(seed=99, top_k=0, top_p=1.0, min_p=0.0, temperature=1.0)
    s = Sampler(params, n)
    want = oracle_distribution(x, params)
    counts = np.bincount([s(x, []) for _ in range(draws)], minlength=n)
    obs = np.append(counts[hot], draws - counts[hot].sum())
    exp = np.array([want[int(t)] for t in hot] + [1 - sum(want[int(t)] for t in hot)]) * draws
    assert obs[-1] <= 5  # the cold tokens hold ~2e-9 of the mass
    chi2 = float(((obs[:-1] - exp[:-1]) ** 2 / exp[:-1]).sum())
    assert chi2 < chi2_upper(len(hot) - 1)


def _sequence(sampler, steps=60):
    rng = np.random.default_rng(77)  # the logits vary per step, the sampler's stream does the rest
    out, hist = [], [1, 2, 3]
    for _ in range(steps):
        t = sampler(logits_for(500, 1.0, int(rng.integers(1 << 30))), hist)
        out.append(t)
        hist.append(t)
    return out


def test_same_seed_same_sequence_different_seed_differs():
    kw = dict(temperature=1.2, repeat_penalty=1.1)
    a = _sequence(Sampler(SamplingParams(seed=42, **kw), 500))
    b = _sequence(Sampler(SamplingParams(seed=42, **kw), 500))
    c = _sequence(Sampler(SamplingParams(seed=43, **kw), 500))
    assert a == b
    assert a != c


def test_unseeded_samplers_differ_and_record_their_seed():
    s1, s2 = Sampler(SamplingParams(), 500), Sampler(SamplingParams(), 500)
    assert s1.seed != s2.seed
    replay = Sampler(SamplingParams(seed=s1.seed), 500)
    assert _sequence(s1) == _sequence(replay)


@pytest.mark.parametrize("seed", [7, None])
def test_state_round_trip_resumes_the_same_stream(seed):
    params = SamplingParams(seed=seed, temperature=1.1)
    x = logits_for(500, 1.0, 4)
    s = Sampler(params, 500)
    for _ in range(13):
        s(x, [])
    saved = json.loads(json.dumps(s.state()))
    expected = [s(x, []) for _ in range(40)]
    restored = Sampler.from_state(params, 500, saved)
    assert [restored(x, []) for _ in range(40)] == expected


@pytest.mark.parametrize(
    "mutate",
    [
        lambda st: st.pop("state"),
        lambda st: st.update(version=99),
        lambda st: st.update(bit_generator="MT19937"),
        lambda st: st.update(inc="not hex"),
        lambda st: st.update(state=None),
    ],
)
def test_corrupt_state_raises_session_error(mutate):
    st = Sampler(SamplingParams(seed=1), 10).state()
    mutate(st)
    with pytest.raises(SessionFileError):
        Sampler.from_state(SamplingParams(seed=1), 10, st)
