"""The optional CUDA path.

The GPU kernels and the CUDA backend are tested under numba's CUDA simulator, which must be
chosen before numba is first imported: tests/gpu/sim_*.py run in a subprocess with
NUMBA_ENABLE_CUDASIM=1 (so the simulator cannot leak into the rest of the suite). Nothing is
skipped: without a usable simulator that test fails with the subprocess's reason. The rest
checks device selection here, where (in CI) no GPU is present.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgekv.backends import get_backend
from edgekv.errors import DeviceError, EdgekvError

ROOT = Path(__file__).resolve().parent.parent


def _clean_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("NUMBA_ENABLE_CUDASIM")}
    env.update(extra)
    return env


def test_gpu_kernels_and_backend_under_the_simulator():
    t0 = time.perf_counter()
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "python_files=sim_*.py",
         "--durations=5", str(ROOT / "tests" / "gpu")],
        cwd=ROOT, env=_clean_env(NUMBA_ENABLE_CUDASIM="1"), capture_output=True, text=True, timeout=900)
    out = r.stdout + r.stderr
    print(out[-3000:], f"\nsimulator run: {time.perf_counter() - t0:.1f} s")
    assert r.returncode == 0, out[-6000:]
    assert " passed" in out and "skipped" not in out and "no tests ran" not in out


def test_cpu_path_imports_nothing_gpu(tmp_path):
    """Loading and running a model on the CPU imports neither numba.cuda nor kernels_gpu."""
    code = f"""
import sys
from edgekv.synth import write_synthetic
import edgekv
p = write_synthetic({str(tmp_path / 'm.gguf')!r}, "llama", "tiny", "q8_0", progress=False, n_layer=1, n_embd=64,
                    n_head=2, n_head_kv=1, n_ff=64, n_vocab=264)
llm = edgekv.load(str(p), n_ctx=16, progress=False)
assert llm.backend.name == "cpu"
llm.logits([1, 2, 3])
bad = sorted(m for m in sys.modules if m.startswith(("numba.cuda", "edgekv.kernels_gpu", "edgekv.backends.cuda")))
print("GPU MODULES:", bad)
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=_clean_env(), capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "GPU MODULES: []" in r.stdout, r.stdout


def test_device_selection():
    from edgekv.backends.cuda import cuda_unusable

    reason = cuda_unusable()
    if reason:  # CI: no GPU. cuda says why in one line; auto falls back to the CPU
        with pytest.raises(DeviceError) as e:
            get_backend("cuda")
        msg = str(e.value)
        assert "\n" not in msg and msg.startswith("device 'cuda' is not usable: ") and reason in msg
        assert get_backend("auto").name == "cpu"
        assert get_backend("auto", gpu_layers=3).name == "cpu"
    else:  # a machine with a GPU
        assert get_backend("cuda").name == "cuda" and get_backend("auto").name == "cuda"
    with pytest.raises(DeviceError, match="gpu_layers needs device cuda or auto"):
        get_backend("cpu", gpu_layers=2)
    with pytest.raises(DeviceError, match="unknown device"):
        get_backend("tpu")
    assert issubclass(DeviceError, EdgekvError)


def test_cli_device_flags():
    from edgekv.cli import build_parser

    a = build_parser().parse_args(["run", "m.gguf", "hi", "--device", "cuda", "--gpu-layers", "12"])
    assert (a.device, a.gpu_layers) == ("cuda", 12)
    a = build_parser().parse_args(["chat", "--device", "auto"])
    assert (a.device, a.gpu_layers) == ("auto", None)
