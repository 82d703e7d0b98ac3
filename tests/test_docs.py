"""Every public name has a docstring: edgekv.__all__, the public methods and properties of
LLM and ChatSession, and the objects they hand out (Event, Stats, Completion). PEP 561: py.typed ships."""
import inspect
from pathlib import Path

import edgekv
from edgekv.generate import Completion, Event, Stats


def _public_members(cls):
    for name, member in vars(cls).items():
        if name.startswith("_"):
            continue
        if isinstance(member, property):
            yield name, member.fget
        elif isinstance(member, classmethod):
            yield name, member.__func__
        elif inspect.isfunction(member):
            yield name, member


def test_every_public_name_has_a_docstring():
    missing = []
    for name in edgekv.__all__:
        obj = getattr(edgekv, name)
        if name.startswith("__"):
            continue
        if not (inspect.getdoc(obj) or "").strip():
            missing.append(name)
    for cls in (edgekv.LLM, edgekv.ChatSession, Event, Stats, Completion):
        for name, fn in _public_members(cls):
            if not (fn.__doc__ or "").strip():
                missing.append(f"{cls.__name__}.{name}")
    assert not missing, f"no docstring: {missing}"


def test_py_typed_is_shipped():
    import tomllib

    root = Path(edgekv.__file__).parent
    assert (root / "py.typed").exists()
    cfg = tomllib.loads((root.parent / "pyproject.toml").read_text())
    data = cfg["tool"]["setuptools"].get("package-data", {})
    assert any("py.typed" in files for files in data.values()), data
