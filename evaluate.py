"""Evaluation in the REAL toy world: the only place the true dynamics are used.

The paper trains with rehearsal but reports success on real benchmarks; likewise here every
success figure is measured with the real world answering the policy's calls, never with the
policy's own rehearsals (an imagined success can rise while the real one does not). Besides
success, it reports how episodes ended (format errors), the mean number of calls, and the
rehearsal fidelity the model would have had if it had rehearsed those calls itself. To see
whether the world model stayed honest, it also lets the policy act AND rehearse (no real call in
the loop) on the first `n_collusion` test tasks: success in that imagined world, the fidelity of
those rehearsals against a real replay, and the collusion rate (honesty.collusion_counts).

    python evaluate.py --ckpt out/small                 # the RL'd policy
    python evaluate.py --ckpt out/small/warmstart       # the warm start it came from
    python evaluate.py --ckpt out/small --coverage      # fidelity by warm-start coverage, before and
                                                        # after RL: <ckpt>/coverage.json
    python evaluate.py --ckpt out/small --collusion     # the imagined-world measures only:
                                                        # <ckpt>/collusion.json, eval.json untouched
    python evaluate.py --oracle --test_file=F --out_dir=D   # no model: each task's gold calls
                                                        # replayed and scored (oracle.py), D/eval.json

What depends on the format and the rehearsal layout comes from `fx` (features.py). Chat tasks
with no executor are rehearsed by the policy and every line calls their figure "rehearsed success
(no executor)", never real-world (`success_name`; docs/tools.md). Writes <ckpt>/eval.json, or
<ckpt>/evaluate.json where train.py's eval.json (with its `before` record) is already there.
"""
import argparse
import json
import os
import sys

import torch

import features
import oracle
import honesty
import rehearse
from checkpoint import find_checkpoint, load_policy, write_file
from config import ConfigError, check_lengths, load_config
from distributed import pick_device
from envace import NonFiniteError
from faults import error_line
from reward import outcome_record
from rollout import sample_episodes


def evaluate(model, tokenizer, tasks, cfg, fx, batch_size=512, seed=0, rehearser=None):
    """Paper, evaluation by real execution: run `tasks` in the REAL world (sampling per cfg eval_temperature/top_p) and measure
    success, how episodes ended, and would-rehearse fidelity per tool kind. Tasks no executor can
    run (fx.executes) are rehearsed by the policy instead, and counted apart. With cfg
    rehearsal_budget N > 0, each task is first privately rehearsed N times (rehearse.py;
    `rehearser` plays the world in imagination instead of the policy if given) and the real
    execution commits to the plan. Returns the eval.json dict, with `task_rewards` (per task, in
    order: experiments.paired_bootstrap) and the world's own figures in `extras` (fx.eval_extras:
    world: uncertain's per-subset truth probe and success; absent for the demo's world)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    limits = {k: cfg[k] for k in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
    sampling = {"temperature": cfg["eval_temperature"], "top_p": cfg["top_p"], "generator": generator, **limits}
    executed = [i for i, t in enumerate(tasks) if fx.executes(t)]
    episodes, imagined = [None] * len(tasks), [0] * len(tasks)
    for mode, index in (("real", executed), ("rehearse", [i for i in range(len(tasks)) if i not in set(executed)])):
        for k in range(0, len(index), batch_size):
            part = index[k:k + batch_size]
            prompts, worlds, tags = fx.inputs([tasks[i] for i in part])
            if mode == "rehearse":             # no executor: the policy plays the world
                out = fx.sample(model, tokenizer, prompts, mode, world=worlds, tags=tags, **sampling)
            else:
                plans, used = None, [0] * len(part)
                if cfg["rehearsal_budget"]:
                    plans, used = rehearse.private_rehearsal_plans(
                        model, tokenizer, prompts, cfg["rehearsal_budget"], cfg["rehearsal_mode"], rehearser,
                        temperature=cfg["imagine_temperature"], generator=generator, world=worlds,
                        sample=fx.sample, **limits)
                out = sample_episodes(model, tokenizer, prompts, mode, world=worlds, tags=tags, plans=plans,
                                      **sampling)
                for i, n in zip(part, used):
                    imagined[i] = n
            for i, e in zip(part, out):
                episodes[i] = e
    rewards = [fx.reward(e, t) for e, t in zip(episodes, tasks)]
    pairs = fx.would_rehearse(model, tokenizer, [tasks[i] for i in executed], [episodes[i] for i in executed])
    fidelity = fx.by_kind(pairs, [tasks[i] for i in executed])
    result = {**outcome_record(tasks, episodes, rewards),
              "fidelity": honesty.rates(fidelity), "fidelity_counts": fidelity,
              "executed_tasks": len(executed),
              "rehearsed_tasks": len(tasks) - len(executed),
              "rehearsal_budget": cfg["rehearsal_budget"], "rehearsal_mode": cfg["rehearsal_mode"],
              "imagined_per_task": sum(imagined) / len(tasks),
              "fidelity_by_coverage": fx.coverage(model, tokenizer, tasks, pairs)}
    if cfg["n_collusion"]:
        result.update(fx.honesty(model, tokenizer, tasks[:cfg["n_collusion"]], cfg, generator))
    extras = fx.eval_extras(model, tasks, episodes, rewards)      # the world's own figures, or {}
    if extras:
        result["extras"] = extras
    result["task_rewards"] = rewards          # per test task, in order: the paired bootstrap's input
    return result


def success_name(m):
    """What an eval.json's success is: "real-world success" when an executor ran every task,
    "rehearsed success (no executor)" when none (the policy played the world: not a real-world
    figure), else how many of each."""
    executed = m.get("executed_tasks", m["n_tasks"])          # eval.json files from before the key
    if executed == m["n_tasks"]:
        return "real-world success"
    if executed == 0:
        return "rehearsed success (no executor)"
    return f"success (real-world on {executed} of {m['n_tasks']} tasks, rehearsed on the rest)"


def summary(m):
    """One line for the terminal."""
    fid = " ".join(f"{k} {v:.3f}" for k, v in m["fidelity"].items())
    name = "success" if success_name(m) == "real-world success" else success_name(m)
    line = (f"{name} {m['success']:.3f} on {m['n_tasks']} tasks | format errors "
            f"{m['format_errors']:.3f} | mean calls {m['mean_calls']:.2f} | would-rehearse fidelity: {fid}")
    return line + (f" | {imagined_summary(m)}" if "collusion" in m else "")


def imagined_summary(m):
    c = m["collusion"]
    rate = "-" if c["rate"] is None else f"{c['rate']:.3f}"
    return (f"imagined success {m['imagined_success']:.3f}, collusion {rate} "
            f"({c['colluding']} of {c['wrong']} wrong calls)")


def rehearsal_sweep(model, tokenizer, tasks, cfg, fx, rehearsers, budgets=(0, 1, 2, 4),
                    modes=("parallel", "sequential")):
    """Success against the private-rehearsal budget N, for each mode and each model that plays the
    world in imagination ({name: model or None for the policy itself}). One row per setting."""
    rows = []
    for name, rehearser in rehearsers.items():
        for mode in modes:
            for n in budgets:
                m = evaluate(model, tokenizer, tasks, {**cfg, "rehearsal_budget": n, "rehearsal_mode": mode,
                                                       "n_collusion": 0}, fx, seed=cfg["seed"], rehearser=rehearser)
                rows.append({"rehearser": name, "mode": mode, "budget": n, "success": m["success"],
                             "imagined_per_task": m["imagined_per_task"], "mean_calls": m["mean_calls"]})
    return rows


# ----------------------------------------------------------------------------- command line

def load_run(folder, overrides, rehearser_path=None):
    """(cfg, model, tokenizer, test tasks, fx, rehearser) of a run folder of train.py (its latest
    checkpoint ckpt/) or of a checkpoint folder itself (warmstart/). ConfigError if there is none."""
    path = find_checkpoint(os.path.join(folder, "ckpt")) or find_checkpoint(folder)
    if path is None or not os.path.isfile(os.path.join(path, "config.yaml")):
        raise ConfigError(f"no checkpoint written by train.py in {folder}")
    cfg = load_config(os.path.join(path, "config.yaml"), overrides)
    model, tokenizer = load_policy(path, pick_device(cfg))
    rehearser = load_policy(rehearser_path, pick_device(cfg))[0] if rehearser_path else None
    splits = features.build_tasks(cfg)
    fx = features.setup(cfg, tokenizer, splits, pick_device(cfg))    # a template that does not fit: one line
    check_lengths(cfg, tokenizer, model.config, splits["test"])      # an override of max_tokens: one line
    return cfg, model, tokenizer, splits["test"], fx, rehearser


def write(folder, name, value):
    write_file(os.path.join(folder, name), json.dumps(value, indent=1))     # refused: one line


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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
    parser.add_argument("--oracle", action="store_true",
                        help="no model: replay each task's gold calls (--test_file=F --out_dir=D; oracle.py)")
    parser.add_argument("--debug", action="store_true", help="an unexpected error's full traceback too")
    args, overrides = parser.parse_known_args(argv)
    if args.oracle:
        return oracle.main(overrides)
    phase = ["loading the checkpoint"]
    try:
        return run_main(args, overrides, phase)
    except KeyboardInterrupt:
        print(f"\ninterrupted during {phase[0]}: no result written", file=sys.stderr)
        return 130
    except Exception as e:             # user code, a tokenizer, a library: one line naming the phase
        print(error_line(e, phase[0], args.debug), file=sys.stderr)
        return 1


def run_main(args, overrides, phase):
    """main's body: ConfigError exits 2, NonFiniteError 1, each one line; phase[0] names the phase."""
    try:
        if not args.ckpt:
            raise ConfigError("give --ckpt <run folder> (runs are compared by experiments.py --compare)")
        if args.n_test is not None and args.n_test < 1:
            raise ConfigError(f"--n_test must be at least 1, got {args.n_test}")
        cfg, model, tokenizer, tasks, fx, rehearser = load_run(args.ckpt, overrides, args.rehearser)
        warm = load_policy(os.path.join(args.ckpt, "warmstart"), pick_device(cfg))[0] if args.coverage else None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = tasks[:args.n_test] if args.n_test else tasks
    phase[0] = "evaluation"
    try:
        measure(args, cfg, model, tokenizer, tasks, fx, rehearser, warm)
    except NonFiniteError as e:                    # broken weights: one line, nothing written
        print(f"error: {e}", file=sys.stderr)
        return 1
    except ConfigError as e:                       # the result could not be written: one line
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def measure(args, cfg, model, tokenizer, tasks, fx, rehearser, warm):
    """What main runs once the checkpoint is loaded: one of the measures, printed and written."""
    if args.coverage:
        result = {when: fx.coverage(m, tokenizer, tasks) for when, m in (("before", warm), ("after", model))}
        for when, buckets in result.items():
            print(f"{when}: " + ", ".join(f"{b} {m}/{n}" for b, (m, n) in buckets.items()))
        write(args.ckpt, "coverage.json", result)
    elif args.collusion:
        metrics = fx.honesty(model, tokenizer, tasks[:cfg["n_collusion"] or len(tasks)], cfg,
                             torch.Generator().manual_seed(cfg["seed"]))
        print(imagined_summary(metrics) if metrics else "no task has an executor: no real response to "
              "compare imagined ones with (docs/tools.md)")
        write(args.ckpt, "collusion.json", metrics)
    elif args.sweep:
        rehearsers = {"policy": None, **({"rehearser": rehearser} if rehearser is not None else {})}
        rows = rehearsal_sweep(model, tokenizer, tasks, cfg, fx, rehearsers)
        for r in rows:
            print(f"{r['rehearser']:9s} {r['mode']:10s} N={r['budget']}: success {r['success']:.3f}, "
                  f"{r['imagined_per_task']:.2f} imagined and {r['mean_calls']:.2f} real calls per task")
        write(args.ckpt, "private_rehearsal.json", rows)
    else:
        metrics = evaluate(model, tokenizer, tasks, cfg, fx, seed=cfg["seed"], rehearser=rehearser)
        print(summary(metrics))
        name = "evaluate.json" if os.path.exists(os.path.join(args.ckpt, "eval.json")) else "eval.json"
        write(args.ckpt, name, metrics)        # train.py's eval.json (with `before`) is kept as it is
        print(f"written to {os.path.join(args.ckpt, name)}")


if __name__ == "__main__":
    sys.exit(main())
