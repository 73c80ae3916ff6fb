"""The demo's reading load: the functions of this repo that one short demo run executes.

    python -m scripts.reading_load              # a table per file, then the totals
    python -m scripts.reading_load --json       # the same figures as one JSON object

A reader who follows the demo must read every function it calls. This runs `small.yaml` for a short
run (150 warm-start steps, 1 RL step, 8 test tasks, the fidelity gate at 0) in a temporary folder with
a profiler on (sys.setprofile), and counts each function of the repo (tests excluded) that is entered
at least once: how many, in how many files, and how many lines their bodies span (the `def` line to the
last line, docstring included). A function called twice counts once. The figure is a guide for a
reader, not a limit to meet: folding lines or cutting docstrings would lower it and help no one.
The warm start is long enough (about 2 minutes on one thread) for the RL step to find reward variance
and update, so the trace holds the whole update (the loss, the backward, the optimizer step); a run
whose step was skipped is refused, as its trace would leave the update out.
"""
import inspect
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHORT_RUN = ["--config", "small.yaml", "--sft_steps=150", "--rl_steps=1", "--n_test=8", "--n_logged=200",
             "--n_rl_tasks=100", "--eval_every=0", "--n_collusion=4", "--min_fidelity=0"]


def traced_functions(argv):
    """{(file relative to the repo, function name, first line): lines of its body} of every repo
    function (tests excluded) entered while train.main(argv) runs, and train.main's exit status."""
    import threading

    import train
    seen = {}

    def profile(frame, event, arg):
        if event != "call":
            return
        code = frame.f_code
        if code.co_filename.startswith("<") or code.co_name.startswith("<"):    # <frozen os>, <module>, <lambda>
            return
        path = os.path.abspath(code.co_filename)
        if not path.startswith(ROOT + os.sep):
            return
        where = os.path.relpath(path, ROOT)
        if where.startswith("tests" + os.sep):
            return
        key = (where, code.co_name, code.co_firstlineno)
        if key not in seen:
            try:
                seen[key] = len(inspect.getsourcelines(code)[0])
            except (OSError, TypeError):
                seen[key] = 0
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        status = train.main(argv)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return seen, status


def load(seen):
    """The totals and, per file, (functions, lines), the largest first."""
    files = {}
    for (where, _, _), lines in seen.items():
        count, total = files.get(where, (0, 0))
        files[where] = (count + 1, total + lines)
    per_file = dict(sorted(files.items(), key=lambda kv: -kv[1][1]))
    return {"functions": len(seen), "files": len(files), "lines": sum(seen.values()), "per_file": per_file}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv not in ([], ["--json"]):
        print("error: usage: python -m scripts.reading_load [--json]", file=sys.stderr)
        return 2
    import torch
    torch.set_num_threads(1)
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory(prefix="reading_load_") as out:
        seen, status = traced_functions(SHORT_RUN + [f"--out_dir={out}"])
        steps = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))] if status == 0 else []
    if status != 0:
        print(f"error: the short demo run ended with exit status {status}", file=sys.stderr)
        return 1
    if [s["status"] for s in steps] != ["updated"]:
        print(f"error: the short demo run's RL step was {steps[0]['status'] if steps else 'not logged'}, not "
              f"updated: its trace would leave the update out", file=sys.stderr)
        return 1
    figures = load(seen)
    if argv == ["--json"]:
        print(json.dumps(figures))
        return 0
    print(f"{'file':<34} {'functions':>9} {'lines':>6}")
    for where, (count, lines) in figures["per_file"].items():
        print(f"{where:<34} {count:>9} {lines:>6}")
    print(f"the short demo run executes {figures['functions']} functions of the repo in {figures['files']} files, "
          f"{figures['lines']} lines of function bodies")
    return 0


if __name__ == "__main__":
    sys.exit(main())
