"""The N sweep of `world: choice` (worlds/choice.py; docs/imagination.md): claim (4) measured.

    python -m scripts.choice_sweep --ckpt RUN [--rehearser CKPT] [--n_test N]   # success at N = 0, 1, 2, 4
    python -m scripts.choice_sweep --ckpt RUN --diagnose                        # why imagination does not pay
    python -m scripts.choice_sweep --report RESULTS                             # tables and figure of run_choice.sh

For each N: N imagined episodes per task (rehearse mode: the policy, or the warm start, plays the
world; never the real one), condensed into a rehearsal memory, then ONE committed real episode
that reads it; parallel and sequential; each N against N = 0 by a paired bootstrap over the test
tasks (compare.paired_bootstrap; --report pools the seeds, which share their test tasks, with the
crossed bootstrap and the t-interval over the seed means). A file of its own, above evaluate.py
and scripts/compare.py, so that the world itself stays below formats/features.py.
"""
import glob
import json
import os
import re
import sys

import torch

from machinery.checkpoint import load_policy, write_file
from machinery.config import ArgumentParser, ConfigError
from machinery.distributed import pick_device
from scripts.evaluate_cli import load_run
from scripts.compare import cell, paired_bootstrap, seeds_bootstrap, t_cell
from worldmodel import memory as rehearsal_memory
import world
import rollout
from rollout import sample_episodes
from worlds.choice import BUDGETS, TOOL_KINDS, choice_reward, commit_prompt, counting_world, imagine, parse_call, replay


def committed_success(model, tokenizer, tasks, cfg, budget, mode="parallel", rehearser=None, seed=0,
                      batch_size=256):
    """Success at `budget` imagined episodes per task (the paper's rule), then ONE committed real
    episode reading their memory (eval sampling: eval_temperature). Imagination at
    imagine_temperature. Both in one counting world: `imagination_real_calls` (must be 0) and the
    committed episodes' real lookups per task (`real_lookups_per_task`; the purchase is the one
    real call a task is allowed). Returns the figures and per-task `task_rewards`."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    counted = counting_world()
    imagined = []
    with torch.no_grad():
        for k in range(0, len(tasks), batch_size):
            imagined += imagine(model, tokenizer, [t["prompt"] for t in tasks[k:k + batch_size]], budget, mode,
                                rehearser, counted, generator,
                                settings=rollout.sampling(cfg, temperature=cfg["imagine_temperature"]))
        imagination_calls = counted.real_calls
        committed = []
        for k in range(0, len(tasks), batch_size):
            prompts = [commit_prompt(t["prompt"], m) for t, m in zip(tasks[k:k + batch_size], imagined[k:k + batch_size])]
            committed += sample_episodes(model, tokenizer, prompts, "real", world=counted, generator=generator,
                                         settings=rollout.sampling(cfg, temperature=cfg["eval_temperature"]))
    rewards = [choice_reward(e, t) for e, t in zip(committed, tasks)]
    flat = [(e, t) for m, t in zip(imagined, tasks) for e in m]
    verdicts = {v: sum(rehearsal_memory.self_assess(e) == v for e, _ in flat) for v in ("good", "bad", "unfinished")}
    return {"success": sum(rewards) / len(tasks), "task_rewards": rewards,
            "imagined_per_task": len(flat) / len(tasks),
            "imagined_right": sum(e["answer"] == t["answer"] for e, t in flat) / len(flat) if flat else None,
            "imagined_fidelity": imagined_fidelity([e for e, _ in flat]),
            "by_memory": by_memory(imagined, committed, tasks),
            "verdicts": verdicts, "imagination_real_calls": imagination_calls,
            "real_lookups_per_task": (counted.real_calls - imagination_calls) / len(tasks),
            "purchases_per_task": sum(e["cause"] == "answer" for e in committed) / len(tasks)}


def imagined_fidelity(episodes):
    """Per tool kind [matches, total]: the imagined responses against the real world's to the same calls."""
    counts = {}
    for e in episodes:
        for call, imagined, truth in zip(e["calls"], e["responses"], replay(e["calls"])):
            cell = counts.setdefault(TOOL_KINDS[parse_call(call)[0]] if parse_call(call) else "other", [0, 0])
            cell[0] += imagined == truth
            cell[1] += 1
    return counts


def memory_majority(episodes):
    """The item most often bought by the `good` imagined episodes (the first on a tie), or None."""
    answers = [e["answer"] for e in episodes if rehearsal_memory.self_assess(e) == "good"]
    return max(answers, key=answers.count) if answers else None


def by_memory(imagined, committed, tasks):
    """How the committed choice relates to its memory: per kind of memory (`right`: its good
    episodes' majority bought the cheapest; `wrong`: another item; `none`: no good episode),
    [tasks, committed right, committed the memory's majority]."""
    out = {"right": [0, 0, 0], "wrong": [0, 0, 0], "none": [0, 0, 0]}
    for m, e, t in zip(imagined, committed, tasks):
        majority = memory_majority(m)
        cell = out["none" if majority is None else ("right" if majority == t["answer"] else "wrong")]
        cell[0] += 1
        cell[1] += choice_reward(e, t)
        cell[2] += majority is not None and e["answer"] == majority
    return out


def memory_sweep(model, tokenizer, tasks, cfg, rehearsers, budgets=BUDGETS, modes=("parallel", "sequential")):
    """Success against N for each rehearser ({name: model, or None for the policy itself}) and
    mode, each N > 0 with its paired-bootstrap difference to N = 0 over the test tasks
    (compare.paired_bootstrap; N = 0 imagines nothing, so it is measured once). One row each."""
    base = committed_success(model, tokenizer, tasks, cfg, 0, seed=cfg["seed"])
    rows = []
    for name, rehearser in rehearsers.items():
        for mode in modes:
            for n in budgets:
                m = base if n == 0 else committed_success(model, tokenizer, tasks, cfg, n, mode, rehearser, cfg["seed"])
                mean, low, high, _ = paired_bootstrap({0: m["task_rewards"]})
                row = {"rehearser": name, "mode": mode, "budget": n, **m, "interval": [low, high]}
                if n:
                    diff, dlow, dhigh, called = paired_bootstrap({0: m["task_rewards"]}, {0: base["task_rewards"]})
                    row["vs_0"] = {"diff": diff, "interval": [dlow, dhigh], "called": bool(called)}
                rows.append(row)
    return rows


def cost_bucket(task):
    """choice: costs: the two costs' digits and their gap, e.g. ("both two digits", "gap 3+")."""
    low, high = sorted(q * world.PRICES[i] for q, i in zip(task["quantities"], task["items"]))[:2]
    digits = "both one digit" if high < 10 else ("both two digits" if low >= 10 else "one and two digits")
    return digits, "gap 1-2" if high - low <= 2 else "gap 3+"


def diagnose(model, tokenizer, tasks, cfg):
    """Why imagination does not beat the one-forward choice (choice: costs): one imagined episode
    per task at T = imagine_temperature and at T = 0, each classed (right; unfinished; wrong with
    calls other than the expert's; wrong with the expert's calls but a wrong response; wrong with
    the expert's calls and true responses: a wrong purchase), and the wrong purchases of greedy
    imagination and of N = 0 per cost bucket (`cost_bucket`). Returns a dict of counts."""
    limits = rollout.limits(cfg)
    generator = torch.Generator().manual_seed(cfg["seed"])
    out = {}
    for temperature in (cfg["imagine_temperature"], 0.0):
        episodes = [m[0] for m in imagine(model, tokenizer, [t["prompt"] for t in tasks], 1, "parallel", None,
                                          sys.modules[__name__], generator, {**limits, "temperature": temperature})]
        classes = {}
        for e, t in zip(episodes, tasks):
            k = ("unfinished" if not e["finished"] else "right" if e["answer"] == t["answer"] else
                 "wrong: other calls" if e["calls"] != t["calls"] else
                 "wrong: a wrong response" if e["responses"] != replay(e["calls"]) else "wrong: true responses, wrong purchase")
            classes[k] = classes.get(k, 0) + 1
        out[f"imagined at T={temperature}"] = dict(sorted(classes.items()))
    direct = committed_success(model, tokenizer, tasks, cfg, 0, seed=cfg["seed"])["task_rewards"]
    buckets = {}
    for e, r, t in zip(episodes, direct, tasks):
        cell = buckets.setdefault(" / ".join(cost_bucket(t)), [0, 0, 0])
        cell[0] += 1
        cell[1] += e["finished"] and e["answer"] != t["answer"]
        cell[2] += 1 - int(r)
    out["wrong purchases by cost bucket: [tasks, greedy imagination, N = 0]"] = dict(sorted(buckets.items()))
    return out


def sweep_line(r):
    diff = r.get("vs_0")
    vs = (f" | vs N=0 {diff['diff']:+.3f} [{diff['interval'][0]:+.3f}, {diff['interval'][1]:+.3f}]"
          f"{' called' if diff['called'] else ''}") if diff else ""
    right = "-" if r["imagined_right"] is None else f"{r['imagined_right']:.3f}"
    fid = ", ".join(f"{k} {m / n:.3f}" for k, (m, n) in sorted(r.get("imagined_fidelity", {}).items()) if n)
    memo = " ".join(f"{k} {c[1]}/{c[0]}" for k, c in r.get("by_memory", {}).items() if c[0])
    right += f", fidelity {fid}" if fid else ""
    return (f"{r['rehearser']:10s} {r['mode']:10s} N={r['budget']}: success {r['success']:.3f} "
            f"[{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]{vs} | {r['imagined_per_task']:.2f} imagined "
            f"(right {right}), {r['real_lookups_per_task']:.2f} real lookups, {r['purchases_per_task']:.2f} "
            f"purchases per task, {r['imagination_real_calls']} real calls in imagination"
            + (f" | right by memory: {memo}" if r["budget"] else ""))


def report(folder):
    """The tables and the figure of `folder` (configs/run_choice.sh's results): per model (the warm
    start, the RL model), rehearser and mode, success at each N, mean and 95% interval from the
    bootstrap over seeds and test tasks (compare.seeds_bootstrap: crossed, one task draw for all the
    seeds, which share their test tasks), and the difference to N = 0, then (several seeds) its
    t-interval over the seed means; each other model against the warm start at the same N; tasks
    fixed and broken against N = 0. Writes FOLDER/results.md and FOLDER/choice.png; returns the
    markdown."""
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "sweep_*-seed*.json"))):
        model, seed = re.match(r"sweep_(.+)-seed(\d+)\.json", os.path.basename(path)).groups()
        for r in json.load(open(path)):
            runs.setdefault((model, r["rehearser"], r["mode"]), {}).setdefault(r["budget"], {})[int(seed)] = r
    lines = ["| model | rehearser | mode | seeds | " + " | ".join(f"N = {n}" for n in BUDGETS)
             + " | " + " | ".join(f"N = {n} - N = 0" for n in BUDGETS[1:]) + " |",
             "|" + "---|" * (4 + 2 * len(BUDGETS) - 1)]
    curves = {}
    for (model, rehearser, mode), by_n in sorted(runs.items()):
        rewards = {n: {s: r["task_rewards"] for s, r in by_n[n].items()} for n in BUDGETS if n in by_n}
        seeds = sorted(rewards[0])
        lines.append(f"| {model} | {rehearser} | {mode} | {len(seeds)} | "
                     + " | ".join(cell(rewards[n]) if n in rewards else "-" for n in BUDGETS) + " | "
                     + " | ".join(cell(rewards[n], rewards[0]) if n in rewards else "-" for n in BUDGETS[1:]) + " |")
        curves[f"{model}, {rehearser} rehearses, {mode}"] = [seeds_bootstrap(rewards[n])[:3] for n in BUDGETS
                                                             if n in rewards]
    if any(len(by_n[0]) > 1 for by_n in runs.values()):          # one seed has no t-interval
        lines += ["", "N = k - N = 0, the t-interval over the seed means (95%; the seed level alone, the test "
                  "tasks taken as fixed):", "",
                  "| model | rehearser | mode | seeds | "
                  + " | ".join(f"N = {n} - N = 0" for n in BUDGETS[1:]) + " |",
                  "|" + "---|" * (3 + len(BUDGETS))]
        for (model, rehearser, mode), by_n in sorted(runs.items()):
            rewards = {n: {s: r["task_rewards"] for s, r in by_n[n].items()} for n in BUDGETS if n in by_n}
            lines.append(f"| {model} | {rehearser} | {mode} | {len(rewards[0])} | " + " | ".join(
                t_cell(rewards[n], rewards[0]) if n in rewards else "-" for n in BUDGETS[1:]) + " |")
    lines += ["", "Against the warm start at the same N (paired over seeds and test tasks, crossed, 95%; the warm "
              "start imagining with itself, in the same mode):", "",
              "| model - warm start | rehearser | mode | " + " | ".join(f"N = {n}" for n in BUDGETS) + " |",
              "|" + "---|" * (3 + len(BUDGETS))]
    for (model, rehearser, mode), by_n in sorted(runs.items()):
        base = runs.get(("warmstart", "policy", mode))
        if model == "warmstart" or base is None:
            continue
        lines.append(f"| {model} - warm start | {rehearser} | {mode} | " + " | ".join(
            cell({s: r["task_rewards"] for s, r in by_n[n].items()}, {s: r["task_rewards"] for s, r in base[n].items()})
            if n in by_n and n in base and sorted(by_n[n]) == sorted(base[n]) else "-" for n in BUDGETS) + " |")
    lines += ["", "Seed by seed: success at N = 0 and N = 4 (the model imagining with itself); from train.py's "
              "evaluation of the model (eval_MODEL-seedS.json), greedy imagined success on the explore prompt and "
              "would-rehearse fidelity.", "",
              "| model | seed | N = 0 | N = 4, parallel | N = 4, sequential | imagined success | fidelity |",
              "|" + "---|" * 7]
    for model in sorted({m for m, _, _ in runs}):
        for seed in sorted({s for (m, _, _), by_n in runs.items() if m == model for r in by_n.values() for s in r}):
            def success(mode, n):
                r = runs.get((model, "policy", mode), {}).get(n, {}).get(seed, {})
                return f"{r['success']:.3f}" if "success" in r else "-"
            path = os.path.join(folder, f"eval_{model}-seed{seed}.json")
            e = json.load(open(path)) if os.path.isfile(path) else {}
            imagined = f"{e['imagined_success']:.3f}" if "imagined_success" in e else "-"
            fid = ", ".join(f"{k} {v:.3f}" for k, v in sorted(e.get("fidelity", {}).items())) or "-"
            lines.append(f"| {model} | {seed} | {success('parallel', 0)} | {success('parallel', 4)} | "
                         f"{success('sequential', 4)} | {imagined} | {fid} |")
    lines += ["", "Paired against N = 0, summed over seeds: tasks N = 0 got wrong and N = k right (fixed), and the "
              "reverse (broken); the committed choice by kind of memory (its good imagined episodes' majority "
              "right / wrong / none): committed right of tasks; imagined responses' fidelity.", "",
              "| model | rehearser | mode | N | fixed | broken | memory right | memory wrong | no good memory | "
              "imagined fidelity |", "|" + "---|" * 10]
    for (model, rehearser, mode), by_n in sorted(runs.items()):
        for n in BUDGETS[1:]:
            if n not in by_n:
                continue
            pairs = [(a, b) for s in by_n[n] for a, b in zip(by_n[0][s]["task_rewards"], by_n[n][s]["task_rewards"])]
            memo = {k: [sum(r["by_memory"][k][j] for r in by_n[n].values()) for j in range(3)]
                    for k in ("right", "wrong", "none")} if all("by_memory" in r for r in by_n[n].values()) else None
            fid = {}
            for r in by_n[n].values():
                for kind, (m, t) in r.get("imagined_fidelity", {}).items():
                    fid[kind] = [fid.get(kind, [0, 0])[0] + m, fid.get(kind, [0, 0])[1] + t]
            lines.append(f"| {model} | {rehearser} | {mode} | {n} | {sum(a < b for a, b in pairs)} | "
                         f"{sum(a > b for a, b in pairs)} | "
                         + (" | ".join(f"{c[1]:.0f}/{c[0]}" for c in memo.values()) if memo else "- | - | -") + " | "
                         + ", ".join(f"{k} {m / t:.3f}" for k, (m, t) in sorted(fid.items()) if t) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (name, points) in enumerate(curves.items()):
        x = [n + 0.04 * (k - len(curves) / 2) for n in BUDGETS[:len(points)]]
        mean = [p[0] for p in points]
        ax.errorbar(x, mean, yerr=[[m - p[1] for m, p in zip(mean, points)], [p[2] - m for m, p in zip(mean, points)]],
                    marker="o", capsize=3, label=name)
    ax.set_xlabel("imagined episodes per task N (then one committed real episode)")
    ax.set_ylabel("real-world success (95% interval)")
    ax.set_xticks(BUDGETS)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "choice.png"), dpi=120)
    return text


def main(argv=None):
    """python -m scripts.choice_sweep --ckpt RUN [--rehearser CKPT] [--n_test N] [--out FILE]: the N sweep
    of a run folder of train.py (its latest checkpoint) or a checkpoint (warmstart/). The
    rehearser defaults to RUN/warmstart when RUN has one (the warm start playing the world).
    python -m scripts.choice_sweep --report RESULTS: the tables and figure of configs/run_choice.sh.
    python -m scripts.choice_sweep --ckpt RUN --diagnose: why imagination does not beat N = 0 (`diagnose`).
    Options and paths are checked before the model is loaded: a bad one is one line, exit 2."""
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", help="a run folder of train.py, or a checkpoint in it")
    parser.add_argument("--report", help="a results folder of configs/run_choice.sh: its tables and figure")
    parser.add_argument("--rehearser", help="a checkpoint that plays the world in imagination (default RUN/warmstart)")
    parser.add_argument("--n_test", type=int, default=None, help="the first N test tasks")
    parser.add_argument("--out", help="where the rows go (default <ckpt>/memory_sweep.json)")
    parser.add_argument("--diagnose", action="store_true",
                        help="why imagination does not beat N = 0 (choice: costs): imagined episodes classed, "
                             "wrong purchases by cost bucket (into --out, default <ckpt>/diagnosis.json)")
    try:
        args, overrides = parser.parse_known_args(argv)     # (--help prints and exits 0 here)
        if args.report is not None:
            check_report_options(args, overrides)
        else:
            check_sweep_options(args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.report:
        print(report(args.report), end="")
        return 0
    try:
        cfg, model, tokenizer, tasks, _, _, _ = load_run(args.ckpt, overrides)
        if cfg["world"] != "choice":
            raise ConfigError(f"{args.ckpt} was trained with world: {cfg['world']}; this sweep is for world: choice")
        rehearser_path = args.rehearser or os.path.join(args.ckpt, "warmstart")
        rehearsers = {"policy": None}
        if os.path.isfile(os.path.join(rehearser_path, "config.yaml")):
            rehearsers["warm start"] = load_policy(rehearser_path, pick_device(cfg))[0]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = tasks[:args.n_test] if args.n_test else tasks
    if args.diagnose:
        if cfg["choice_kind"] != "costs":
            print("error: --diagnose reads the costs of choice_kind: costs", file=sys.stderr)
            return 2
        result = diagnose(model, tokenizer, tasks, cfg)
        print(json.dumps(result, indent=1))
        return written(args.out or os.path.join(args.ckpt, "diagnosis.json"), result)
    rows = memory_sweep(model, tokenizer, tasks, cfg, rehearsers)
    for r in rows:
        print(sweep_line(r))
    return written(args.out or os.path.join(args.ckpt, "memory_sweep.json"), rows)


def written(out, value):
    """value as JSON into `out`, whole (checkpoint.write_file) -> main's exit status: 0, or 2 with
    one line if the write is refused."""
    try:
        write_file(out, json.dumps(value, indent=1))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"written to {out}")
    return 0


def check_report_options(args, overrides):
    """--report RESULTS: a folder holding sweep_MODEL-seedN.json files, and no option of a sweep."""
    given = [f"--{k}" for k in ("ckpt", "rehearser", "n_test", "out") if getattr(args, k) is not None]
    given += ["--diagnose"] * args.diagnose + overrides
    if given:
        raise ConfigError(f"--report reads the results of configs/run_choice.sh; it takes no {', '.join(given)}")
    if not os.path.isdir(args.report):
        raise ConfigError(f"--report {args.report}: no such folder")
    if not glob.glob(os.path.join(glob.escape(args.report), "sweep_*-seed*.json")):
        raise ConfigError(f"--report {args.report}: no sweep_MODEL-seedN.json in it "
                          "(configs/run_choice.sh writes them)")


def check_sweep_options(args):
    """--ckpt RUN and the options of a sweep (or --diagnose): each named in one line if wrong."""
    if not args.ckpt:
        raise ConfigError("give --ckpt RUN (a run folder of train.py) or --report RESULTS")
    if not os.path.isdir(args.ckpt):
        raise ConfigError(f"--ckpt {args.ckpt}: no such folder")
    if args.n_test is not None and args.n_test < 1:
        raise ConfigError(f"--n_test must be at least 1, got {args.n_test}")
    if args.rehearser is not None and args.diagnose:
        raise ConfigError("--diagnose imagines with the model itself: it takes no --rehearser")
    if args.rehearser is not None and not os.path.isfile(os.path.join(args.rehearser, "config.yaml")):
        raise ConfigError(f"--rehearser {args.rehearser}: no checkpoint written by train.py in it")
    if args.out is not None:
        folder = os.path.dirname(args.out) or "."
        if not args.out or os.path.isdir(args.out):
            raise ConfigError(f"--out {args.out!r} is {'empty' if not args.out else 'a folder'}: give a JSON file")
        if not os.path.isdir(folder):
            raise ConfigError(f"--out {args.out}: no folder {folder}")


if __name__ == "__main__":
    sys.exit(main())
