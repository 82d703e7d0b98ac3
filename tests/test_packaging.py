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


# Data flows one way (README, "Layout"): each module imports only from its own layer or below.
LAYERS = [
    ("file", {"edgekv.errors", "edgekv.quants", "edgekv.kvkinds", "edgekv.validate", "edgekv.gguf_file",
              "edgekv.rope", "edgekv.hub"}),
    ("kernels", {"edgekv.kernels_cpu", "edgekv.kernels_gpu"}),
    ("models", {"edgekv.models"}),  # beside the kernels: neither knows the other
    ("cache, backends", {"edgekv.kvcache", "edgekv.pages", "edgekv.evict", "edgekv.kvfile", "edgekv.backends"}),
    ("generation", {"edgekv.sampling", "edgekv.generate", "edgekv.beam", "edgekv.session", "edgekv.prompt_cache",
                    "edgekv.tokenizer", "edgekv.chat_template", "edgekv.llm"}),
    ("API, CLI", {"edgekv", "edgekv.cli", "edgekv.bench", "edgekv.warmup", "edgekv.synth", "edgekv.perplexity",
                  "edgekv.server"}),
]


def _layer(module: str) -> int:
    """Index in LAYERS of the longest name that is `module` or a package holding it."""
    hits = [(len(n), i) for i, (_, names) in enumerate(LAYERS) for n in names
            if module == n or (n != "edgekv" and module.startswith(n + "."))]
    assert hits, f"{module} is in no layer of LAYERS"
    return max(hits)[1]


def _imports() -> dict[str, set[str]]:
    """module -> the edgekv modules it imports (from its source, relative imports resolved)."""
    import ast
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib

    files = {}
    for pkg, src in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].items():
        for p in (ROOT / src).glob("*.py"):
            files[pkg if p.stem == "__init__" else f"{pkg}.{p.stem}"] = p
    for p in (ROOT / "edgekv" / "backends").glob("*.py"):
        files["edgekv.backends" if p.stem == "__init__" else f"edgekv.backends.{p.stem}"] = p
    graph = {}
    for mod, p in files.items():
        base = mod.split(".") if p.stem == "__init__" else mod.split(".")[:-1]
        deps = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom):
                pkg = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else node.module
                deps.update(f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in files else pkg for a in node.names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[mod] = {d for d in deps if d in files and d != mod}
    return graph


def test_imports_run_one_way():
    graph = _imports()
    assert {"edgekv.validate", "edgekv.models.llama", "edgekv.kernels_cpu.qmatmul", "edgekv.backends.cpu"} <= set(graph)
    bad = []
    for mod, deps in graph.items():
        for d in deps:
            lm, ld = _layer(mod), _layer(d)
            if ld > lm or (ld == lm == 1 and d.split(".")[1] != mod.split(".")[1]):  # kernels_cpu, _gpu apart
                bad.append(f"{mod} ({LAYERS[lm][0]}) imports {d} ({LAYERS[ld][0]})")
    assert not bad, "\n".join(sorted(bad))
