"""`pip install .` (not editable) ships every subpackage: pyproject lists them by hand."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_directory_is_listed():
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    dirs = cfg["package-dir"]
    found = set()
    for name, src in dirs.items():
        for init in (ROOT / src).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / src).parts
            found.add(".".join((name,) + rel))
    missing = found - listed
    assert not missing, f"add to [tool.setuptools] packages: {sorted(missing)}"
