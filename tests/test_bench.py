"""`edgekv bench` and `edgekv perplexity` end to end on a tiny synthetic model (speed is never
asserted; the tables' shape and sanity are)."""
import json

from edgekv.cli import main


def test_bench_table_and_json(tmp_path, capsys):
    """What every run produces, whatever the machine's load: one row per test and cache type,
    with each field present, typed and in range. Never a speed: on a loaded machine a tiny
    model's tg4 has swung from 12 to 5,545 tok/s, and its bandwidth share rounds to 0.0."""
    from edgekv.synth import write_synthetic

    path = write_synthetic(tmp_path / "t.gguf", arch="llama", size="tiny", qtype="q4_0", progress=False)
    assert main(["bench", str(path), "-p", "16", "-n", "4", "-d", "0,8", "-r", "2", "--kv", "f16,int8", "-t", "1",
                 "-q", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["rows"]
    assert out["synthetic"] is True  # edgekv synth files are marked: their speed counts, their text does not
    assert out["model"] == str(path) and out["read_bandwidth_gb_s"] > 0
    assert sorted((r["test"], r["kv"]) for r in rows) == sorted(
        (t, kv) for t in ("pp16", "tg4", "pp16 @ d8", "tg4 @ d8") for kv in ("f16", "int8"))
    for r in rows:
        assert r["runtime"] == "edgekv" and r["threads"] == 1 and "ratio_vs_llama_cpp" not in r
        assert isinstance(r["tokens_per_s"], float) and r["tokens_per_s"] > 0
        assert isinstance(r["stddev"], float) and r["stddev"] >= 0
        assert r["kv_mib"] >= 0 and r["peak_rss_mib"] > 0  # kv_mib: a tiny cache rounds to 0.0 MiB
        decode = r["test"].startswith("tg")
        assert ("bandwidth_share" in r) == decode and ("weight_gb_per_s" in r) == decode
        assert ("share_of_weights_read" in r) == decode and ("weights_read_gb_per_s" in r) == decode
        if decode:  # rounded to 3 places: a tiny model's share is 0.0 even when measured
            assert r["bandwidth_share"] >= 0 and r["weight_gb_per_s"] >= 0
            assert r["weights_read_gb_per_s"] > 0 and r["share_of_weights_read"] >= 0


def test_decode_arrays_are_the_matrices_once(tmp_path):
    """The plain read a decode is compared against covers what a decode step reads: every matrix
    of every layer and the output once (a tied output: the embedding table once), nothing else."""
    import numpy as np

    from edgekv import LLM
    from edgekv.bench import decode_arrays
    from edgekv.gguf_file import GGUFFile
    from edgekv.synth import write_synthetic

    path = write_synthetic(tmp_path / "t.gguf", arch="llama", size="tiny", qtype="q4_0", progress=False)
    f = GGUFFile(path)
    want = sum(t.nbytes for name, t in f.tensors.items() if len(t.shape) == 2 and name != "token_embd.weight")
    if "output.weight" not in f.tensors:
        want += f.tensors["token_embd.weight"].nbytes
    f.close()
    arrays = decode_arrays(LLM(path, n_ctx=16).model)
    assert len({id(a) for a in arrays}) == len(arrays) and all(isinstance(a, np.ndarray) for a in arrays)
    assert sum(a.nbytes for a in arrays) == want


def test_read_bytes_sums_every_part():
    """membw's plain read: each thread's contiguous part summed as 64 wrapping byte lanes (numpy's
    sums of the same bytes); the bytes it reports are the parts' whole 256-byte steps."""
    import numpy as np

    from edgekv.kernels_cpu import membw

    a = np.random.default_rng(0).integers(0, 256, 100_003, dtype=np.uint8)
    for chunks in (1, 2, 3):
        sink = np.empty((chunks, 64), np.uint8)
        n = membw._read_bytes(a, chunks, sink)
        step = a.size // chunks // 256 * 256
        assert n == chunks * step
        for c in range(chunks):
            part = a[c * step : (c + 1) * step].reshape(-1, 64)
            assert (sink[c] == part.sum(axis=0, dtype=np.uint64) % 256).all()


def test_perplexity_json(tmp_path, capsys):
    from edgekv.synth import write_synthetic

    path = write_synthetic(tmp_path / "t.gguf", arch="llama", size="tiny", qtype="q8_0", progress=False)
    text = tmp_path / "t.txt"
    text.write_text("the model reads the text and the cache keeps the keys " * 20)
    assert main(["perplexity", str(path), str(text), "--ctx", "32", "--kv", "int8", "--kl-base", "f16", "-q"]) == 0
    res = json.loads(capsys.readouterr().out)["results"]
    assert res["f16"]["ppl"] > 1 and res["int8"]["mean_kl"] >= 0 and 0 <= res["int8"]["top1_agreement"] <= 1


def test_plot_without_matplotlib_fails_before_benchmarking(tmp_path, capsys, monkeypatch):
    """A long bench run must not end in 'matplotlib missing': the check comes first."""
    import sys

    import edgekv.bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(edgekv.bench, "run_bench", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran")))
    assert main(["bench", str(tmp_path / "any.gguf"), "--plot", str(tmp_path / "d.png")]) == 1
    assert "pip install 'edgekv[plot]'" in capsys.readouterr().err


def test_bench_background_load_rows_side_by_side(tmp_path, capsys):
    """--background-load N: each test quiet and beside N busy processes, the loaded row's ratio
    to the quiet one; the busy processes are gone afterwards."""
    import os

    from edgekv.synth import write_synthetic

    path = write_synthetic(tmp_path / "t.gguf", arch="llama", size="tiny", qtype="q4_0", progress=False)
    before = set(os.listdir("/proc")) if os.path.isdir("/proc") else set()
    assert main(["bench", str(path), "-p", "8", "-n", "2", "-r", "1", "-t", "auto,1", "--background-load", "1",
                 "-q", "-o", "json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["background_load"] == 1
    rows = out["rows"]
    auto = next(str(r["threads"]) for r in rows if str(r["threads"]).startswith("auto<="))
    assert sorted((r["test"], str(r["threads"]), r["load"]) for r in rows) == sorted(
        (test, threads, load) for test in ("pp8", "tg2") for threads in (auto, "1") for load in (0, 1))
    for r in rows:
        assert ("ratio_vs_quiet" in r) == (r["load"] == 1) and r["tokens_per_s"] > 0
    if before:  # no busy child left running
        for pid in set(os.listdir("/proc")) - before:
            try:
                cmd = open(f"/proc/{pid}/cmdline", "rb").read()
            except OSError:
                continue
            assert b"while True: pass" not in cmd


def test_compare_runs_the_runtimes_in_turn_when_both_do_not_fit(tmp_path, monkeypatch):
    """Where twice the weights do not fit in memory, --compare loads one runtime at a time (else
    the second would be timed reading from disk); each row's peak RSS is then its own runtime's."""
    import sys
    import types
    import weakref

    from edgekv import bench
    from edgekv.synth import write_synthetic

    path = write_synthetic(tmp_path / "t.gguf", arch="llama", size="tiny", qtype="q4_0", progress=False)
    alive, seen = weakref.WeakSet(), []

    class Fake(bench.EdgekvRunner):  # another runtime: edgekv again, under llama.cpp's name
        name = "llama.cpp"

    def track(cls):
        class Tracked(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                alive.add(self)

            def run(self, case, rng, between=None):
                seen.append((self.name, len(alive)))
                return super().run(case, rng, between)
        return Tracked

    monkeypatch.setitem(sys.modules, "llama_cpp", types.ModuleType("llama_cpp"))
    monkeypatch.setattr(bench, "LlamaCppRunner", track(Fake))
    monkeypatch.setattr(bench, "EdgekvRunner", track(bench.EdgekvRunner))
    monkeypatch.setattr(bench, "available_memory", lambda: path.stat().st_size)  # room for one copy
    result = bench.run_bench(path, prompt=(8,), gen=(2,), reps=1, threads=(1,), compare=True, progress=False)
    assert result["in_turn"] and "in turn" in bench.format_table(result)
    assert [n for n, _ in seen] == ["edgekv"] * 4 + ["llama.cpp"] * 4  # warm-up and rep of pp8, tg2
    assert {k for _, k in seen} == {1}  # never both loaded
    assert {r.runtime for r in result["rows"]} == {"edgekv", "llama.cpp"}
    assert all(r.peak_rss > 0 for r in result["rows"])

    monkeypatch.setattr(bench, "available_memory", lambda: 64 * path.stat().st_size)
    seen.clear()
    assert not bench.run_bench(path, prompt=(8,), gen=(2,), reps=1, threads=(1,), compare=True,
                               progress=False)["in_turn"]
    assert [n for n, _ in seen][:2] == ["edgekv", "llama.cpp"]  # interleaved rep by rep


def test_bench_fills_a_depth_once_and_trims_back(tmp_path, monkeypatch):
    """At depth d each rep starts from the same d tokens, prefilled once and trimmed back before
    the next rep (re-prefilling a 4K depth every rep took most of an hour on 2 cores), and the
    trimmed cache is the freshly filled one: the next token's logits are the same bits."""
    import numpy as np

    from edgekv import bench
    from edgekv.synth import write_synthetic

    path = write_synthetic(tmp_path / "t.gguf", arch="llama", size="tiny", qtype="q4_0", progress=False)
    r = bench.EdgekvRunner(path, 64, "int8", 1)
    calls, forward = [], r.llm.forward
    monkeypatch.setattr(r.llm, "forward", lambda ids, cache, pos, **kw: calls.append((len(ids), pos))
                        or forward(ids, cache, pos, **kw))
    for test in ("tg4", "pp6", "tg4"):
        r.run(bench.Case(test, int(test[2:]), 8, "int8", 1), np.random.default_rng(0))
    assert [c for c in calls if c[1] == 0] == [(8, 0)]  # the depth, once
    assert calls[1:] == [(1, 8), (1, 9), (1, 10), (1, 11), (6, 8), (1, 8), (1, 9), (1, 10), (1, 11)]
    trimmed = r.at_depth(8, np.random.default_rng(0))
    fresh = r.llm.new_cache()
    forward(np.random.default_rng(0).integers(0, r.vocab, 8).tolist(), fresh, 0)
    np.testing.assert_array_equal(forward([5], trimmed, 8), forward([5], fresh, 8))
