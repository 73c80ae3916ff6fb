"""Trace one RL step of the demo (one process): the repo's functions in first-call order.

    python docs/measurements/trace_step.py --model=WARMSTART --seed=3 --tasks_per_step=32
    python docs/measurements/trace_step.py --sft_steps=60 --seed=3 --tasks_per_step=32   # any commit
(run from the repository root; a warm start whose step updates: with an untrained model every
group has equal rewards and the update is skipped). Recording starts when the RL bar is built
(train.tqdm with desc "RL ...") and stops when the step's line is appended to metrics.jsonl, so it
needs nothing of the code it traces but those two: the second form trains its own warm start, so
the same command compares any two versions of the code. Counts every function of the repository's
*.py files (tests left out) called in between (lambdas, comprehensions and dunders left out),
named module.function by the file's path (`chat/chat_reward.py` -> `chat.chat_reward`); prints the sequence
and the counts of functions, file switches and files, the same for the paper's path files alone,
and which functions are 8 lines or fewer."""
import ast, builtins, glob, os, sys, tempfile
sys.path.insert(0, os.getcwd())
import train
ROOT = os.getcwd()
REPO = {os.path.abspath(f): os.path.relpath(f, ROOT)[:-3].replace(os.sep, ".")
        for f in glob.glob(os.path.join(ROOT, "**", "*.py"), recursive=True)
        if not os.path.relpath(f, ROOT).startswith(("tests" + os.sep, "docs" + os.sep))}
seq = []
# the design card's files (f01e109's step touched no other)
PAPER_PATH = {"envace", "world", "rollout", "reward", "rehearse", "train", "evaluate"}
def prof(frame, event, arg):
    f, name = os.path.abspath(frame.f_code.co_filename), frame.f_code.co_name
    if event == "call" and f in REPO and not name.startswith("<") and not name.startswith("__"):
        key = (REPO[f], name)
        if key not in seq:
            seq.append(key)
real_tqdm, real_open = train.tqdm, builtins.open
def tqdm(*args, **kwargs):
    if str(kwargs.get("desc", "")).startswith("RL"):
        sys.setprofile(prof)
    return real_tqdm(*args, **kwargs)
def open_(path, mode="r", *args, **kwargs):
    if seq and str(path).endswith("metrics.jsonl") and "a" in mode:
        sys.setprofile(None)
        files = [m for m, _ in seq]
        print(" -> ".join(f"{m}.{n}" for m, n in seq))
        print(f"{len(seq)} functions, {sum(a != b for a, b in zip(files, files[1:]))} file switches, "
              f"{len(set(files))} files")
        path = [m for m in files if m in PAPER_PATH]   # the same sequence, the extensions' functions left out
        print(f"the paper's path alone: {len(path)} functions, {sum(a != b for a, b in zip(path, path[1:]))} "
              f"file switches, {len(set(path))} files")
        small = [f"{m}.{n}" for m, n in seq if lines_of(m, n) <= 8]
        print(f"{len(small)} of the {len(seq)} are 8 lines or fewer (def to last line): {' '.join(small)}")
        os._exit(0)
    return real_open(path, mode, *args, **kwargs)
def lines_of(module, name):   # the shortest def of that name in the module's file (ast spans)
    tree = ast.parse(real_open(os.path.join(ROOT, *module.split(".")) + ".py").read())
    return min(n.end_lineno - n.lineno + 1 for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
train.tqdm, builtins.open = tqdm, open_
sys.exit(train.main(["--config", "small.yaml", "--sft_steps=0", "--rl_steps=1", "--min_fidelity=0", "--n_test=4",
                     f"--out_dir={tempfile.mkdtemp()}/run"] + sys.argv[1:]))
