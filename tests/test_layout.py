"""The code's layout: calls between the native files and imports between the
Python modules go one way (no cycles), and no function (native, or in the
package and server/) grows past the length a reader takes in at once.

The native side is read as text: comments, strings and preprocessor lines are
blanked, then a function definition is a `name(...) {` at namespace level. A
`static` function or one in an anonymous namespace is its file's own; every
other definition is a symbol the other files may call.
"""
import ast
import re
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NATIVE = ROOT / "dreamstage" / "ggml_ext"
MAX_FUNCTION_LINES = 80   # issue 48: no function over about 80 lines

_NOT_FUNCTIONS = {"if", "for", "while", "switch", "return", "sizeof", "catch"}
_SIGNATURE = re.compile(r"(~?\w+)\s*\((?:[^()]|\([^()]*\))*\)\s*(?:const|noexcept|override|\s)*"
                        r"(?:->\s*[\w:<>*& ]+)?\s*$", re.S)


def _code(src: str) -> str:
    """src with comments, string and char literals and preprocessor lines blanked (lines kept)."""
    src = re.sub(r"//[^\n]*|/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), src, flags=re.S)
    src = re.sub(r'"(?:\\.|[^"\\\n])*"', '""', src)
    src = re.sub(r"'(?:\\.|[^'\\\n])*'", "''", src)
    return re.sub(r"^[ \t]*#[^\n]*", "", src, flags=re.M)


def native_functions(code: str) -> list[tuple[str, bool, int, int]]:
    """(name, file-local, first line, last line) of each function defined at namespace level."""
    found: list[list] = []
    scopes: list[str] = []   # "ns", "anon" (anonymous namespace), "fn" or "other", one per open brace
    head_start = 0
    for i, c in enumerate(code):
        if c in ";{}":
            at_namespace_level = all(s in ("ns", "anon") for s in scopes)
            if c == "{":
                head = code[head_start:i]
                sig = _SIGNATURE.search(head)
                if at_namespace_level and re.search(r"\bnamespace\s*$", head):
                    scopes.append("anon")
                elif at_namespace_level and re.search(r"\bnamespace\b|\bextern\s*\"\"\s*$", head):
                    scopes.append("ns")
                elif (at_namespace_level and sig and sig.group(1) not in _NOT_FUNCTIONS
                      and not re.search(r"=\s*$", head[:sig.start()])):
                    local = bool(re.search(r"\bstatic\b", head)) or "anon" in scopes
                    found.append([sig.group(1), local, code.count("\n", 0, head_start + sig.start()) + 1, 0])
                    scopes.append("fn")
                else:
                    scopes.append("other")
            elif c == "}":
                if scopes.pop() == "fn" and all(s in ("ns", "anon") for s in scopes):
                    found[-1][3] = code.count("\n", 0, i) + 1
            head_start = i + 1
    return [tuple(f) for f in found]


def native_calls() -> dict[str, dict[str, set[str]]]:
    """file -> {other file: the functions it defines that this file calls}, over ggml_ext/*.cpp
    (the dream stage's library; cpu/, cuda/ and rpc/ build into ggml's backends)."""
    codes = {p.name: _code(p.read_text()) for p in sorted(NATIVE.glob("*.cpp"))}
    owner: dict[str, set[str]] = defaultdict(set)
    for name, code in codes.items():
        for fn, local, _, _ in native_functions(code):
            if not local:
                owner[fn].add(name)
    calls: dict[str, dict[str, set[str]]] = {name: defaultdict(set) for name in codes}
    for name, code in codes.items():
        for m in re.finditer(r"\b(\w+)\s*\(", code):
            for other in owner.get(m.group(1), ()):
                if other != name:
                    calls[name][other].add(m.group(1))
    return calls


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def python_modules() -> dict[str, Path]:
    """dotted name -> file for the package (server/ is dreamstage.server, as the wheel maps it)."""
    mods = {}
    for base, prefix in ((ROOT / "dreamstage", "dreamstage"), (ROOT / "server", "dreamstage.server")):
        for p in base.rglob("*.py"):
            if base.name == "dreamstage" and p.relative_to(base).parts[0] == "server":
                continue   # dev.sh's link to server/
            parts = list(p.relative_to(base).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            mods[".".join([prefix, *parts])] = p
    return mods


def python_imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the package modules it imports when it is imported (module level, not TYPE_CHECKING)."""
    edges: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _runtime_imports(ast.parse(path.read_text()).body):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names)
        edges[name] = {t for t in targets if t in mods and t != name}
    return edges


def _runtime_imports(body: list[ast.stmt]):
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            yield from _runtime_imports(node.body)
            yield from _runtime_imports(node.orelse)
        elif isinstance(node, ast.Try):
            yield from _runtime_imports(node.body)
            for h in node.handlers:
                yield from _runtime_imports(h.body)


def test_the_native_parser_finds_definitions_calls_and_file_local_functions():
    code = _code('namespace {\nint hidden(int a) {\n  if (a) { return 1; }\n  return 0;\n}\n}\n'
                 'static void own() {}\n'
                 '// void commented() {\n'
                 'const char * s = "f() {";\n'
                 'bool shared(const T & t, int (*cb)(int)) const {\n  return hidden(t.x);\n}\n'
                 'struct S { void method() {} };\n')
    assert native_functions(code) == [("hidden", True, 2, 5), ("own", True, 7, 7), ("shared", False, 10, 12)]


def test_cycles_finds_every_component_of_a_loop_and_nothing_else():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_native_files_call_each_other_one_way():
    calls = native_calls()
    assert len(calls) > 20
    assert calls["dream-api.cpp"]["dream-step.cpp"] == {"dream_walk_micro_step"}   # the parser sees real calls
    found = cycles({f: set(to) for f, to in calls.items()})
    detail = {f: {o: sorted(calls[f][o]) for o in calls[f] if o in comp} for comp in found for f in comp}
    assert found == [], f"native files that call each other: {detail}"


def test_no_native_function_is_longer_than_a_screen():
    sources = sorted(p for p in NATIVE.rglob("*") if p.suffix in (".cpp", ".cu"))
    assert len(sources) > 30
    long = [(p.name, fn, last - first + 1)
            for p in sources
            for fn, _, first, last in native_functions(_code(p.read_text()))
            if last - first + 1 > MAX_FUNCTION_LINES]
    assert long == []


def test_python_modules_import_each_other_one_way():
    mods = python_modules()
    edges = python_imports(mods)
    assert "dreamstage.native" in edges["dreamstage.info"]   # the reader sees real imports
    assert cycles(edges) == []


def test_the_packages_floors_import_downwards_only():
    """dreamstage's sub-packages and top modules (adapters, serving, training, records, server, ...) as one node
    each: no cycle between them either (training may use adapters, adapters never training)."""
    floor: dict[str, set[str]] = defaultdict(set)
    for module, targets in python_imports(python_modules()).items():
        for target in targets:
            a, b = ".".join(module.split(".")[:2]), ".".join(target.split(".")[:2])
            if a != b:
                floor[a].add(b)
    assert "dreamstage.adapters" in floor["dreamstage.training"]
    assert cycles(floor) == []


def test_no_python_function_is_longer_than_a_screen():
    mods = python_modules()
    long = [(name, node.name, node.end_lineno - node.lineno + 1)
            for name, path in mods.items()
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert len(mods) > 100 and long == []
