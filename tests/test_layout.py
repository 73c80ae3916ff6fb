"""The paper's path stays readable in one sitting: the shape of the repo, held.

The design card's files (plus the toy world) are the paper's path, at the root: no branch on a
feature chosen at setup (the format, the rehearsal layout, FSDP) in them; the extensions live in
packages whose imports name the folder, and no import cycle runs through the repo; code points to
docs, not to issue numbers; prose (docstrings, comments, docs) names each function where it lives
now. Sizes (lines a file, lines a function) are guides for a reader, printed by
`python docs/measurements/import_graph.py --sizes`, not limits held here. The seam the loop calls
through: every format module defines the same functions (features.INTERFACE) as defs with one
signature."""
import ast
import glob
import inspect
import io
import os
import re
import tokenize
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER_PATH = ["envace.py", "world.py", "rollout.py", "reward.py", "rehearse.py", "train.py", "evaluate.py"]
FEATURE_WORDS = ("format", "rehearsal_context", "fsdp")


def source(name):
    return open(os.path.join(ROOT, name)).read()


def feature_branches(src):
    """[(line, test)] of the if / while / conditional expressions whose test names a feature."""
    return [(n.lineno, ast.get_source_segment(src, n.test)) for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.If, ast.IfExp, ast.While))
            and any(w in ast.get_source_segment(src, n.test) for w in FEATURE_WORDS)]


def test_the_check_sees_a_feature_branch():
    src = 'def step(cfg):\n    if cfg["format"] == "chat":\n        return 1\n    return 2 if cfg["fsdp"] else 3\n'
    assert feature_branches(src) == [(2, 'cfg["format"] == "chat"'), (4, 'cfg["fsdp"]')]


def test_core_functions_do_not_branch_on_a_feature_chosen_at_setup():
    assert {f: feature_branches(source(f)) for f in PAPER_PATH if feature_branches(source(f))} == {}


def repo_files(*patterns):
    """The repository's files matching any of the glob patterns (relative to ROOT), as absolute paths."""
    return [f for pattern in patterns for f in glob.glob(os.path.join(ROOT, pattern))]


def test_code_and_configs_point_to_docs_not_to_issue_numbers():
    files = repo_files("*.py", "*.yaml", "configs/*", "tests/*.py", ".ci/*")
    assert len(files) > 60
    issue = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    hits = [f"{os.path.relpath(f, ROOT)}:{i}" for f in files for i, line in enumerate(open(f), 1)
            if issue.search(line)]
    assert hits == []


def module_names(src):
    """What `module.name` can name in a module: its top-level functions, classes, assignments and imports."""
    names = set()
    for n in ast.parse(src).body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            names.update(t.id for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                         if isinstance(t, ast.Name))
    return names


def stale_references(text, modules):
    """[(line, 'module.name')] where prose names a module's function that the module does not define."""
    ref = re.compile(r"(?<![\w/.-])(" + "|".join(map(re.escape, modules)) + r")\.([A-Za-z_]\w*)\b")
    files = {"py", "md", "yaml", "json", "jsonl", "png", "txt", "sh", "pt"}
    return [(i, f"{m}.{name}") for i, line in enumerate(text.split("\n"), 1) for m, name in ref.findall(line)
            if name not in modules[m] and name not in files]


def prose(path):
    """A file's prose with its line numbers kept: a .py file's strings and comments (code blanked), else all of it."""
    text = open(path).read()
    if not path.endswith(".py"):
        return text
    lines = [""] * (text.count("\n") + 1)
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in (tokenize.STRING, tokenize.COMMENT):
            for k, part in enumerate(tok.string.split("\n")):
                lines[tok.start[0] - 1 + k] += " " + part
    return "\n".join(lines)


def module_aliases():
    """{name prose may use for a module: the names its module defines or imports}: a root module by
    its own name (`rollout`), a package module by its dotted name (`chat.format`) and by every name
    other modules import it as (`from chat import chat_reward` -> `chat_reward`)."""
    files = {os.path.relpath(f, ROOT)[:-3].replace(os.sep, "."): f
             for f in repo_files("*.py", "*/*.py") if not os.path.relpath(f, ROOT).startswith(("tests", "docs"))
             and not f.endswith("__init__.py")}
    modules = {m: module_names(open(f).read()) for m, f in files.items()}
    for f in list(files.values()) + repo_files("tests/*.py"):
        for n in ast.walk(ast.parse(open(f).read())):
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0:
                for a in n.names:
                    if f"{n.module}.{a.name}" in files:
                        modules.setdefault(a.asname or a.name, set()).update(modules[f"{n.module}.{a.name}"])
    for m in files:                        # a package names its modules: chat.format
        if "." in m:
            modules.setdefault(m.split(".")[0], set()).add(m.split(".")[1])
    return dict(sorted(modules.items(), key=lambda kv: -len(kv[0])))   # the regex tries chat.format before chat


def test_docs_and_docstrings_name_functions_where_they_live(tmp_path):
    modules = module_aliases()
    assert {"rollout", "chat.format", "chat_reward", "honesty"} <= set(modules)
    fixture = tmp_path / "m.py"       # a moved function in a docstring and a comment; code is left to import
    fixture.write_text('"""See envace.clipped_pg_loss\nand envace.save_checkpoint; envace.py is a file."""\n'
                       'x = envace.gone   # or reward.gone\n')
    assert stale_references(prose(str(fixture)), modules) == [(2, "envace.save_checkpoint"), (3, "reward.gone")]
    files = [f for f in repo_files("*.py", "*/*.py", "tests/*.py", "docs/*.md", "README.md", "*.yaml", "configs/*.yaml")
             if f != os.path.abspath(__file__)]   # this file holds the fixture's names
    assert len(files) > 80
    hits = [f"{os.path.relpath(f, ROOT)}:{i}: {name}" for f in files for i, name in stale_references(prose(f), modules)]
    assert hits == []


def test_the_root_holds_the_paper_path_and_the_commands_users_type():
    """`ls` shows the paper's files first: every other module lives in a package named for what it
    is (the commands that are not the paper's in scripts/); the root keeps only bfcl.py, the name
    old BFCL task files give their executor and check (and the converter's command)."""
    root_modules = sorted(os.path.basename(f) for f in repo_files("*.py"))
    assert root_modules == sorted(PAPER_PATH + ["bfcl.py"])
    for package in {os.path.dirname(os.path.relpath(f, ROOT)) for f in repo_files("*/*.py")} - {"tests", "docs", "data"}:
        assert os.path.isfile(os.path.join(ROOT, package, "__init__.py")), package


def interface_drift(modules, names):
    """[(module, name, why)] where a format module's `name` is not a def of that name (a lambda, a
    partial, missing) or its signature differs from the first module's."""
    first = {name: inspect.signature(getattr(modules[0], name)) for name in names}
    drift = []
    for module in modules:
        for name in names:
            f = getattr(module, name, None)
            if not (inspect.isfunction(f) and f.__name__ == name):
                drift.append((module.__name__, name, "not a def"))
            elif inspect.signature(f) != first[name]:
                drift.append((module.__name__, name, str(inspect.signature(f))))
    return drift


def test_every_format_defines_the_interface_with_one_signature():
    from formats import features
    assert features.INTERFACE[:3] == ("setup", "inputs", "sample") and len(features.INTERFACE) == 15
    assert [m.__name__ for m in features.FORMATS] == [
        "formats.format_plain", "formats.format_plain_separate", "formats.format_uncertain", "formats.format_choice",
        "formats.format_chat", "formats.format_chat_separate"]
    assert interface_drift(features.FORMATS, features.INTERFACE) == []
    # the check sees a default that drifted, a lambda and a missing name
    plain = types.SimpleNamespace(__name__="plain", coverage=lambda setting, pairs=None: 0)
    chat = types.SimpleNamespace(__name__="chat", coverage=lambda setting, pairs=(): 0)
    plain.coverage.__name__ = chat.coverage.__name__ = "coverage"
    assert interface_drift([plain, chat], ["coverage"]) == [("chat", "coverage", "(setting, pairs=())")]
    odd = types.SimpleNamespace(__name__="odd", coverage=lambda setting, pairs=None: 0)
    assert interface_drift([plain, odd, types.SimpleNamespace(__name__="none")], ["coverage"]) == [
        ("odd", "coverage", "not a def"), ("none", "coverage", "not a def")]


def test_the_format_is_chosen_once_from_the_config():
    from formats import features
    keys = [("plain", "toy", "inline"), ("plain", "toy", "separate"), ("plain", "uncertain", "inline"),
            ("plain", "choice", "inline"), ("chat", "toy", "inline"), ("chat", "toy", "separate")]
    chosen = [features.choose({"format": f, "world": w, "rehearsal_context": r}).__name__ for f, w, r in keys]
    assert chosen == ["formats.format_plain", "formats.format_plain_separate", "formats.format_uncertain",
                      "formats.format_choice", "formats.format_chat", "formats.format_chat_separate"]
