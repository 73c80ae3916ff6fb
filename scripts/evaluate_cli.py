"""The command line of evaluate.py: load a run folder of train.py and run one measure on it.

    python evaluate.py --ckpt out/small                 # evaluate.evaluate: <ckpt>/eval.json
    python evaluate.py --ckpt out/small --sweep         # private rehearsal at N = 0, 1, 2, 4
    python evaluate.py --ckpt out/small --coverage      # fidelity by warm-start coverage
    python evaluate.py --ckpt out/small --collusion     # the imagined-world measures only
    python evaluate.py --ckpt out/run --validation      # the validation split (n_val > 0): <checkpoint>/eval_val.json
    python evaluate.py --oracle --test_file=F --out_dir=D   # no model: D/oracle.json (benchmarks/oracle.py)

evaluate.py's `__main__` runs this file as a script, so that evaluate.py holds the evaluation itself
and imports run one way (this file imports evaluate.py, never the reverse). Bad input is one line:
no checkpoint (exit 2), a bad option or override (2), broken weights (1), an unwritable result (2);
Ctrl-C or SIGTERM (130, nothing written); anything unexpected one line naming the phase (1;
--debug: the traceback too).
"""
import json
import os
import sys

import torch

from formats import features
from benchmarks import oracle
from machinery.checkpoint import check_chat_template, find_checkpoint, load_policy, write_file
from machinery.config import ArgumentParser, ConfigError, check_lengths, load_config
from machinery.distributed import autocast, pick_device
from envace import NonFiniteError
from evaluate import evaluate, imagined_summary, summary
from machinery.faults import error_line, sigterm_as_interrupt


def rehearsal_sweep(model, tokenizer, tasks, cfg, fmt, setting, rehearsers, budgets=(0, 1, 2, 4),
                    modes=("parallel", "sequential")):
    """Success against the private-rehearsal budget N, for each mode and each model that plays the
    world in imagination ({name: model or None for the policy itself}). One row per setting."""
    rows = []
    for name, rehearser in rehearsers.items():
        for mode in modes:
            for n in budgets:
                m = evaluate(model, tokenizer, tasks, {**cfg, "rehearsal_budget": n, "rehearsal_mode": mode,
                                                       "n_collusion": 0}, fmt, setting, seed=cfg["seed"],
                             rehearser=rehearser)
                rows.append({"rehearser": name, "mode": mode, "budget": n, "success": m["success"],
                             "imagined_per_task": m["imagined_per_task"], "mean_calls": m["mean_calls"]})
    return rows


def checkpoint_in(folder):
    """The checkpoint a run folder of train.py holds (its latest, ckpt/), or the folder itself when it is
    a checkpoint (warmstart/). ConfigError if there is none."""
    path = find_checkpoint(os.path.join(folder, "ckpt")) or find_checkpoint(folder)
    if path is None or not os.path.isfile(os.path.join(path, "config.yaml")):
        raise ConfigError(f"no checkpoint written by train.py in {folder}")
    return path


def checkpoint_step(path):
    """The RL step a checkpoint was saved at: trainer_state.pt's; 0 for a warm start (none)."""
    state = os.path.join(path, "trainer_state.pt")
    return torch.load(state, map_location="cpu", weights_only=False)["step"] if os.path.isfile(state) else 0


def load_run(folder, overrides, rehearser_path=None, split="test"):
    """(cfg, model, tokenizer, tasks, fmt, setting, rehearser) of a run folder of train.py (its latest
    checkpoint ckpt/) or of a checkpoint folder itself (warmstart/); `tasks`: the test tasks, or with
    split="val" the validation split (the last n_val RL tasks). ConfigError if there is no checkpoint,
    or no validation split (n_val 0)."""
    path = checkpoint_in(folder)
    cfg = load_config(os.path.join(path, "config.yaml"), overrides)
    if split == "val" and not cfg["n_val"]:
        raise ConfigError(f"{os.path.join(path, 'config.yaml')}: n_val is 0, so the run has no validation split "
                          "(give --n_val=N, the run's own N: the last N RL tasks)")
    model, tokenizer = load_policy(path, pick_device(cfg))
    check_chat_template(cfg, tokenizer, path)
    rehearser = load_policy(rehearser_path, pick_device(cfg))[0] if rehearser_path else None
    splits = features.build_tasks(cfg)
    fmt, setting = features.setup(cfg, tokenizer, splits, pick_device(cfg))   # a template that does not fit: one line
    check_lengths(cfg, tokenizer, model.config, splits[split])      # an override of max_tokens: one line
    return cfg, model, tokenizer, splits[split], fmt, setting, rehearser


def write(folder, name, value):
    write_file(os.path.join(folder, name), json.dumps(value, indent=1))     # refused: one line


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", help="a run folder of train.py, or a checkpoint in it")
    parser.add_argument("--n_test", type=int, default=None, help="evaluate on the first N test tasks")
    parser.add_argument("--rehearser", help="a checkpoint that plays the world in private rehearsal")
    parser.add_argument("--sweep", action="store_true",
                        help="private rehearsal with N = 0, 1, 2, 4, parallel and sequential")
    parser.add_argument("--coverage", action="store_true",
                        help="fidelity by warm-start coverage of the run's warm start and latest checkpoint, "
                             "into <ckpt>/coverage.json")
    parser.add_argument("--collusion", action="store_true",
                        help="only the imagined-world measures (collusion), into <ckpt>/collusion.json")
    parser.add_argument("--validation", action="store_true",
                        help="the run's validation split (n_val > 0) instead of the test tasks, into "
                             "<checkpoint>/eval_val.json with the checkpoint's step (scripts.compare --validation)")
    parser.add_argument("--oracle", action="store_true",
                        help="no model: replay each task's gold calls (--test_file=F --out_dir=D; benchmarks/oracle.py)")
    parser.add_argument("--debug", action="store_true", help="an unexpected error's full traceback too")
    try:
        args, overrides = parser.parse_known_args(argv)     # (--help prints and exits 0 here)
        model_options = [f"--{k}" for k in ("ckpt", "n_test", "rehearser", "sweep", "coverage", "collusion",
                                                       "validation")
                         if getattr(args, k) not in (None, False)]
        if args.oracle and model_options:
            raise ConfigError(f"--oracle replays gold calls with no model: it takes no {', '.join(model_options)}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.oracle:
        return oracle.main(overrides)
    phase = ["loading the checkpoint"]
    try:
        sigterm_as_interrupt()                # SIGTERM too: KeyboardInterrupt at once
        return run_main(args, overrides, phase)
    except KeyboardInterrupt:
        print(f"\ninterrupted during {phase[0]}: no result written", file=sys.stderr)
        return 130
    except (Exception, SystemExit) as e:   # user code (raising or exiting), a tokenizer, a library: one line
        print(error_line(e, phase[0], args.debug), file=sys.stderr)
        return 1


def run_main(args, overrides, phase):
    """main's body: ConfigError exits 2, NonFiniteError 1, each one line; phase[0] names the phase."""
    try:
        if not args.ckpt:
            raise ConfigError("give --ckpt <run folder> (runs are compared by python -m scripts.compare --compare)")
        if args.n_test is not None and args.n_test < 1:
            raise ConfigError(f"--n_test must be at least 1, got {args.n_test}")
        if args.validation and (args.sweep or args.coverage or args.collusion or args.n_test):
            raise ConfigError("--validation is the plain evaluation of the whole validation split: it takes no "
                              "--n_test, --sweep, --coverage or --collusion")
        if args.validation and os.path.exists(os.path.join(checkpoint_in(args.ckpt), "eval_val.json")):
            raise ConfigError(f"{os.path.join(checkpoint_in(args.ckpt), 'eval_val.json')} exists already: "
                              "it is kept (move it away to evaluate again)")
        cfg, model, tokenizer, tasks, fmt, setting, rehearser = load_run(args.ckpt, overrides, args.rehearser,
                                                                         "val" if args.validation else "test")
        warm = load_policy(os.path.join(args.ckpt, "warmstart"), pick_device(cfg))[0] if args.coverage else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = tasks[:args.n_test] if args.n_test else tasks
    phase[0] = "evaluation"
    try:
        measure(args, cfg, model, tokenizer, tasks, fmt, setting, rehearser, warm)
    except NonFiniteError as e:                    # broken weights: one line, nothing written
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:                       # the result could not be written: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def measure(args, cfg, model, tokenizer, tasks, fmt, setting, rehearser, warm):
    """What main runs once the checkpoint is loaded: one of the measures, printed and written."""
    if args.coverage:
        result = {when: fmt.coverage(setting, m, tokenizer, tasks) for when, m in (("before", warm), ("after", model))}
        for when, buckets in result.items():
            print(f"{when}: " + ", ".join(f"{b} {m}/{n}" for b, (m, n) in buckets.items()))
        write(args.ckpt, "coverage.json", result)
    elif args.collusion:
        metrics = fmt.imagined_world(setting, model, tokenizer, tasks[:cfg["n_collusion"] or len(tasks)], cfg,
                                     torch.Generator().manual_seed(cfg["seed"]))
        print(imagined_summary(metrics) if metrics else "no task has an executor: no real response to "
              "compare imagined ones with (docs/tools.md)")
        write(args.ckpt, "collusion.json", metrics)
    elif args.sweep:
        rehearsers = {"policy": None, **({"rehearser": rehearser} if rehearser is not None else {})}
        rows = rehearsal_sweep(model, tokenizer, tasks, cfg, fmt, setting, rehearsers)
        for r in rows:
            print(f"{r['rehearser']:9s} {r['mode']:10s} N={r['budget']}: success {r['success']:.3f}, "
                  f"{r['imagined_per_task']:.2f} imagined and {r['mean_calls']:.2f} real calls per task")
        write(args.ckpt, "private_rehearsal.json", rows)
    elif args.validation:        # as train.py's evaluations during RL: the same split, seed and autocast
        path = checkpoint_in(args.ckpt)
        with autocast(cfg, pick_device(cfg)):
            metrics = evaluate(model, tokenizer, tasks, cfg, fmt, setting, seed=cfg["seed"], rehearser=rehearser)
        step = checkpoint_step(path)
        print(f"validation ({len(tasks)} tasks), step {step}: {summary(metrics)}")
        write(path, "eval_val.json", {**metrics, "step": step})
        print(f"written to {os.path.join(path, 'eval_val.json')}")
    else:
        metrics = evaluate(model, tokenizer, tasks, cfg, fmt, setting, seed=cfg["seed"], rehearser=rehearser)
        print(summary(metrics))
        name = "evaluate.json" if os.path.exists(os.path.join(args.ckpt, "eval.json")) else "eval.json"
        write(args.ckpt, name, metrics)        # train.py's eval.json (with `before`) is kept as it is
        print(f"written to {os.path.join(args.ckpt, name)}")


if __name__ == "__main__":
    sys.exit(main())
