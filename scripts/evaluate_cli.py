"""The command line of evaluate.py: load a run folder of train.py (or a model as it is) and run one measure on it.

    python evaluate.py --ckpt out/small                 # evaluate.evaluate: <ckpt>/eval.json
    python evaluate.py --model PATH --config CONFIG     # a model as it is (no training): <out_dir>/eval.json
    python evaluate.py --ckpt out/small --sweep         # private rehearsal at N = 0, 1, 2, 4
    python evaluate.py --ckpt out/small --coverage      # fidelity by warm-start coverage
    python evaluate.py --ckpt out/small --collusion     # the imagined-world measures only
    python evaluate.py --ckpt out/run --validation      # the validation split (n_val > 0): <checkpoint>/eval_val.json
    python evaluate.py --oracle --test_file=F --out_dir=D   # no model: D/oracle.json (benchmarks/oracle.py)

--model is the untrained baseline: PATH is what a config's `model` key names (a Hugging Face folder,
a hub name, or gguf:PACKAGE/FILE.gguf), built as train.py builds it and evaluated under CONFIG's chat
template, tasks and limits; --sweep and --collusion take it too, and write into out_dir as well.
evaluate.py's `__main__` runs this file as a script, so that evaluate.py holds the evaluation itself
and imports run one way (this file imports evaluate.py, never the reverse). Bad input is one line:
no checkpoint or model (exit 2), a bad option or override (2), broken weights (1), an unwritable
result (2); Ctrl-C or SIGTERM (130, nothing written); anything unexpected one line naming the phase
(1; --debug: the traceback too).
"""
import json
import os
import sys

import torch
from transformers.utils import logging as hf_logging

from formats import features
from benchmarks import oracle
from machinery.checkpoint import (build_policy, check_chat_template, find_checkpoint, is_checkpoint, load_policy,
                                  write_file)
from machinery.config import ArgumentParser, ConfigError, load_config
from machinery.distributed import autocast, pick_device
from envace import NonFiniteError
from evaluate import evaluate, imagined_summary, summary
from machinery.faults import error_line, sigterm_as_interrupt

hf_logging.disable_progress_bar()     # transformers' load bars: a mistake found after loading stays one line


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
    a checkpoint (warmstart/). ConfigError if there is none (a model train.py did not write: --model)."""
    path = find_checkpoint(os.path.join(folder, "ckpt")) or find_checkpoint(folder)
    if path is None or not os.path.isfile(os.path.join(path, "config.yaml")):
        hint = f": to evaluate the model in it as it is, give --model {folder} --config CONFIG" \
            if is_checkpoint(folder) else ""
        raise ConfigError(f"no checkpoint written by train.py in {folder}{hint}")
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
    return (cfg, model, tokenizer, *prepare(cfg, model, tokenizer, split, rehearser_path))


def load_model(path, config_path, overrides, rehearser_path=None):
    """(cfg, model, tokenizer, tasks, fmt, setting, rehearser) of a model as it is: the config file
    `config_path` with its --key=value `overrides` and `model: path`, the model and tokenizer built
    from it as train.py builds them (checkpoint.build_policy: the chat_template key applied), the
    test tasks."""
    cfg = load_config(config_path, [*overrides, f"--model={path}"])
    model, tokenizer = build_policy(cfg, False, pick_device(cfg), 1, features.tiny_words)[:2]
    return (cfg, model, tokenizer, *prepare(cfg, model, tokenizer, "test", rehearser_path))


def prepare(cfg, model, tokenizer, split, rehearser_path):
    """(tasks, fmt, setting, rehearser) for a loaded model: the split's tasks, checked against the
    model's context and max_tokens as train.py checks the RL and test tasks (one line each: a template
    that does not fit, a prompt too long, an override of max_tokens), the format and its setting."""
    rehearser = load_policy(rehearser_path, pick_device(cfg))[0] if rehearser_path else None
    splits = features.build_tasks(cfg)
    features.check_prompt_lengths(cfg, tokenizer, model.config, splits["rl"] + splits[split])
    fmt, setting = features.setup(cfg, tokenizer, splits, pick_device(cfg))
    return splits[split], fmt, setting, rehearser


def write(folder, name, value):
    write_file(os.path.join(folder, name), json.dumps(value, indent=1))     # refused: one line


def main(argv=None):
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", help="a run folder of train.py, or a checkpoint in it")
    parser.add_argument("--model", help="a model as it is, as a config's model key names it (a Hugging Face folder "
                                        "or gguf:PACKAGE/FILE.gguf), evaluated under --config into <out_dir>/eval.json")
    parser.add_argument("--config", help="the config --model is evaluated under (its chat template, tasks and limits)")
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
        model_options = [f"--{k}" for k in ("ckpt", "model", "config", "n_test", "rehearser", "sweep", "coverage",
                                            "collusion", "validation")
                         if getattr(args, k) not in (None, False)]
        if args.oracle and model_options:
            raise ConfigError(f"--oracle replays gold calls with no model: it takes no {', '.join(model_options)}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.oracle:
        return oracle.main(overrides)
    phase = ["loading the model" if args.model is not None else "loading the checkpoint"]
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
        check_model_options(args)
        if args.n_test is not None and args.n_test < 1:
            raise ConfigError(f"--n_test must be at least 1, got {args.n_test}")
        if args.validation and (args.sweep or args.coverage or args.collusion or args.n_test):
            raise ConfigError("--validation is the plain evaluation of the whole validation split: it takes no "
                              "--n_test, --sweep, --coverage or --collusion")
        if args.validation and os.path.exists(os.path.join(checkpoint_in(args.ckpt), "eval_val.json")):
            raise ConfigError(f"{os.path.join(checkpoint_in(args.ckpt), 'eval_val.json')} exists already: "
                              "it is kept (move it away to evaluate again)")
        if args.model is not None:
            cfg, model, tokenizer, tasks, fmt, setting, rehearser = load_model(args.model, args.config, overrides,
                                                                               args.rehearser)
        else:
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


def check_model_options(args):
    """What to evaluate: --ckpt (a run of train.py) or --model with --config (a model as it is), one
    of them; ConfigError otherwise, one line naming both."""
    if args.ckpt is not None and args.model is not None:
        raise ConfigError("--ckpt evaluates a run of train.py, --model a model as it is: give one of them")
    if args.model is None and not args.ckpt:
        raise ConfigError("give --ckpt <run folder>, or --model PATH --config CONFIG for a model as it is "
                          "(runs are compared by python -m scripts.compare --compare)")
    if args.model is None and args.config is not None:
        raise ConfigError("--config goes with --model: --ckpt evaluates under its run's config.yaml "
                          "(change a key with --key=value)")
    if args.model == "":
        raise ConfigError("--model is empty: give a Hugging Face folder or gguf:PACKAGE/FILE.gguf (and --config)")
    if args.model is not None and not args.config:
        raise ConfigError(f"--model {args.model} needs --config CONFIG: its chat template, tasks and limits")
    if args.model is not None and (args.coverage or args.validation):
        raise ConfigError("--coverage and --validation read a run of train.py: give --ckpt, not --model")


def measure(args, cfg, model, tokenizer, tasks, fmt, setting, rehearser, warm):
    """What main runs once the model is loaded: one of the measures, printed and written into the
    --ckpt folder (--model: cfg out_dir)."""
    folder = args.ckpt or cfg["out_dir"]
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
        write(folder, "collusion.json", metrics)
    elif args.sweep:
        rehearsers = {"policy": None, **({"rehearser": rehearser} if rehearser is not None else {})}
        rows = rehearsal_sweep(model, tokenizer, tasks, cfg, fmt, setting, rehearsers)
        for r in rows:
            print(f"{r['rehearser']:9s} {r['mode']:10s} N={r['budget']}: success {r['success']:.3f}, "
                  f"{r['imagined_per_task']:.2f} imagined and {r['mean_calls']:.2f} real calls per task")
        write(folder, "private_rehearsal.json", rows)
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
        name = "evaluate.json" if os.path.exists(os.path.join(folder, "eval.json")) else "eval.json"
        write(folder, name, metrics)           # an eval.json there (train.py's, with `before`) is kept as it is
        print(f"written to {os.path.join(folder, name)}")


if __name__ == "__main__":
    sys.exit(main())
