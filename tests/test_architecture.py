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
#: the rooms that may import torch; ``dataloader`` is the one module above ``loader/`` and ``backends/`` that
#: chooses between them (the public DataLoader), loaded on first use like them
TORCH_ROOMS = ("loader", "backends", "checkpoints", "dataloader", "peers")
HEAVY = ("torch", "nvidia.dali", "kvikio")
#: modules outside the torch rooms that may reach torch and the loader lazily, inside a function, and why
LAZY_LOADER_USERS = {
    "stagingloader/__init__.py": "DataLoader, StagedFiles... are the package's public names, loaded on first use",
    "stagingloader/cli/demo.py": "the demo trains an epoch through the DataLoader",
    "stagingloader/cli/main.py": "the `ckpt` subcommand's parser lives with the checkpoints (it loads no torch)",
    "stagingloader/cli/commands.py": "`stage --peers` runs the nodes' exchange (torch.distributed), loaded only then",
    "stagingloader/slurm/hooks.py": "peers=yes: the job's port and the site's key file (no torch), only then",
    "stagingloader/slurm/preflight.py": "prolog --dry-run with peers=yes: the job's port (no torch), only then",
    "stagingloader/slurm/worker.py": "peers=yes: the nodes' exchange, loaded only then",
}


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _room(path: Path) -> str:
    """A module's room: its folder under the package, or, for a module at the package's root, its own name."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


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
               "stagingloader.digest", "stagingloader.procid", "stagingloader.retry")  # the ground floor
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


@pytest.mark.parametrize("room", ["sources", "engine", "staging", "streaming", "cache", "advice", "cli", "loader",
                                  "backends", "slurm", "checkpoints"])
def test_every_room_exists_and_says_what_it_holds(room: str) -> None:
    init = PKG / room / "__init__.py"
    assert ast.get_docstring(ast.parse(init.read_text())), f"{init} needs a docstring saying what the room holds"


def test_the_floor_plan_is_documented() -> None:
    text = (PKG.parent / "docs" / "architecture.md").read_text()
    documented = {line.split("`")[1] for line in text.splitlines() if line.startswith("| `") and ".py" in line}
    actual = {str(p.relative_to(PKG)) for p in _modules() if p.name not in ("__init__.py", "__main__.py")}
    actual |= {str(p.relative_to(PKG)) for p in PKG.rglob("*.c") if "_vendor" not in p.parts}  # compiled parts
    assert actual - documented == set(), "modules missing from docs/architecture.md"
    assert documented - actual == set(), "docs/architecture.md names modules that do not exist"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (lazy imports in functions too; ``TYPE_CHECKING`` ones set aside)."""
    modules = {_module_name(p): p for p in _modules()}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for node in ast.walk(tree)
                       if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
                       for n in ast.walk(node)}
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(package[: len(package) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle() -> None:
    graph = _import_graph()
    assert len(graph) > 30 and any(graph.values())
    assert _circles(graph) == []


def test_a_circle_is_found_where_there_is_one() -> None:  # the check itself can fail
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


#: the pipeline's rooms in the order data flows: a room imports only the rooms before it
PIPELINE = ("sources", "engine", "staging", "streaming")


def test_the_pipeline_rooms_import_only_upstream() -> None:
    bad = []
    for name, targets in _import_graph().items():
        room = name.split(".")[1] if name.count(".") >= 2 else ""
        if room not in PIPELINE:
            continue
        later = PIPELINE[PIPELINE.index(room) + 1:]
        bad += [f"{name} imports {t}" for t in sorted(targets) if t.split(".")[1] in later]
    assert bad == []


def test_the_loader_does_not_import_the_backends() -> None:
    bad = [f"{name} imports {t}" for name, targets in _import_graph().items() if name.startswith("stagingloader.loader")
           for t in sorted(targets) if t.startswith("stagingloader.backends")]
    assert bad == []


def test_no_room_holds_more_than_15_modules() -> None:
    sizes = {room.name: len([p for p in room.glob("*.py") if p.name != "__init__.py"])
             for room in PKG.iterdir() if (room / "__init__.py").exists()}
    assert len(sizes) >= 10
    assert {room: n for room, n in sizes.items() if n > 15} == {}


def test_one_module_reads_a_process_identity() -> None:
    """``/proc/PID/stat`` (a process's start time and state) is read in ``procid.py`` alone: one rule of when a
    process is gone (a zombie is), not one copy per room."""
    readers = set()
    for path in _modules():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.JoinedStr):
                text = "".join(v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str))
                if text.startswith("/proc/") and text.endswith("/stat"):
                    readers.add(_rel(path))
    assert readers == {"stagingloader/procid.py"}


ADAPTER = "stagingloader/loader/torchdata_compat.py"
#: private names of other libraries reached outside the torchdata adapter, and why they are not torchdata's
OTHER_PRIVATE = {
    "_C": "torch._C: the cuFile check in backends/select.py (torch's, not torchdata's)",
    "_gds_register_handle": "torch._C's cuFile registration, probed in backends/select.py",
    "_mmap": "numpy.memmap's mapping, closed early in loader/arrays.py",
}


def test_torchdata_is_imported_by_its_adapter_alone() -> None:
    bad = [f"{_rel(p)} imports {mod}" for p in _modules() if _rel(p) != ADAPTER
           for mod, _names, _ in _imports(p) if mod == "torchdata" or mod.startswith("torchdata.")]
    assert bad == []


def test_private_names_of_torch_and_torchdata_are_reached_only_through_the_adapter() -> None:
    """Outside the adapter, every ``x._name`` the loader reaches is one the package itself defines (its own
    attributes and methods), so a torchdata release that moves a private field breaks one module, whose tests
    say which field."""
    ours: set[str] = set()  #: the names the package defines (what the adapter sets is torchdata's, not ours)
    for path in _modules():
        if _rel(path) == ADAPTER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                ours.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                ours.add(node.id)
            elif isinstance(node, ast.arg):
                ours.add(node.arg)
    bad = []
    for path in _modules():
        if _room(path) not in ("loader", "backends", "dataloader") or _rel(path) == ADAPTER:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__") \
                    and node.attr not in ours and node.attr not in OTHER_PRIVATE:
                bad.append(f"{_rel(path)}:{node.lineno} .{node.attr}")
    assert bad == []
