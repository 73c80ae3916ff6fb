"""Trace one RL step of the demo (rehearse mode, one process): repo functions in first-call order.

    python docs/measurements/trace_step.py --model=WARMSTART --seed=3 --tasks_per_step=32
(a warm start whose step updates: with an untrained model every group has equal rewards and the
update is skipped). Prints the sequence from features' plain `inputs` to metrics.step_record and
the counts of functions, file switches and files."""
import os, sys, glob
sys.path.insert(0, os.getcwd())
import train, features
INPUTS_LINE = next(i for i, l in enumerate(open(features.__file__), 1) if "inputs=lambda tasks, repeat=1" in l)
ROOT = os.getcwd()
REPO = {os.path.abspath(f) for f in glob.glob(os.path.join(ROOT, "*.py"))}
seq, on = [], [False]
def prof(frame, event, arg):
    if event != "call":
        return
    f = os.path.abspath(frame.f_code.co_filename)
    name = frame.f_code.co_name
    if name == "start_metrics":
        on[0] = "armed"
    if on[0] == "armed" and f.endswith("features.py") and name == "<lambda>" and frame.f_code.co_firstlineno == INPUTS_LINE:
        on[0] = True
    if on[0] is True and f in REPO and not name.startswith("<") and name not in ("__init__", "__enter__", "__exit__"):
        key = (os.path.basename(f)[:-3], name)
        if key not in seq:
            seq.append(key)
    if on[0] is True and name == "step_record":
        on[0] = "last"
real_write = train.write_file
def write_file(path, text, mode="w"):
    if on[0] == "last":
        sys.setprofile(None); report(); os._exit(0)
    return real_write(path, text, mode)
train.write_file = write_file
def report():
    files = [m for m, _ in seq]
    switches = sum(a != b for a, b in zip(files, files[1:]))
    print(" -> ".join(f"{m}.{n}" for m, n in seq))
    print(f"{len(seq)} functions, {switches} file switches, {len(set(files))} files")
sys.setprofile(prof)
sys.exit(train.main(["--config", "small.yaml", "--sft_steps=0", "--rl_steps=1", "--min_fidelity=0", "--n_test=4",
                     "--n_collusion=0", "--out_dir=/tmp/trace_run", "--overwrite"] + sys.argv[1:]))
