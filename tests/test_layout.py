"""The package's layers: each subpackage imports only those below it (no upward imports, so no cycles).
Read from the source, lazy imports inside functions included."""

import ast
from pathlib import Path

import selfspec

# Lowest first. A subpackage may import itself and anything before it in this list.
LAYERS = ["native", "model", "core", "heads", "drafters.layers", "drafters", "api", "tools", "serve", "cli", "selfspec"]
ROOT = Path(selfspec.__file__).parent


def _layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"  # `import selfspec`: its public API (selfspec.api)
    if parts[1] == "drafters" and len(parts) > 2 and parts[2] == "layers":
        return "drafters.layers"
    if parts[1] not in LAYERS:
        return "api"  # a name the package re-exports from selfspec.api (load, SelfSpecModel, ...)
    return parts[1]


def _imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "selfspec":
            if node.module == "selfspec":
                yield from (f"selfspec.{a.name}" for a in node.names)
            else:
                yield node.module
        elif isinstance(node, ast.Import):
            yield from (a.name for a in node.names if a.name.split(".")[0] == "selfspec")


def test_every_subpackage_imports_only_the_layers_below_it():
    upward = []
    for path in ROOT.rglob("*.py"):
        module = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
        here = LAYERS.index("selfspec" if module == "selfspec" else _layer(module))
        for target in _imports(path):
            layer = _layer(target)
            if LAYERS.index(layer) > here:
                upward.append(f"{module} imports {target} ({LAYERS[here]} -> {layer})")
    assert not upward, "\n".join(upward)


def test_the_top_level_holds_only_subpackages_and_the_public_api():
    modules = {p.stem for p in ROOT.glob("*.py")}
    assert modules == {"__init__", "api"}, modules
