"""Both arms from one warm start, per seed: the driver behind configs/run_smollm2_arms.sh.

    python -m scripts.arms RESULTS [--seeds 1 2 3] [--config C] [--args "--key=value ..."] [--parallel]

Per seed s: a warm start and its evaluation (`train.py --config C --seed=s ARGS --rl_steps=0`, into
RESULTS/warmstart_seed<s>); its warmstart/ copied into RESULTS/rehearse_seed<s> and RESULTS/real_seed<s>,
each continued with `--resume --env_mode=MODE ARGS` (the warm start's evaluation redone there: `before`
in each eval.json). After each seed: each arm's before/after, and real - rehearse after RL, pooled over
the seeds done so far (scripts.compare). ARGS (`--key=value` overrides) reach all three runs, but the warm
start always stops at `--rl_steps=0`: a GPU's `--rl_steps=60` is the arms' budget, not the warm start's.

Restartable: a second call continues what is left. A run whose eval.json exists is kept; a run that holds
a checkpoint (a warm start, an RL checkpoint) is continued with --resume; a copy of warmstart/ that a stop
cut short is made again. A call whose config or ARGS would give a run in RESULTS another value of a key
than the one it ran with is refused, naming the run and the key, before anything starts (its figures
would be printed as this call's). Each run's output goes to RESULTS/<run>.log, whose last line says the
run's wall time and peak resident size (a --resume counts from the continuation); a run that fails
prints its own error line here too, naming its log. Ctrl-C or SIGTERM reaches the running train.py (each saves
what it has, as train.py does alone), then this exits 130; the same command continues.
"""
import filecmp
import os
import shutil
import signal
import subprocess
import sys
import time

import yaml

from machinery.config import DEFAULTS, ArgumentParser, ConfigError, load_config
from scripts import compare

MODES = ("real", "rehearse")
SET_HERE = ("seed", "out_dir", "env_mode")      # the driver's own keys: not for ARGS
MAY_DIFFER = ("out_dir",)                       # a copied run is compared with the call's own config


class Interrupted(Exception):
    """Ctrl-C or SIGTERM reached the driver (and was passed on to its running train.py)."""


def run_config(config, overrides):
    """The config train.py will run with (the same loader, the same checks)."""
    return load_config(config, overrides)


def check_same_config(run, cfg):
    """ConfigError naming the key if `run` already ran with another value of it than `cfg` gives
    (a key its config.yaml lacks had its default then)."""
    path = os.path.join(run, "config.yaml")
    if not os.path.isfile(path):
        return
    with open(path) as f:
        saved = yaml.safe_load(f) or {}
    for key in cfg:
        if key in MAY_DIFFER:
            continue
        was = saved.get(key, DEFAULTS.get(key))
        if was != cfg[key]:
            raise ConfigError(f"{run} ran with {key}={was!r}, this call gives {key}={cfg[key]!r} (its config or "
                              f"ARGS): continuing it would mix two experiments; call with the ARGS it ran with, "
                              f"or give another RESULTS folder")


def holds_checkpoint(run):
    return any(os.path.isdir(os.path.join(run, name)) for name in ("ckpt", "ckpt.old", "warmstart"))


def copy_warm_start(warm, run):
    """`warm`'s warmstart/ into `run`, whole: copied to warmstart.copying, then renamed. A copy that a
    stop cut short (warmstart.copying left, or a warmstart/ with files missing or of other sizes, from
    an earlier driver) is made again: it is this driver's own copy of a folder that is still whole."""
    source, target = os.path.join(warm, "warmstart"), os.path.join(run, "warmstart")
    partial = target + ".copying"
    if os.path.isdir(target) and not os.path.isdir(os.path.join(run, "ckpt")) and not same_files(source, target):
        print(f"{target}: not a whole copy of {source}: copying it again", file=sys.stderr)
        shutil.rmtree(target)
    if os.path.isdir(target):
        return
    if os.path.isdir(partial):
        shutil.rmtree(partial)
    os.makedirs(run, exist_ok=True)
    shutil.copytree(source, partial)
    os.rename(partial, target)


def same_files(a, b):
    """The same file names under both folders, each of the same size and content."""
    compared = filecmp.dircmp(a, b)
    if compared.left_only or compared.right_only or compared.funny_files:
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, compared.common_files, shallow=False)
    return not mismatch and not errors and all(same_files(os.path.join(a, d), os.path.join(b, d))
                                               for d in compared.common_dirs)


def start(run, command, threads):
    """train.py as a child in its own process group (a signal reaches it once: from here), its output
    into <run>.log."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)} if threads else None
    log = open(run + ".log", "a")
    child = subprocess.Popen([sys.executable, "train.py", *command], stdout=log, stderr=subprocess.STDOUT,
                             env=env, start_new_session=True)
    log.close()
    child.started = time.time()
    return child


def finish(children, done_file):
    """Wait for every (run, child), each one's wall time and peak resident size (the kernel's count for
    that process alone) the last line of its <run>.log; a run that failed, or stopped before writing
    `done_file` (a signal that reached it alone), is a RunFailed carrying its own error line."""
    for run, child in children:
        if child.returncode is None:
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
            with open(run + ".log", "a") as log:
                log.write(f"{run}: exit status {child.returncode}, {time.time() - child.started:.1f} s wall, "
                          f"peak resident {usage.ru_maxrss} KiB\n")
    for run, child in children:
        if child.returncode or not os.path.isfile(os.path.join(run, done_file)):
            raise RunFailed(run, child.returncode)


class RunFailed(Exception):
    """A train.py run that did not finish: its exit status and its own last error line."""
    def __init__(self, run, code):
        self.code = code if code in (1, 2) else 1
        why = f"exit status {code}: {last_error(run + '.log')}" if code else "it stopped before its evaluation"
        super().__init__(f"{run}: {why} (its log: {run}.log); the same command continues it")


def last_error(log):
    """The last `error` line train.py wrote to `log` (its one line for a mistake or fault)."""
    try:
        with open(log, errors="replace") as f:
            lines = [line.strip() for line in f if line.startswith(("error", "interrupted"))]
    except OSError:
        lines = []
    line = lines[-1] if lines else "no error line"
    return line[len("error: "):] if line.startswith("error: ") else line


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="?", default="out/smollm2-arms")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--config", default="configs/smollm2-separate.yaml")
    parser.add_argument("--args", default="", help="--key=value overrides for every run, e.g. '--device=cuda --rl_steps=60'")
    parser.add_argument("--parallel", action="store_true", help="a seed's two arms at once, one thread each")
    children, args = [], None

    def on_signal(signum, frame):        # pass it on once; each train.py saves and exits in seconds
        for _, child in children:
            if child.poll() is None:
                child.send_signal(signum)
        raise Interrupted()
    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        args = parser.parse_args(argv)
        return run_arms(args, children)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return e.code
    except Interrupted:
        signal.signal(signal.SIGINT, signal.SIG_IGN)     # a second Ctrl-C while the runs save: ignored here
        for _, child in children:
            child.wait()
        where = f" (logs in {args.results})" if args else ""
        print(f"interrupted: each run saved what it had{where}; the same command continues", file=sys.stderr)
        return 130
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


def run_arms(args, children):
    results, extra = args.results, args.args.split()
    if os.path.exists(results) and not os.path.isdir(results):
        raise ConfigError(f"RESULTS {results} is a file, not a folder")
    for arg in extra:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"ARGS: cannot read '{arg}': overrides are --key=value")
        if arg[2:].split("=", 1)[0] in SET_HERE:
            raise ConfigError(f"ARGS: {arg.split('=')[0]} is set by the driver for each run (seed, out_dir, env_mode)")
    # every run's config first: a mistake, or a RESULTS folder that ran otherwise, is refused before anything starts
    plans = []
    for s in args.seeds:
        warm = os.path.join(results, f"warmstart_seed{s}")
        warm_args = [f"--seed={s}", *extra, "--rl_steps=0", f"--out_dir={warm}"]
        arms = [(os.path.join(results, f"{mode}_seed{s}"),
                 [f"--seed={s}", *extra, f"--env_mode={mode}"]) for mode in MODES]
        for run, overrides in [(warm, warm_args), *arms]:
            check_same_config(run, run_config(args.config, [*overrides, f"--out_dir={run}"]))
        plans.append((s, warm, warm_args, arms))
    os.makedirs(results, exist_ok=True)
    threads = 1 if args.parallel else None
    pairs = []
    for s, warm, warm_args, arms in plans:
        if not os.path.isfile(os.path.join(warm, "warmstart", "eval.json")):
            resume = ["--resume"] if holds_checkpoint(warm) else []
            children[:] = [(warm, start(warm, ["--config", args.config, *warm_args, *resume], None))]
            finish(children, os.path.join("warmstart", "eval.json"))
        for run, overrides in arms:
            if os.path.isfile(os.path.join(run, "eval.json")):
                continue
            copy_warm_start(warm, run)
            children.append((run, start(run, ["--config", args.config, *overrides, f"--out_dir={run}", "--resume"],
                                        threads)))
            if not args.parallel:
                finish(children[-1:], "eval.json")
        finish(children, "eval.json")
        children.clear()
        pairs += [os.path.join(results, f"real_seed{s}"), os.path.join(results, f"rehearse_seed{s}")]
        for command in (["--before_after", pairs[-1]], ["--before_after", pairs[-2]], ["--difference", *pairs]):
            code = compare.main(command)
            if code:
                return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
