"""The repository's layers: folders import one way, and no two modules share a name.

Every library module (each .py outside tests/, docs/, results/ and data/) is parsed with `ast`.
A node of the folder graph is a folder (`chat`, its modules together) or a root module
(`rollout`); an edge a -> b is an `import b...` / `from b... import` in a file of a, wherever it
sits in the file (a function's own import counts too). LAYERS is that graph's order, written by
hand from the imports as they are, bottom first: every node imports only nodes before it, so no
two folders import each other and no cycle runs through the repo. A new folder or root module
must be placed in LAYERS before this test passes. Names: no two modules share a file stem, no
folder is named as a module (`formats/chat.py` beside `chat/`) and no folder like a root module
but for its ending (`rehearsal/` beside `rehearse.py`): an import or a path then says which file
it means. Exceptions, each named here: SHIMS, a root module that only re-exports a package module
under the name saved files use; KIN, a folder named after a root module on purpose.
"""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {"tests", "docs", "results", "data", "out", "__pycache__"}

# bottom first. The paper's files with no repo import, then machinery (which reads envace's tags and
# world's splits), the rehearsal (the world's turn of a row, its guard, private rehearsal given a
# sampler), the sampler on top of them; chat (a template's episodes, built
# on envace, machinery and the toy world only); worldmodel (fidelity and the separate rows, for
# the toy and chat rows: it reads rollout, reward and chat); the experiment worlds (which measure
# with worldmodel); the formats over all of them; evaluate.py (which measures with worldmodel and
# samples through rehearse); benchmarks (chat task files); reporting (train.py's logs, which call
# evaluate); train.py; bfcl.py (a shim of benchmarks/bfcl.py); scripts, the commands on top.
LAYERS = ["envace", "world", "reward", "machinery", "rehearse", "rollout", "chat", "worldmodel", "worlds",
          "formats", "evaluate", "benchmarks", "reporting", "train", "bfcl", "scripts"]

SHIMS = {"bfcl.py": os.path.join("benchmarks", "bfcl.py")}   # old task files name "bfcl:BFCLEnv" and "bfcl:check"
# folders named after a root module on purpose: more of its kind, or a compound of its name
KIN = {"worlds": "world",          # the experiment worlds, siblings of the demo's world.py
       "worldmodel": "world"}      # the policy as a model of the world: fidelity, separate rows, memory


def library_files(root=ROOT):
    """The library's .py files, as paths relative to root."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in SKIP and not d.startswith("."))
        found += [os.path.relpath(os.path.join(folder, f), root) for f in sorted(files) if f.endswith(".py")]
    return found


def node(path):
    """The graph node of a file: its top folder, or a root module's name."""
    top = path.split(os.sep)[0]
    return top[:-3] if top == path else top


def folder_graph(root=ROOT):
    """{node: {node it imports: [the files that import it]}}, from every import statement."""
    files = library_files(root)
    nodes = {node(f) for f in files}
    graph = {n: {} for n in nodes}
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8") as src:
            tree = ast.parse(src.read())
        for n in ast.walk(tree):
            if isinstance(n, ast.Import):
                names = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom) and n.level == 0 and n.module:
                names = [n.module]
            else:
                continue
            for name in names:
                target = name.split(".")[0]
                if target in nodes and target != node(f):
                    graph[node(f)].setdefault(target, []).append(f)
    return graph


def cycles(graph):
    """The groups of nodes that import each other, directly or round a loop (each sorted)."""
    reach = {n: set(graph[n]) for n in graph}
    changed = True
    while changed:
        changed = False
        for n in reach:
            more = set().union(*(reach[m] for m in reach[n])) - reach[n]
            if more:
                reach[n] |= more
                changed = True
    return sorted({tuple(sorted({n} | {m for m in reach[n] if n in reach[m]})) for n in graph if n in reach[n]})


def upward_imports(graph, layers):
    """['a -> b (file)'] for each import of a node placed at or after the importer in `layers`."""
    place = {n: k for k, n in enumerate(layers)}
    return sorted(f"{a} -> {b} ({files[0]})" for a, deps in graph.items() for b, files in deps.items()
                  if place[b] >= place[a])


def test_the_folder_graph_follows_the_layers():
    graph = folder_graph()
    assert sorted(graph) == sorted(LAYERS), "a folder or root module is missing from LAYERS, or LAYERS names one gone"
    assert cycles(graph) == []
    assert upward_imports(graph, LAYERS) == []
    assert {"chat", "envace"} <= set(graph["worldmodel"]) and "worldmodel" not in graph["chat"]
    assert set(graph["machinery"]) == {"envace", "world"}     # the bottom layer: the paper's tags and splits only


def test_the_check_fails_on_an_import_that_goes_back_up(tmp_path):
    """The mutant: a copy of the library in which machinery imports worldmodel again (as its metrics
    once did) and chat imports worldmodel (as its separate rows once did): both are found, with the
    file, and each is a cycle."""
    for f in library_files():
        dest = tmp_path / f
        dest.parent.mkdir(parents=True, exist_ok=True)
        text = open(os.path.join(ROOT, f), encoding="utf-8").read()
        if f == os.path.join("machinery", "faults.py"):
            text += "\n\ndef _mutant():\n    from worldmodel import honesty\n    return honesty\n"
        if f == os.path.join("chat", "tasks.py"):
            text = "from worldmodel import toolcache  # noqa: F401\n" + text
        dest.write_text(text)
    graph = folder_graph(str(tmp_path))
    ups = upward_imports(graph, LAYERS)
    assert f"machinery -> worldmodel ({os.path.join('machinery', 'faults.py')})" in ups
    assert f"chat -> worldmodel ({os.path.join('chat', 'tasks.py')})" in ups
    assert any({"machinery", "worldmodel"} <= set(group) for group in cycles(graph))
    assert ("chat", "worldmodel") in cycles({"chat": {"worldmodel": []}, "worldmodel": {"chat": []}})


def common_prefix(a, b):
    return len(os.path.commonprefix([a, b]))


def name_clashes(paths, shims=SHIMS, kin=KIN):
    """['name: path, path'] where two modules share a file stem (package __init__ files aside), or a
    folder's name is a module's stem; and ['folder/ ~ module.py'] where a folder is named like a
    root module all but its ending (`rehearsal/` ~ `rehearse.py`, `benchmarks/` ~ `bench.py`: the
    shorter name, its last letter aside, starts the longer). A shim and the module it re-exports
    are not a clash, nor a folder in `kin` with the root module it is named after."""
    by_name = {}
    for p in paths:
        if os.path.basename(p) != "__init__.py":
            by_name.setdefault(os.path.basename(p)[:-3], set()).add(p)
    folders = {p.split(os.sep)[0] for p in paths if os.sep in p}
    for folder in folders:
        if folder in by_name:
            by_name[folder].add(folder + os.sep)
    clashes = [f"{name}: {', '.join(sorted(where))}" for name, where in sorted(by_name.items())
               if len(where) > 1 and sorted(where) not in [sorted(pair) for pair in shims.items()]]
    roots = sorted(p[:-3] for p in paths if os.sep not in p)
    clashes += [f"{folder}/ ~ {root}.py" for folder in sorted(folders) for root in roots
                if folder != root and common_prefix(folder, root) >= min(len(folder), len(root)) - 1
                and kin.get(folder) != root]
    return clashes


def test_no_two_modules_and_no_folder_and_module_share_a_name():
    assert name_clashes(library_files()) == []
    # the check sees the clashes this layout removed, and allows the shim and the kin only
    old = ["rehearse.py", "bench.py", "world.py", "reward.py", "bfcl.py",
           os.path.join("rehearsal", "separate.py"), os.path.join("chat", "separate.py"),
           os.path.join("formats", "chat.py"), os.path.join("chat", "reward.py"), os.path.join("chat", "__init__.py"),
           os.path.join("benchmarks", "bfcl.py"), os.path.join("worlds", "choice.py")]
    assert name_clashes(old) == [
        f"chat: {os.path.join('chat', '')}, {os.path.join('formats', 'chat.py')}",
        f"reward: {os.path.join('chat', 'reward.py')}, reward.py",
        f"separate: {os.path.join('chat', 'separate.py')}, {os.path.join('rehearsal', 'separate.py')}",
        "benchmarks/ ~ bench.py", "rehearsal/ ~ rehearse.py"]
    assert name_clashes(["train.py", os.path.join("training", "metrics.py")]) == ["training/ ~ train.py"]
    assert name_clashes(["world.py", os.path.join("worlds", "choice.py")], kin={}) == ["worlds/ ~ world.py"]
