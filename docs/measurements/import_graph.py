"""The import graph of the repository's modules and its cycles.

    python docs/measurements/import_graph.py [ROOT]          # ROOT: the repository root (default .)
    python docs/measurements/import_graph.py --sizes [ROOT]  # lines a file and its longest functions

Every *.py under ROOT except tests/, docs/, out/ and results/ is a module, named by its path
(`chat/chat_reward.py` -> `chat.chat_reward`, a package's `__init__.py` by its folder). An import names the
longest known module it starts with (`import a.b.c` -> `a.b` when `a/b.py` is one; `from a import
b` -> `a.b` when that is a module, else `a`); relative imports resolve against the importing
module's package. Prints each module's imports of other modules, then the cycles: the strongly
connected groups of more than one module, or "none".
"""
import ast
import os
import sys

SKIP = {"tests", "docs", "out", "results", ".git", "__pycache__"}


def modules(root):
    """{dotted name: path} of every module under root."""
    found = {}
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith("."))
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, f), root)[:-3].split(os.sep)
                name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
                found[name] = os.path.join(folder, f)
    return found


def imports(name, path, known):
    """The known modules that the module `name` at `path` imports."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    deps = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            deps |= {longest_known(a.name, known) for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".") if package else []
                up = up[:len(up) - (node.level - 1)] if node.level > 1 else up
                base = ".".join(p for p in (".".join(up), base) if p)
            for a in node.names:    # `from a import b`: the module a.b if there is one, else a itself
                deps.add(longest_known(f"{base}.{a.name}" if base else a.name, known))
    return sorted(d for d in deps if d and d != name)


def longest_known(dotted, known):
    parts = dotted.split(".")
    return next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in known), None)


def cycles(graph):
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on, groups = {}, {}, [], set(), []
    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))
    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(groups)


def sizes(known):
    """Per module: its lines and its three longest functions (def line to last line), a reader's guide."""
    for name, path in sorted(known.items()):
        src = open(path).read()
        funcs = sorted(((n.end_lineno - n.lineno + 1, n.name) for n in ast.walk(ast.parse(src))
                        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), reverse=True)[:3]
        print(f"{name}: {src.count(chr(10))} lines; longest: {', '.join(f'{f} {n}' for n, f in funcs) or '-'}")


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--sizes"]
    root = args[0] if args else "."
    if "--sizes" in sys.argv:
        sizes(modules(root))
        sys.exit(0)
    known = modules(root)
    graph = {m: imports(m, p, known) for m, p in sorted(known.items())}
    for m, deps in graph.items():
        print(f"{m} -> {', '.join(deps)}")
    print("cycles:", cycles(graph) or "none")
