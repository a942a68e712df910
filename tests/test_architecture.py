"""The floor plan holds: who may import whom (docs/architecture.md, "Rules").

- torch (and DALI) are imported only under ``loader/``, ``backends/`` and ``checkpoints/``: the rest of the package
  is what a login node and the Slurm prolog run;
- the cache (``cache/``) never imports the copy pipeline, the advice, the CLI, the loader or the hooks;
- no module imports another module's ``_private`` names.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "stagingloader"
TORCH_ROOMS = ("loader", "backends", "checkpoints")
HEAVY = ("torch", "nvidia.dali", "kvikio")
#: modules outside the torch rooms that may reach torch and the loader lazily, inside a function, and why
LAZY_LOADER_USERS = {
    "stagingloader/__init__.py": "DataLoader, StagedFiles... are the package's public names, loaded on first use",
    "stagingloader/cli/demo.py": "the demo trains an epoch through the DataLoader",
    "stagingloader/cli/main.py": "the `ckpt` subcommand's parser lives with the checkpoints (it loads no torch)",
}


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _room(path: Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else ""


def _imports(path: Path) -> list[tuple[str, list[str], bool]]:
    """(absolute module, imported names, at module level) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    package = ["stagingloader", *path.relative_to(PKG).parent.parts]
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, [], id(node) in top) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out.append((mod, [a.name for a in node.names], id(node) in top))
    return out


def _rel(path: Path) -> str:
    return str(path.relative_to(PKG.parent))


def test_torch_is_imported_only_in_its_rooms() -> None:
    bad = []
    for path in _modules():
        if _room(path) in TORCH_ROOMS:
            continue
        for mod, names, top_level in _imports(path):
            targets = [mod] + [f"{mod}.{n}" for n in names]
            if _rel(path) in LAZY_LOADER_USERS and not top_level:
                continue
            if any(t == h or t.startswith(h + ".") for t in targets for h in HEAVY):
                bad.append(f"{_rel(path)} imports {mod}")
            if any(t.startswith(f"stagingloader.{room}") for t in targets for room in TORCH_ROOMS):
                bad.append(f"{_rel(path)} imports {mod} (a torch room)")
    assert bad == []


def test_modules_outside_the_torch_rooms_load_no_torch() -> None:
    names = [".".join(p.relative_to(PKG.parent).with_suffix("").parts).removesuffix(".__init__")
             for p in _modules() if _room(p) not in TORCH_ROOMS and p.name != "__main__.py"]
    code = ("import importlib, sys\n"
            f"for name in {names!r}:\n"
            "    importlib.import_module(name)\n"
            "print(sorted(m for m in ('torch', 'nvidia.dali', 's3fs', 'obstore') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=PKG.parent).stdout
    assert out.strip() == "[]"
    assert len(names) > 30  # every room was imported, not an empty list


def test_the_cache_never_imports_the_pipeline() -> None:
    allowed = ("stagingloader.cache", "stagingloader.errors", "stagingloader.fsio", "stagingloader.units",
               "stagingloader.digest")
    bad = [f"{_rel(p)} imports {target}" for p in _modules() if _room(p) == "cache"
           for mod, names, _ in _imports(p)
           for target in ([f"{mod}.{n}" for n in names] if mod == "stagingloader" else [mod])
           if target.startswith("stagingloader") and not target.startswith(allowed)]
    assert bad == []


def test_no_module_imports_another_modules_private_names() -> None:
    bad = []
    for path in _modules():
        for mod, names, _ in _imports(path):
            if not mod.startswith("stagingloader"):
                continue
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private or any(part.startswith("_") and not part.startswith("__") for part in mod.split(".")):
                bad.append(f"{_rel(path)}: from {mod} import {', '.join(private) or '...'}")
    assert bad == []


@pytest.mark.parametrize("room", ["staging", "cache", "advice", "cli", "loader", "backends", "slurm"])
def test_every_room_exists_and_says_what_it_holds(room: str) -> None:
    init = PKG / room / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{init} needs a docstring saying what the room holds"


def test_the_floor_plan_is_documented() -> None:
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    documented = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `") and ".py" in line}
    actual = {str(p.relative_to(PKG)) for p in _modules() if p.name not in ("__init__.py", "__main__.py")}
    assert actual - documented == set(), "modules missing from docs/architecture.md"
    assert documented - actual == set(), "docs/architecture.md names modules that do not exist"
