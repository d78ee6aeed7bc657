"""The torch names the package uses, and whether every supported torch has them (issue 33 item 7).

  python tools/torch_api_names.py used                        # every torch name used, with where
  python tools/torch_api_names.py extract WHEEL [WHEEL ...]   # (re)write tests/fixtures/torch_api/<version>.json
  python tools/torch_api_names.py check                       # the uses against those fixtures (exit 1: missing)
  python tools/torch_api_names.py check --installed           # the uses against the torch installed here

The uses: an AST scan of internlm_core/, tools/, bench/ and train.py for every chain rooted at a torch import
(`torch.distributed.fsdp.fully_shard`, `dist.all_gather_into_tensor` after `import torch.distributed as dist`,
`F.silu` after `import torch.nn.functional as F`, `from torch.a import b`, and the string of `getattr`/`hasattr`
on a torch module). A chain is checked up to its first part that is not a module and, where that part is a class
the sources define, the member after it (`dist.ReduceOp.SUM`, `PipelineStage._warmup_backward_result`). A call's
keyword arguments are checked against the callable's signature in each version (its def, overloads united; a
class's __new__ and __init__, or a dataclass's fields; **kwargs takes any). Methods called on objects (`x.foo()`,
`module.set_custom_all_gather(...)`) are not seen: the scan cannot tell what `x` is.

The API of a version: read from its wheel's own Python sources, which are the same on every platform; the macOS arm64
wheels are the small ones: `pip download torch==V --no-deps --only-binary=:all: -d DIR --platform P` with P
macosx_11_0_arm64 for 2.11, macosx_14_0_arm64 from 2.12 on (then `extract DIR/torch-*.whl`). A module's
names are what its top level defines, in any branch of an if/try (a superset: a name defined only on another
platform counts): functions, classes, assignments, imports (a star import brings the other module's `__all__`, or
its public names), and its submodules. Torch's C extension is read from the .pyi stubs the wheel ships beside it
(torch/_C/*.pyi); `torch` also gets every name of torch._C._VariableFunctions, private ones too, as
torch/__init__.py copies them in a loop. `torch.ops` is not checked (DYNAMIC); a name only the C extension defines
without a stub is reported missing (never passed unseen). The fixture of a version keeps, for each module the
package reaches, all of its names, so a new use inside a known module is checked without a download; a use reaching
a module, a class member or a keyword call the fixture was written without says to regenerate it.

Names that differ between the supported versions go through internlm_core/utils/torch_compat.py, behind its version
checks: its uses need to exist in one supported version only.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("internlm_core", "tools", "bench", "train.py")
FIXTURES = ROOT / "tests/fixtures/torch_api"
# the oldest supported torch, the one requirements.txt pins (the tests run on it) and the newest supported
SUPPORTED = ("2.11.0", "2.13.0", "2.15.0")
COMPAT = "internlm_core/utils/torch_compat.py"
# chain prefix -> why no source or stub of the wheel can say what it holds (its uses are not checked)
DYNAMIC = {
    "torch.ops": "operators the dispatcher registers at run time (which exist depends on the build: mkldnn, CUDA); "
                 "the package probes them with hasattr where it uses one",
}
# module -> (module whose every name it also holds, why)
COPIED = {"torch": ("torch._C._VariableFunctions", "torch/__init__.py copies every name of it, private ones too, "
                                                   "into torch's globals in a loop over dir()")}

Chain = tuple[str, ...]


@dataclass(frozen=True)
class Use:
    """One torch name the code reaches: the chain (`("torch", "distributed", "all_gather_into_tensor")`), where,
    and for a call the keyword arguments it passes."""
    chain: Chain
    where: str
    keywords: tuple[str, ...] = ()

    @property
    def dotted(self) -> str:
        return ".".join(self.chain)


# ---- the uses -------------------------------------------------------------------------------------------------------

def _aliases(tree: ast.Module) -> tuple[dict[str, Chain], list[tuple[Chain, int]]]:
    """Every name a torch import binds in the file (alias -> chain) and every chain the imports themselves name."""
    aliases: dict[str, Chain] = {}
    imported: list[tuple[Chain, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                chain = tuple(a.name.split("."))
                if chain[0] == "torch":
                    aliases[a.asname or "torch"] = chain if a.asname else ("torch",)
                    imported.append((chain, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            base = tuple(node.module.split("."))
            for a in node.names:
                if a.name != "*":
                    aliases[a.asname or a.name] = base + (a.name,)
                    imported.append((base + (a.name,), node.lineno))
    return aliases, imported


def _chain(node: ast.expr, aliases: dict[str, Chain]) -> Optional[Chain]:
    """`dist.a.b` -> ("torch", "distributed", "a", "b") when `dist` is a torch alias, else None."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name) and node.id in aliases:
        return aliases[node.id] + tuple(reversed(parts))
    return None


def _probe(node: ast.Call, aliases: dict[str, Chain]) -> Optional[Chain]:
    """`getattr(torch.x, "name", ...)` / `hasattr(torch.x, "name")` -> ("torch", "x", "name")."""
    if not (isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
        return None
    base, name = _chain(node.args[0], aliases), node.args[1]
    if base is None or not (isinstance(name, ast.Constant) and isinstance(name.value, str)):
        return None
    return base + (name.value,)


def uses_in(rel: str, source: str) -> list[Use]:
    """Every torch chain one file reaches (`rel`: its path, for the report)."""
    tree = ast.parse(source, filename=rel)
    aliases, imported = _aliases(tree)
    found = [Use(chain, f"{rel}:{line}") for chain, line in imported]
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        chain = None
        if isinstance(node, ast.Attribute) and id(node) not in inner:
            chain = _chain(node, aliases)
        elif isinstance(node, ast.Call):
            chain = _probe(node, aliases)
        if chain is not None and len(chain) > 1:
            found.append(Use(chain, f"{rel}:{node.lineno}"))
        if isinstance(node, ast.Call) and any(k.arg for k in node.keywords):
            called = _chain(node.func, aliases)
            if called is not None and len(called) > 1:
                found.append(Use(called, f"{rel}:{node.lineno}", tuple(k.arg for k in node.keywords if k.arg)))
    return found


def scanned_files(root: Path = ROOT) -> Iterator[Path]:
    for entry in SCANNED:
        path = root / entry
        yield from sorted(path.rglob("*.py")) if path.is_dir() else [path]


def package_uses(root: Path = ROOT) -> list[Use]:
    """Every torch chain of internlm_core/, tools/, bench/ and train.py."""
    return [u for p in scanned_files(root) for u in uses_in(p.relative_to(root).as_posix(), p.read_text("utf-8"))]


def dynamic(chain: Chain) -> bool:
    dotted = ".".join(chain)
    return any(dotted == d or dotted.startswith(d + ".") for d in DYNAMIC)


# ---- a version's names ----------------------------------------------------------------------------------------------

def missing_part(chain: Chain, api: dict) -> Optional[str]:
    """None when `api` (a fixture: "modules" -> their names, "classes" -> their names) has every part of `chain`
    up to its first non-module part, and the member after it where that part is a class the fixture lists; else
    the first part it lacks, as `module.name`."""
    modules, classes = api["modules"], api.get("classes", {})
    for i in range(1, len(chain)):
        parent, dotted = ".".join(chain[:i]), ".".join(chain[:i + 1])
        if dotted in modules:
            continue
        if parent not in modules or chain[i] not in modules[parent]:
            return dotted
        if i + 1 < len(chain) and dotted not in classes:
            return f"{dotted} in the fixture's classes: regenerate it"
        if i + 1 < len(chain) and classes[dotted] is not None and chain[i + 1] not in classes[dotted]:
            return f"{dotted}.{chain[i + 1]}"
        return None
    return None if ".".join(chain) in modules else ".".join(chain)


def missing_keywords(use: Use, api: dict) -> list[str]:
    """The keywords of a call that the callable's signature in `api` does not take (none where its sources cannot
    say: the fixture holds null, e.g. for a function made by an assignment); ["..."] where the fixture has no entry
    for it (written before the call was: regenerate)."""
    signatures = api.get("signatures", {})
    if not use.keywords:
        return []
    if use.dotted not in signatures:
        return ["..."]
    signature = signatures[use.dotted]
    if signature is None or signature["var_kw"]:
        return []
    return [k for k in use.keywords if k not in signature["params"]]


def missing(uses: Iterable[Use], api: dict) -> list[str]:
    """`path:line torch.x.name` of every use `api` lacks, and `path:line torch.x.f(k=)` of every keyword a call
    passes that the callable does not take (DYNAMIC prefixes not checked)."""
    out = []
    for use in uses:
        if dynamic(use.chain):
            continue
        part = missing_part(use.chain, api)
        if part is not None and not part.startswith(use.dotted):
            out.append(f"{use.where} {use.dotted} (no {part})")
        elif part is not None:
            out.append(f"{use.where} {use.dotted}")
        else:
            out += [f"{use.where} {use.dotted}({k}=)" if k != "..." else
                    f"{use.where} {use.dotted}(...) (the fixture has no signature for it: regenerate it)"
                    for k in missing_keywords(use, api)]
    return sorted(set(out))


def load_fixture(version: str, folder: Path = FIXTURES) -> dict:
    """The API of torch `version` as `extract` wrote it ("modules" and "classes" -> their names)."""
    path = folder / f"{version}.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no torch API names for torch {version}; write them with "
                                f"`python tools/torch_api_names.py extract <torch-{version} wheel>`")
    return json.loads(path.read_text())


def problems(uses: list[Use], apis: dict[str, dict]) -> list[str]:
    """One line per use a supported version lacks; the compat module's uses need one version only."""
    lines = []
    outside = [u for u in uses if not u.where.startswith(COMPAT + ":")]
    for version, modules in apis.items():
        lines += [f"{m}: not in torch {version}" for m in missing(outside, modules)]
    compat = [u for u in uses if u.where.startswith(COMPAT + ":")]
    in_none = set.intersection(*(set(missing(compat, m)) for m in apis.values())) if apis else set()
    lines += [f"{m}: in no supported torch" for m in sorted(in_none)]
    return lines


# ---- the installed torch --------------------------------------------------------------------------------------------

_ABSENT = object()


def missing_installed(uses: Iterable[Use]) -> list[str]:
    """`path:line torch.x.name` of every use the torch installed here lacks at run time (outside the compat
    module, DYNAMIC not checked): a module part is imported, the first other part must be an attribute, and the
    part after it, where that attribute is a class, a member of the class."""
    out = []
    for use in uses:
        if dynamic(use.chain) or use.where.startswith(COMPAT + ":"):
            continue
        obj = importlib.import_module(use.chain[0])
        for i in range(1, len(use.chain)):
            try:
                obj = importlib.import_module(".".join(use.chain[:i + 1]))
                continue
            except ImportError:
                pass
            member = getattr(obj, use.chain[i], _ABSENT)
            if member is _ABSENT or (i + 1 < len(use.chain) and isinstance(member, type)
                                     and not hasattr(member, use.chain[i + 1])):
                out.append(f"{use.where} {use.dotted}")
            break
    return sorted(set(out))


# ---- a wheel's names ------------------------------------------------------------------------------------------------

def _module_of(member: str) -> tuple[str, bool]:
    """("torch.a.b", is a package) of the wheel member `torch/a/b.py`, `torch/a/b/__init__.pyi`, ..."""
    parts = member.rsplit(".", 1)[0].split("/")
    package = parts[-1] == "__init__"
    return ".".join(parts[:-1] if package else parts), package


def _top_level(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The module-level statements, into every branch of if/try/with/for (not into functions or classes)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, (ast.If, ast.For, ast.While, ast.With, ast.Try)):
            for field in ("body", "orelse", "finalbody"):
                yield from _top_level(getattr(stmt, field, []))
            for handler in getattr(stmt, "handlers", []):
                yield from _top_level(handler.body)


def _targets(node: ast.expr) -> set[str]:
    if isinstance(node, ast.Name):
        return {node.id}
    if isinstance(node, (ast.Tuple, ast.List)):
        return set().union(*(_targets(e) for e in node.elts))
    if isinstance(node, ast.Starred):
        return _targets(node.value)
    return set()


def _strings(node: Optional[ast.expr]) -> Optional[list[str]]:
    """The strings of a literal list/tuple of strings (or of one string), None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.List, ast.Tuple)) and all(isinstance(e, ast.Constant) for e in node.elts):
        return [e.value for e in node.elts if isinstance(e.value, str)]
    return None


class Wheel:
    """The Python sources and stubs of one torch wheel, by module, and the names each module defines."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.texts: dict[str, list[str]] = {}
        self.packages: set[str] = set()
        with zipfile.ZipFile(self.path) as z:
            for member in z.namelist():
                if member.startswith("torch/") and member.endswith((".py", ".pyi")):
                    module, package = _module_of(member)
                    self.texts.setdefault(module, []).append(z.read(member).decode("utf-8"))
                    if package:
                        self.packages.add(module)
        self.children: dict[str, set[str]] = {}
        self._trees: dict[str, list[ast.Module]] = {}
        for module in self.texts:
            parent, _, name = module.rpartition(".")
            self.children.setdefault(parent, set()).add(name)
        self._names: dict[str, set[str]] = {}

    def trees(self, module: str) -> list[ast.Module]:
        """The parsed source and stub of `module` (parsed when first asked: most of a wheel is never read)."""
        if module not in self._trees:
            where = f"{self.path.name}:{module}"
            self._trees[module] = [ast.parse(t, filename=where) for t in self.texts.get(module, [])]
        return self._trees[module]

    @property
    def version(self) -> str:
        for stmt in self.trees("torch.version")[0].body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and "__version__" in _targets(
                    stmt.targets[0] if isinstance(stmt, ast.Assign) else stmt.target):
                return str(ast.literal_eval(stmt.value))
        raise ValueError(f"{self.path}: torch/version.py has no __version__")

    def _source_module(self, module: str, node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        base = module if module in self.packages else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        return f"{base}.{node.module}" if node.module else base

    def _bound(self, stmt: ast.stmt, module: str) -> set[str]:
        """The names one module-level statement binds."""
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            return {stmt.name}
        if isinstance(stmt, ast.Assign):
            return set().union(*(_targets(t) for t in stmt.targets))
        if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)):
            return _targets(stmt.target)
        if isinstance(stmt, ast.Import):
            return {a.asname or a.name.split(".")[0] for a in stmt.names}
        if isinstance(stmt, ast.ImportFrom):
            source = self._source_module(module, stmt)
            star = any(a.name == "*" for a in stmt.names) and source in self.texts
            return {a.asname or a.name for a in stmt.names if a.name != "*"} | (self.star(source) if star else set())
        return set()

    def names(self, module: str) -> set[str]:
        """Every name `module` defines at its top level, in any branch, and its submodules (empty: no module)."""
        if module in self._names:
            return self._names[module]
        self._names[module] = set()  # an import cycle sees what is known so far
        found = set(self.children.get(module, ()))
        for tree in self.trees(module):
            for stmt in _top_level(tree.body):
                found |= self._bound(stmt, module)
            found |= _replacement_class_names(tree)
        if module in COPIED:
            found |= self.names(COPIED[module][0])
        self._names[module] = found
        return found

    def star(self, module: str) -> set[str]:
        """What `from module import *` brings: its literal `__all__`, or its public names."""
        listed: set[str] = set()
        literal = True
        for tree in self.trees(module):
            for stmt in _top_level(tree.body):
                value = None
                assigns = isinstance(stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign))
                if assigns and "__all__" in self._bound(stmt, module):
                    value = stmt.value
                elif (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)
                      and ast.unparse(stmt.value.func) in ("__all__.extend", "__all__.append")):
                    value = stmt.value.args[0] if stmt.value.args else None
                else:
                    continue
                strings = _strings(value)
                literal = literal and strings is not None
                listed |= set(strings or [])
        if listed and literal:
            return listed
        return {n for n in self.names(module) if not n.startswith("_")}

    def _defs(self, module: str, name: str, depth: int = 0) -> Optional[tuple[str, list[ast.stmt]]]:
        """The defs and classes named `name` at the top level of the module that defines it for `module` (several:
        overloads), following imports within torch; None where no source of the wheel holds one."""
        if depth > 12 or module not in self.texts:
            return None
        here, stars, imported = [], [], []
        for tree in self.trees(module):
            for stmt in _top_level(tree.body):
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and stmt.name == name:
                    here.append(stmt)
                elif isinstance(stmt, ast.ImportFrom):
                    source = self._source_module(module, stmt)
                    stars += [source for a in stmt.names if a.name == "*"]
                    imported += [(source, a.name) for a in stmt.names if (a.asname or a.name) == name
                                 and source.split(".")[0] == "torch"]
        if here:
            return module, here
        for source, original in imported + [(source, name) for source in stars if name in self.names(source)]:
            found = self._defs(source, original, depth + 1)
            if found:
                return found
        return None

    def _binding(self, module: str, name: str) -> Optional[tuple[str, ast.ClassDef]]:
        """The class `name` is in `module` ((its module, its definition)), following imports; None where the
        sources do not define it as a class (a C type without a stub class, an assignment, another package)."""
        found = self._defs(module, name)
        classes = [d for d in (found[1] if found else []) if isinstance(d, ast.ClassDef)]
        return (found[0], classes[-1]) if classes else None

    def _base(self, module: str, node: ast.expr) -> Optional[tuple[str, ast.ClassDef]] | bool:
        """A base class (or metaclass) expression of a class of `module`: its torch class, False where it is
        not torch's (object, Enum, Generic[T], ...), None where it is torch's but not defined in the sources."""
        text = ast.unparse(node)
        root, _, rest = text.partition(".")
        if isinstance(node, ast.Subscript) or not isinstance(node, (ast.Name, ast.Attribute)):
            return False
        if not rest:
            return self._binding(module, root) or (None if self._binds_torch(module, root) else False)
        imported = {(a.asname or a.name.split(".")[0]): (a.name if a.asname else a.name.split(".")[0])
                    for tree in self.trees(module) for s in _top_level(tree.body) if isinstance(s, ast.Import)
                    for a in s.names}
        for tree in self.trees(module):
            for s in _top_level(tree.body):
                if isinstance(s, ast.ImportFrom):
                    src = self._source_module(module, s)
                    imported.update({(a.asname or a.name): f"{src}.{a.name}" for a in s.names if a.name != "*"})
        dotted = f"{imported.get(root, root)}.{rest}"
        if dotted.split(".")[0] != "torch":
            return False
        parent, _, name = dotted.rpartition(".")
        return self._binding(parent, name)

    def _binds_torch(self, module: str, name: str) -> bool:
        """Whether `module` binds `name` other than by importing it from outside torch (or not at all: a builtin)."""
        for tree in self.trees(module):
            for stmt in _top_level(tree.body):
                if isinstance(stmt, (ast.Import, ast.ImportFrom)):
                    for a in stmt.names:
                        if (a.asname or a.name.split(".")[0]) == name:
                            source = self._source_module(module, stmt) if isinstance(stmt, ast.ImportFrom) else a.name
                            return source.split(".")[0] == "torch"
                elif name in self._bound(stmt, module):
                    return True
        return False

    def class_names(self, module: str, name: str, depth: int = 0) -> Optional[set[str]]:
        """The names class `name` of `module` defines in its body, with its torch bases' and metaclass's; None
        where the sources cannot say (not a class they define, or a torch base they do not define)."""
        found = self._binding(module, name)
        if found is None or depth > 12:
            return None
        where, cls = found
        names: set[str] = set()
        for item in cls.body:
            if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(item.name)
            elif isinstance(item, (ast.Assign, ast.AnnAssign)):
                names |= set().union(*(_targets(t) for t in getattr(item, "targets", [getattr(item, "target", None)])))
        for base in [*cls.bases, *(k.value for k in cls.keywords if k.arg == "metaclass")]:
            resolved = self._base(where, base)
            if resolved is None:
                return None
            if resolved:
                inherited = self.class_names(resolved[0], resolved[1].name, depth + 1)
                if inherited is None:
                    return None
                names |= inherited
        return names

    def _member_defs(self, module: str, cls: ast.ClassDef, name: str, depth: int = 0) -> Optional[list[ast.stmt]]:
        """The defs named `name` in class `cls` of `module` or, first found, its torch bases' ([]: none of them
        defines it; None: a torch base the sources do not define)."""
        own = [d for d in cls.body if isinstance(d, (ast.FunctionDef, ast.AsyncFunctionDef)) and d.name == name]
        if own or depth > 12:
            return own
        for base in cls.bases:
            resolved = self._base(module, base)
            if resolved is None:
                return None
            if resolved:
                found = self._member_defs(resolved[0], resolved[1], name, depth + 1)
                if found is None or found:
                    return found
        return []

    def _fields(self, module: str, cls: ast.ClassDef, depth: int = 0) -> Optional[set[str]]:
        """A dataclass's fields (its bases' too); None where `cls` is no dataclass."""
        if not any("dataclass" in ast.unparse(d) for d in cls.decorator_list) or depth > 12:
            return None
        fields = {t.id for t in (d.target for d in cls.body if isinstance(d, ast.AnnAssign)) if isinstance(t, ast.Name)
                  and "ClassVar" not in ast.unparse(next(d for d in cls.body if isinstance(d, ast.AnnAssign)
                                                          and d.target is t).annotation)}
        for base in cls.bases:
            resolved = self._base(module, base)
            if resolved:
                fields |= self._fields(resolved[0], resolved[1], depth + 1) or set()
        return fields

    def signature(self, chain: Chain) -> Optional[dict]:
        """{"params": the names a call may pass by keyword, "var_kw": whether it takes **kwargs} of the function,
        class (its __init__, or a dataclass's fields) or class member `chain` names; None where the sources
        cannot say."""
        i = 1
        while i < len(chain) and self.is_module(".".join(chain[:i + 1])):
            i += 1
        rest = chain[i:]
        found = self._defs(".".join(chain[:i]), rest[0]) if 1 <= len(rest) <= 2 else None
        if found is None:
            return None
        where, defs = found
        classes = [d for d in defs if isinstance(d, ast.ClassDef)]
        if classes and len(rest) == 2:
            defs = self._member_defs(where, classes[-1], rest[1])
        elif classes and self._fields(where, classes[-1]) is None:
            # a call of the class goes to its __new__ and its __init__: a keyword either takes is taken
            both = [self._member_defs(where, classes[-1], m) for m in ("__new__", "__init__")]
            defs = None if None in both else both[0] + both[1]
        elif classes:
            return {"params": sorted(self._fields(where, classes[-1])), "var_kw": False}
        elif len(rest) == 2:
            return None
        if not defs:
            return None
        params = {a.arg for d in defs for a in [*d.args.args, *d.args.kwonlyargs]}
        return {"params": sorted(params), "var_kw": any(d.args.kwarg is not None for d in defs)}

    def is_module(self, dotted: str) -> bool:
        return dotted in self.texts or dotted in self.children


def _replacement_class_names(tree: ast.Module) -> set[str]:
    """The class-level names of `C` where the module replaces itself with an instance of its class `C`
    (`sys.modules[__name__] = C(sys.modules[__name__], __name__)`, as torch.backends.cudnn does): they are the
    module's attributes."""
    classes = {s.name: s for s in tree.body if isinstance(s, ast.ClassDef)}
    found: set[str] = set()
    for stmt in _top_level(tree.body):
        if (isinstance(stmt, ast.Assign) and ast.unparse(stmt.targets[0]) == "sys.modules[__name__]"
                and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Name)
                and stmt.value.func.id in classes):
            for item in classes[stmt.value.func.id].body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    found.add(item.name)
                elif isinstance(item, ast.Assign):
                    found |= set().union(*(_targets(t) for t in item.targets))
                elif isinstance(item, ast.AnnAssign):
                    found |= _targets(item.target)
    return found


def extract(wheel: Wheel, uses: Iterable[Use]) -> dict:
    """The fixture of `wheel`: for every module the uses reach (each module prefix of their chains), all its
    names."""
    modules = {"torch": sorted(wheel.names("torch"))}
    classes: dict[str, list[str]] = {}
    signatures: dict[str, dict] = {}
    for use in uses:
        for i in range(2, len(use.chain) + 1):
            dotted = ".".join(use.chain[:i])
            if wheel.is_module(dotted):
                modules[dotted] = sorted(wheel.names(dotted))
                continue
            parent = ".".join(use.chain[:i - 1])
            if i < len(use.chain):  # a member after it: the class's names (None: not a class its sources define)
                members = wheel.class_names(parent, use.chain[i - 1])
                classes[dotted] = None if members is None else sorted(members)
            break
        if use.keywords:
            signatures[use.dotted] = wheel.signature(use.chain)  # None: its sources cannot say (not checked)
    return {"torch_version": wheel.version, "wheel": wheel.path.name,
            "how": "tools/torch_api_names.py extract: module -> the names its sources and stubs define; class -> "
                   "the names its body, its torch bases and its metaclass define (only the classes the package "
                   "reaches into)",
            "modules": dict(sorted(modules.items())), "classes": dict(sorted(classes.items())),
            "signatures": dict(sorted(signatures.items()))}


# ---- the command line -----------------------------------------------------------------------------------------------

def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("used", help="every torch name the package uses, with where")
    ex = sub.add_parser("extract", help="write tests/fixtures/torch_api/<version>.json from torch wheels")
    ex.add_argument("wheels", nargs="+", type=Path)
    ex.add_argument("--out", type=Path, default=FIXTURES)
    ck = sub.add_parser("check", help="the uses against the supported versions' fixtures (exit 1: one missing)")
    ck.add_argument("--installed", action="store_true", help="against the torch installed here instead")
    args = p.parse_args(argv)
    uses = package_uses()
    if args.cmd == "used":
        for use in sorted(uses, key=lambda u: (u.dotted, u.where)):
            print(f"{use.dotted}  {use.where}")
        return 0
    if args.cmd == "extract":
        args.out.mkdir(parents=True, exist_ok=True)
        for path in args.wheels:
            fixture = extract(Wheel(path), uses)
            target = args.out / f"{fixture['torch_version']}.json"
            target.write_text(json.dumps(fixture, indent=0, sort_keys=False) + "\n")
            print(f"{target}: {len(fixture['modules'])} modules, {sum(map(len, fixture['modules'].values()))} names")
        return 0
    if args.installed:
        import torch
        found, against = missing_installed(uses), f"the installed torch {torch.__version__}"
    else:
        found, against = problems(uses, {v: load_fixture(v) for v in SUPPORTED}), "torch " + " and ".join(SUPPORTED)
    print("\n".join(found) if found else f"{len(uses)} uses of torch names: every one is in {against}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
