"""The reference docs are read and compared with the code, as ``__all__`` is pinned in tests/test_api.py: a doc that
drifts from the code fails here, naming the line to fix.

* docs/api.md's table: a signature written in the first column (``stage(src, root="auto", *, ...)``) is every
  parameter of the code's ``inspect.signature``, in order, of the same kind, with the same default; ``...`` in it
  stands for the parameters the class shares with its base (``DataLoader``: torchdata's ``StatefulDataLoader``),
  so only its extras are written out.  In the second column, ``.attr`` and ``name(args)`` must name what exists,
  with parameters that exist.  Every name of ``stagingloader.__all__`` is documented there or in the error tree.
* the error tree of docs/api.md: every class of ``stagingloader.errors``, under its base, with the builtins it mixes
  in and its exit code.
* the exit-code table of docs/errors.md: one row per ``ExitCode``, and every error class in the row of its code.
* every ``:mod:`` reference in the package's docstrings names a module that exists.

Everything compared is read from the code when the test runs, so a change of a signature needs only its doc.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import importlib
import inspect
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import stagingloader as sl
from stagingloader import errors

REPO = Path(__file__).resolve().parents[2]
API = REPO / "docs" / "api.md"
ERRORS = REPO / "docs" / "errors.md"

ERROR_CLASSES = {c.__name__: c for c in vars(errors).values()
                 if isinstance(c, type) and issubclass(c, errors.StagingError)}
ELIDED = "__elided__"  # what ``...`` in a documented signature becomes, to parse it
CODE = re.compile(r"`([^`]+)`")
CALL = re.compile(r"^(\.?)([A-Za-z_][\w.]*)\((.*)\)$", re.S)


# ---- reading the docs ----------------------------------------------------------------------------------------------

@dataclass
class Row:
    """A row of a markdown table: the line it starts on and its cells."""

    line: int
    cells: list[str]

    @property
    def where(self) -> str:
        return f"line {self.line}"


def table_rows(path: Path, header: str) -> list[Row]:
    """The rows of the table whose header row starts with ``header`` (``| name |``)."""
    rows: list[Row] = []
    inside = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith(header):
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not re.fullmatch(r"\|[-| :]+\|", line):
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            rows.append(Row(n, cells))
    assert rows, f"{path.name} has no table headed {header!r}"
    return rows


@dataclass
class Param:
    name: str
    kind: inspect._ParameterKind
    default: Any  # inspect.Parameter.empty when none

    def show(self) -> str:
        star = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}.get(self.kind, "")
        default = "" if self.default is inspect.Parameter.empty else f"={self.default!r}"
        return f"{star}{self.name}{default}"


def doc_params(text: str) -> list[Param]:
    """The parameters of a documented signature's ``(...)``, parsed as Python (``...`` kept as one placeholder)."""
    text = re.sub(r"(^|,)\s*\.\.\.\s*(?=,|$)", rf"\1 {ELIDED}", text)
    tree = ast.parse(f"def _({text}): pass").body[0]
    assert isinstance(tree, ast.FunctionDef)
    a = tree.args

    def value(node: ast.expr | None) -> Any:
        if node is None:
            return inspect.Parameter.empty
        try:
            return ast.literal_eval(node)
        except ValueError:
            return ast.unparse(node)

    positional = a.posonlyargs + a.args
    pos_defaults = [None] * (len(positional) - len(a.defaults)) + list(a.defaults)
    kinds = ([inspect.Parameter.POSITIONAL_ONLY] * len(a.posonlyargs)
             + [inspect.Parameter.POSITIONAL_OR_KEYWORD] * len(a.args))
    out = [Param(p.arg, k, value(d)) for p, k, d in zip(positional, kinds, pos_defaults)]
    if a.vararg:
        out.append(Param(a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.empty))
    out += [Param(p.arg, inspect.Parameter.KEYWORD_ONLY, value(d)) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        out.append(Param(a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, inspect.Parameter.empty))
    return out


def _accepts_nothing(p: inspect.Parameter) -> bool:
    """``**unknown: Never``: there only to name a misspelt keyword in its error, not a parameter to document."""
    never = str(p.annotation).rsplit(".", 1)[-1] in ("Never", "NoReturn")
    return never and p.kind in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def code_params(obj: Any) -> list[Param]:
    """``inspect.signature(obj)``; a dataclass field's ``default_factory`` stands for its default."""
    fields = {f.name: f for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else {}
    out = []
    for p in inspect.signature(obj).parameters.values():
        if _accepts_nothing(p):
            continue
        default = p.default
        if p.name in fields and fields[p.name].default_factory is not dataclasses.MISSING:
            default = fields[p.name].default_factory()
        out.append(Param(p.name, p.kind, default))
    return out


def resolve(name: str, owners: list[Any]) -> Any:
    """A documented name: a public name of stagingloader, a dotted path from it, or an attribute of ``owners``."""
    for owner in owners:
        if isinstance(owner, type) and has_attribute(owner, name):
            return getattr(owner, name, None)
    if name in sl.__all__:
        return public(name)
    if name.startswith("stagingloader."):
        module, _, attr = name.rpartition(".")
        with _quiet_import():
            return getattr(importlib.import_module(module), attr, None)
    return None


class _quiet_import:
    """Nothing found, rather than an error: a module that does not import, a function without source."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], (ImportError, OSError, TypeError))  # type: ignore[arg-type]


def has_attribute(cls: type, name: str) -> bool:
    """A class attribute, a dataclass field, an annotated attribute, or one its ``__init__`` sets on ``self``."""
    if hasattr(cls, name) or any(name in getattr(k, "__annotations__", {}) for k in cls.__mro__):
        return True
    for klass in cls.__mro__:
        init = vars(klass).get("__init__")
        if init is not None and inspect.isfunction(init):
            with _quiet_import():
                if re.search(rf"\bself\.{re.escape(name)}\s*(:[^=]*)?=", inspect.getsource(init)):
                    return True
    return False


# ---- docs/api.md's table ----------------------------------------------------------------------------------------

API_ROWS = table_rows(API, "| name |")


def _signatures(row: Row) -> Iterator[tuple[str, str | None, str | None]]:
    """The first column's entries: (name, the text in its parentheses or None, the documented return or None)."""
    first = row.cells[0]
    for m in re.finditer(r"`([^`]+)`(?:\s*->\s*`([^`]+)`)?", first):
        call = CALL.match(m.group(1))
        if call:
            yield call.group(2), call.group(3), m.group(2)
        else:
            yield m.group(1), None, m.group(2)


def _row_objects(row: Row) -> list[Any]:
    """The objects a row documents, and the classes its functions return (for ``.attr`` in the description)."""
    out: list[Any] = []
    for name, _params, returns in _signatures(row):
        out += [public(name), public(returns) if returns is not None else None]
    return [o for o in out if o is not None]


def public(name: str) -> Any:
    """``stagingloader.<name>``, or None (a lazily imported name whose import fails is reported where it is used)."""
    try:
        return getattr(sl, name)
    except (AttributeError, ImportError):
        return None


def compare_signature(where: str, name: str, obj: Any, documented: str) -> list[str]:
    """Where ``name(documented)`` and the code's signature of ``obj`` differ."""
    doc = doc_params(documented)
    code = code_params(obj)
    if any(p.name == ELIDED for p in doc):
        cut = [p.name for p in doc].index(ELIDED)
        base = next(b for b in obj.__mro__[1:] if not b.__module__.startswith("stagingloader"))  # what it extends
        shared = {p.name for p in code_params(base)}
        head, tail = doc[:cut], doc[cut + 1:]
        rest = code[len(head):]
        code = code[:len(head)] + [p for p in rest if p.name not in shared]
        elided = [p.name for p in rest if p.name in shared]
        if not elided:
            return [f"{where}: {name}(...) elides the parameters it shares with {base.__name__}, but it shares none"]
        doc = head + tail
    problems = []
    if [p.name for p in doc] != [p.name for p in code]:
        problems.append(f"{where}: {name}() documents ({', '.join(p.show() for p in doc)}), the code has "
                        f"({', '.join(p.show() for p in code)})")
        return problems
    for d, c in zip(doc, code):
        if d.kind != c.kind:
            problems.append(f"{where}: {name}(): {d.name} is documented {d.kind.description}, is {c.kind.description}")
        same = d.default == c.default and (type(d.default) is type(c.default) or isinstance(c.default, (int, float)))
        if not same and not (isinstance(d.default, str) and d.default == repr(c.default)):
            problems.append(f"{where}: {name}(): {d.name} defaults to {c.default!r}, documented {d.default!r}")
    return problems


def compare_mention(where: str, name: str, obj: Any, args: str) -> list[str]:
    """A call written in prose (``save(step, obj, async_=False)``, ``stage(..., wait=False)``): the positional names
    are the parameters at their places, the keywords are parameters."""
    try:
        call = ast.parse(f"_({args})", mode="eval").body
    except SyntaxError:
        return [f"{where}: {name}({args}) does not parse as a call"]
    assert isinstance(call, ast.Call)
    params = code_params(obj)
    if inspect.isfunction(obj) and "." in obj.__qualname__ and params and params[0].name in ("self", "cls"):
        params = params[1:]  # a method, written as called on an instance
    names = [p.name for p in params]
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    problems = []
    for i, arg in enumerate(call.args):
        if isinstance(arg, ast.Constant) and arg.value is Ellipsis:
            break
        positional = [p.name for p in params if p.kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                           inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        if isinstance(arg, ast.Name) and (i >= len(positional) or positional[i] != arg.id):
            problems.append(f"{where}: {name}({args}): argument {i + 1} is {arg.id}, the code's is "
                            f"{positional[i] if i < len(positional) else 'none'}")
    for kw in call.keywords:
        if kw.arg is not None and kw.arg not in names and not takes_any:
            problems.append(f"{where}: {name}({args}): no parameter {kw.arg} (it has {', '.join(names)})")
    return problems


def test_documented_signatures_are_the_codes() -> None:
    problems: list[str] = []
    checked = []
    for row in API_ROWS:
        for name, params, returns in _signatures(row):
            try:
                obj = getattr(sl, name)
            except (AttributeError, ImportError) as e:
                problems.append(f"{row.where}: {name} is not a public name of stagingloader ({e})")
                continue
            if params is not None:
                problems += compare_signature(row.where, name, obj, params)
                checked.append(name)
            if returns is not None:
                annotation = str(inspect.signature(obj).return_annotation)
                if not re.search(rf"\b{re.escape(returns)}\b", annotation):
                    problems.append(f"{row.where}: {name}() is documented to return {returns}, returns {annotation}")
    assert not problems, "docs/api.md:\n" + "\n".join(problems)
    # the checker found the signatures it is there for
    assert {"stage", "dry_run", "StageOptions", "verify", "DataLoader", "StagedFiles", "StagedArrays",
            "Checkpoints"} <= set(checked), checked


def test_what_the_descriptions_name_exists() -> None:
    problems: list[str] = []
    for row in API_ROWS:
        owners = _row_objects(row)
        for text in CODE.findall(row.cells[1]):
            attr = re.fullmatch(r"\.([A-Za-z_]\w*)", text)
            call = CALL.match(text)
            if attr:
                if not any(isinstance(o, type) and has_attribute(o, attr.group(1)) for o in owners):
                    problems.append(f"{row.where}: .{attr.group(1)} is an attribute of none of "
                                    f"{[getattr(o, '__name__', o) for o in owners]}")
            elif call:
                dot, name, args = call.groups()
                obj = resolve(name, owners if dot or "." not in name else [])
                if obj is None or not callable(obj):
                    problems.append(f"{row.where}: {text} names nothing callable of the row or of stagingloader")
                else:
                    problems += compare_mention(row.where, name, obj, args)
    assert not problems, "docs/api.md:\n" + "\n".join(problems)


def test_every_public_name_is_documented() -> None:
    documented = {n for row in API_ROWS for name, _p, returns in _signatures(row) for n in (name, returns)}
    documented |= set(error_tree())
    missing = sorted(set(sl.__all__) - documented - {"__version__"})
    assert not missing, f"docs/api.md documents neither in its table nor in its error tree: {missing}"


# ---- the error tree (docs/api.md) and the exit codes (docs/errors.md) ----------------------------------------------

@dataclass
class Node:
    line: int
    parent: str | None
    mixins: list[str]  # builtins
    also: list[str]  # other error classes it derives from ("a VerificationError")
    code: int | None


def error_tree() -> dict[str, Node]:
    """The first code block after ``## Errors`` in docs/api.md, as class -> its node."""
    lines = API.read_text().splitlines()
    start = lines.index("## Errors")
    fence = next(i for i in range(start, len(lines)) if lines[i].startswith("```"))
    nodes: dict[str, Node] = {}
    stack: list[str] = []
    for n in range(fence + 1, len(lines)):
        line = lines[n]
        if line.startswith("```"):
            break
        m = re.match(r"^((?:[│ ] {3})*)(?:[├└]── )?(\w+) \(([^)]*)\)", line)
        assert m, f"docs/api.md line {n + 1}: not a class of the tree: {line!r}"
        depth = len(m.group(1)) // 4 + (1 if re.match(r"^(?:[│ ] {3})*[├└]", line) else 0)
        name, info = m.group(2), m.group(3)
        del stack[depth:]
        parent = stack[-1] if stack else None
        stack.append(name)
        code = re.search(r"\b(\d+)\b", info)
        words = [w.strip() for w in re.sub(r"\bexit\b.*|\b\d+\b", "", info).split(",") if w.strip()]
        nodes[name] = Node(n + 1, parent, [w for w in words if not w.startswith(("a ", "an "))],
                           [w.split()[-1] for w in words if w.startswith(("a ", "an "))],
                           int(code.group(1)) if code else None)
    return nodes


def test_the_error_tree_is_the_codes() -> None:
    tree = error_tree()
    assert set(tree) == set(ERROR_CLASSES), (
        f"docs/api.md's error tree lacks {sorted(set(ERROR_CLASSES) - set(tree))}, "
        f"has what stagingloader.errors does not: {sorted(set(tree) - set(ERROR_CLASSES))}")
    problems = []
    for name, node in tree.items():
        cls = ERROR_CLASSES[name]
        family = [b.__name__ for b in cls.__bases__ if issubclass(b, errors.StagingError)]
        mixins = [b.__name__ for b in cls.__bases__ if not issubclass(b, errors.StagingError) and b is not Exception]
        where = f"docs/api.md line {node.line}: {name}"
        if node.parent != (family[0] if family else None):
            problems.append(f"{where} is drawn under {node.parent}, derives from {family[0] if family else None}")
        if sorted(node.also) != sorted(family[1:]):
            problems.append(f"{where}: documented also a {node.also}, is also a {family[1:]}")
        if sorted(node.mixins) != sorted(mixins):
            problems.append(f"{where}: documented as a {node.mixins or 'no builtin'}, mixes in {mixins or 'none'}")
        if node.code != int(cls.exit_code):
            problems.append(f"{where}: documented exit {node.code}, its exit_code is {int(cls.exit_code)}")
    assert not problems, "\n".join(problems)


def test_the_exit_code_table_is_the_codes() -> None:
    rows = table_rows(ERRORS, "| code |")
    by_code: dict[int, Row] = {}
    for row in rows:
        assert row.cells[0].isdigit(), f"docs/errors.md {row.where}: {row.cells[0]!r} is not an exit code"
        by_code[int(row.cells[0])] = row
    assert sorted(by_code) == sorted(int(c) for c in sl.ExitCode), (
        f"docs/errors.md documents the codes {sorted(by_code)}, ExitCode has {sorted(int(c) for c in sl.ExitCode)}")
    problems = []
    seen: dict[str, list[int]] = {}
    for code, row in by_code.items():
        named = CODE.findall(row.cells[2])
        for name in named:
            if name in ERROR_CLASSES:
                seen.setdefault(name, []).append(code)
        # "`UsageError` (a `ValueError`)": the builtin is one of its bases
        for cls_name, base in re.findall(r"`(\w+)` \(an? `(\w+)`\)", row.cells[2]):
            cls, mixin = ERROR_CLASSES.get(cls_name), getattr(builtins, base, None) or ERROR_CLASSES.get(base)
            if cls is None or mixin is None or not issubclass(cls, mixin):
                problems.append(f"docs/errors.md {row.where}: {cls_name} is not a {base}")
    for name, cls in ERROR_CLASSES.items():
        if seen.get(name) != [int(cls.exit_code)]:
            problems.append(f"docs/errors.md: {name} (exit_code {int(cls.exit_code)}) is in the rows of the codes "
                            f"{seen.get(name, [])}")
    assert not problems, "\n".join(problems)


# ---- module references in docstrings -------------------------------------------------------------------------------

def _modules() -> set[str]:
    package = REPO / "stagingloader"
    return {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
            for p in package.rglob("*.py")}


@pytest.mark.parametrize("path", sorted((REPO / "stagingloader").rglob("*.py")),
                         ids=lambda p: str(p.relative_to(REPO)))
def test_module_references_name_modules_that_exist(path: Path) -> None:
    """``:mod:`..sources.stable``` and ``:mod:`stagingloader.cache.manifest``` in a docstring: a module moved or
    renamed leaves no reference to its old place."""
    modules = _modules()
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
    wrong = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        for ref in re.findall(r":mod:`~?([\w.]+)`", line):
            if ref.startswith("."):
                up = len(ref) - len(ref.lstrip("."))
                base = package.split(".")[:len(package.split(".")) - (up - 1)]
                full = ".".join([*base, ref.lstrip(".")] if ref.lstrip(".") else base)
            else:
                full = ref
            if full not in modules:
                wrong.append(f"line {n}: {ref} ({full} does not exist)")
    assert not wrong, wrong
