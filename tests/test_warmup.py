"""The kernels a chat needs are compiled before its first prompt (edgekv/warmup.py): after
prepare() no turn compiles; a cold numba cache shows a bar at once and Ctrl-C stops it
cleanly; `edgekv warmup` works. No test here pays a whole cold compile: the cold one stops
at the bar."""
import importlib
import os
import subprocess
import sys
import time

import pytest
from numba.core.registry import CPUDispatcher

from conftest import model_path
from test_cli_signals import ENV, Terminal, _clean


def _dispatchers():
    for mod in ("qmatmul", "igemm", "ops", "kvquant", "block", "evict"):
        m = importlib.import_module(f"edgekv.kernels_cpu.{mod}")
        for name, d in vars(m).items():
            if isinstance(d, CPUDispatcher) and d.py_func.__module__ == m.__name__:  # not imported ones
                yield f"{mod}.{name}", d


def _signatures() -> dict:
    """Every kernel's signatures in this process (loaded from the disk cache or compiled)."""
    return {name: len(d.signatures) for name, d in _dispatchers()}


@pytest.mark.parametrize("key,kv", [("smollm2", "int8"), ("gemma3", "f16"), ("smollm2", "int4")])
def test_turns_after_prepare_compile_nothing(key, kv):
    """The groups alone (synthetic weights) cover a real chat: its turns add no signature."""
    import edgekv
    from edgekv import warmup

    warmup.prepare(progress=False, force=True, workers=1)
    llm = edgekv.load(model_path(key), n_ctx=256, kv=kv, progress=False)
    before = _signatures()
    sess = llm.session(max_tokens=6, temperature=0.7, seed=0)
    long_turn = "Tell me, in some detail and with an example or two, " * 6 + "why the sky is blue."
    for msg in ("Hi", long_turn, "Thanks"):  # a short first prompt, a long one, a short one
        list(sess.send(msg))
    after = _signatures()
    assert after == before, {k: (before.get(k), v) for k, v in after.items() if before.get(k) != v}


def test_kernels_list_is_what_the_groups_compile():
    """warmup.KERNELS (the cold/warm probe) names exactly the disk-cached kernels the groups
    use, counted in a fresh process so that no other test's kernels count."""
    code = """
import importlib
from numba.core.registry import CPUDispatcher
from edgekv import warmup
warmup.prepare(progress=False, force=True, workers=1)
for mod in ("qmatmul", "igemm", "ops", "kvquant", "block", "evict"):
    m = importlib.import_module("edgekv.kernels_cpu." + mod)
    for name, d in vars(m).items():
        if isinstance(d, CPUDispatcher) and d.py_func.__module__ == m.__name__ and d.signatures \
                and type(d._cache).__name__ != "NullCache":
            print(mod + "." + name)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    from edgekv import warmup

    assert sorted(out.stdout.split()) == sorted(f"{m}.{n}" for m, n in warmup.KERNELS)


def test_prepare_on_a_warm_cache_returns_at_once():
    from edgekv import warmup

    warmup.prepare(progress=False)  # whatever this cache lacks, and every kernel loaded
    t = time.perf_counter()
    assert not warmup.cold()
    assert warmup.prepare(progress=False) == 0
    assert time.perf_counter() - t < 2  # a look at the cache index files, nothing run again


def test_prepare_on_a_warm_cache_loads_every_kernel_in_a_new_process():
    """numba reads a cached kernel's machine code on its first call: prepare makes that call,
    so a new process's first prompt does not (its time to first token, bench/prompt_cache.py)."""
    from edgekv import warmup

    warmup.prepare(progress=False)  # the disk cache warm
    code = """
import importlib
from edgekv import warmup
assert not warmup.cold()
print(warmup.prepare(progress=False))
for mod, name in warmup.KERNELS:
    print(mod + "." + name, len(getattr(importlib.import_module("edgekv.kernels_cpu." + mod), name).signatures))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
    compiled, *loaded = out.stdout.splitlines()
    assert compiled == "0" and len(loaded) == len(warmup.KERNELS)
    assert [line for line in loaded if line.endswith(" 0")] == []  # none left to load on first use


def test_warmup_command():
    out = subprocess.run([sys.executable, "-m", "edgekv.cli", "warmup", "-q"], capture_output=True, text=True,
                         timeout=600, env=ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("kernels ready") and "Traceback" not in out.stderr
    bad = subprocess.run([sys.executable, "-m", "edgekv.cli", "warmup", "/nope/x.gguf", "-q"], capture_output=True,
                         text=True, timeout=120, env=ENV)
    assert bad.returncode != 0 and "Traceback" not in bad.stderr


def _workers_alive(cache_dir) -> list[int]:
    """Worker processes (python -m edgekv.warmup) compiling into cache_dir."""
    pids = []
    for p in os.listdir("/proc"):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{p}/environ", "rb") as f:
                env = f.read()
        except (OSError, ValueError):
            continue
        if b"edgekv.warmup" in cmd and str(cache_dir).encode() in env:
            pids.append(int(p))
    return pids


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("verb", [["chat"], ["run", "-n", "4"]])
def test_cold_cache_chat_shows_the_bar_and_ctrl_c_stops_it(tmp_path, verb):
    """A fresh install (empty numba cache): the chat (and run) says what it prepares before the
    first prompt; Ctrl-C there exits with one line and leaves no worker compiling."""
    env = dict(ENV, NUMBA_CACHE_DIR=str(tmp_path))
    argv = [verb[0], str(model_path("smollm2")), *(["Hello"] if verb[0] == "run" else []), *verb[1:], "--ctx", "256"]
    t = Terminal([sys.executable, "-m", "edgekv.cli", *argv], env)
    t.read_until("compiling kernels", timeout=180)
    t.read_until("%", timeout=60)  # how far along
    assert "/help for commands" not in t.screen  # before the prompt
    from edgekv.warmup import _workers

    deadline = time.time() + 60
    while _workers() > 1 and not _workers_alive(tmp_path):  # the compile is under way in workers
        assert time.time() < deadline, t.screen[-2000:]
        time.sleep(0.1)
    t.send("\x03")
    assert t.wait(timeout=60) == 130, t.screen[-2000:]
    assert "edgekv: interrupted" in t.screen
    _clean(t.screen)
    deadline = time.time() + 10
    while _workers_alive(tmp_path):
        assert time.time() < deadline, "a warm-up worker outlived the chat"
        time.sleep(0.1)


def test_stale_kernel_cache_is_dropped(tmp_path):
    """A compiled kernel holds copies of the kernels it calls from other files, and numba checks
    only its own file's stamp: the cache is dropped when any kernel source changes (its hash)."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    imp = [sys.executable, "-c", "import edgekv.kernels_cpu"]
    subprocess.run(imp, env=env, check=True)
    (stamp,) = tmp_path.rglob("edgekv-kernels.sha256")
    old = stamp.parent / "block._block_core-1.py311.nbi"
    old.write_bytes(b"compiled before")
    subprocess.run(imp, env=env, check=True)
    assert old.exists()  # the sources did not change: the cache stays
    stamp.write_text("hash of other sources")
    subprocess.run(imp, env=env, check=True)
    assert not old.exists() and stamp.read_text() != "hash of other sources"


def test_worker_imports_this_edgekv_whatever_the_working_directory(tmp_path):
    """`pip install . && edgekv chat` runs in the source tree, whose edgekv/ is not the
    installed package (kernels_cpu sits beside it): a worker must import the parent's edgekv,
    not the one in its working directory. A decoy package there that fails on import."""
    from edgekv import warmup

    warmup.prepare(progress=False)  # the disk cache warm: the worker only loads its kernels
    (tmp_path / "edgekv").mkdir()
    (tmp_path / "edgekv" / "__init__.py").write_text("raise SystemExit('the decoy edgekv was imported')\n")
    out = subprocess.run(warmup._worker_cmd("matvec"), cwd=tmp_path, capture_output=True, text=True, timeout=600,
                         env=ENV)
    assert out.returncode == 0, out.stderr[-2000:]
