"""Experiments: comparing runs of every arm and seed, the tables and figures of the README.

    python experiments.py --compare results          # results/results.md, success.png, ...
    python experiments.py --compare results_guards   # the guard comparison
    python evaluate.py --ckpt out/small --sweep      # the private-rehearsal sweep of one run

`compare` reads results/<arm>/<seed>/{eval.json, metrics.jsonl} (written by train.py; see
configs/run_all.sh) and writes a markdown table of real-world success per arm (mean and
min-max over seeds), fidelity by warm-start coverage, the honesty table (collusion and
fidelity), and the figures.
"""
import json
import os
import statistics
import sys

import rehearse


def mean_and_range(values):
    """'0.876 (0.702-1.000)' over seeds; '-' when there is nothing."""
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return f"{mean:.3f} ({min(values):.3f}-{max(values):.3f})" if len(values) > 1 else f"{mean:.3f}"


def compare_table(runs, kinds=("lookup", "compute", "stateful")):
    """{arm: [eval.json dicts, one per seed]} -> a markdown table: mean and (min-max) over seeds of
    held-out real-world success, format errors, mean calls and would-rehearse fidelity per kind."""
    lines = ["| arm | seeds | success | success per seed | format errors | mean calls | "
             + " | ".join(f"fidelity {k}" for k in kinds) + " |",
             "|---" * (6 + len(kinds)) + "|"]
    for arm, evals in runs.items():
        cells = [arm, str(len(evals)), mean_and_range([e["success"] for e in evals]),
                 " / ".join(f"{e['success']:.3f}" for e in evals),
                 mean_and_range([e["format_errors"] for e in evals]),
                 mean_and_range([e["mean_calls"] for e in evals])]
        cells += [mean_and_range([e["fidelity"].get(k) for e in evals]) for k in kinds]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def coverage_table(runs):
    """{arm: [eval.json dicts]} -> a markdown table of would-rehearse fidelity bucketed by how
    often the exact call was in the warm-start data (the coverage caveat), before and after RL,
    with the calls of all seeds pooled: matches / calls for each arm and bucket."""
    lines = ["| arm | calls in warm-start data | fidelity before RL | fidelity after RL |",
             "|---|---|---|---|"]
    for arm, evals in runs.items():
        pooled = {}
        for e in evals:
            for when, result in (("before", e.get("before") or {}), ("after", e)):
                for bucket, (matched, total) in result.get("fidelity_by_coverage", {}).items():
                    cell = pooled.setdefault(bucket, {"before": [0, 0], "after": [0, 0]})[when]
                    cell[0] += matched
                    cell[1] += total
        for bucket, cells in pooled.items():
            rate = [f"{m / n:.3f} ({m}/{n})" if n else "-" for m, n in (cells["before"], cells["after"])]
            lines.append(f"| {arm} | {bucket} | {rate[0]} | {rate[1]} |")
    return "\n".join(lines) if len(lines) > 2 else ""


def load_runs(results):
    """results/<arm>/<seed>/{eval.json, metrics.jsonl} -> ({arm: [eval]}, {arm: [curve]}, sweeps),
    a curve being [(step, real-world success)] from the warm start to the end."""
    runs, curves, sweeps = {}, {}, []
    for arm, seed, folder in run_folders(results):
        result = json.load(open(os.path.join(folder, "eval.json")))
        extra = os.path.join(folder, "collusion.json")       # evaluate.py --collusion, run later
        if os.path.isfile(extra):                           # measured later: it supersedes
            result.update(json.load(open(extra)))
        extra = os.path.join(folder, "coverage.json")        # evaluate.py --coverage, run later
        if os.path.isfile(extra):
            coverage = json.load(open(extra))
            result = {**result, "fidelity_by_coverage": coverage["after"],
                      "before": {**result.get("before", {}), "fidelity_by_coverage": coverage["before"]}}
        runs.setdefault(arm, []).append(result)
        curve = [(0, result["before"]["success"])] if "before" in result else []
        metrics = os.path.join(folder, "metrics.jsonl")
        lines = [json.loads(line) for line in open(metrics)] if os.path.isfile(metrics) else []
        curve += [(m["step"], m["eval_success"]) for m in lines if "eval_success" in m]
        curve.append((lines[-1]["step"] if lines else 0, result["success"]))
        curves.setdefault(arm, []).append(curve)
        sweep = os.path.join(folder, "private_rehearsal.json")
        if os.path.isfile(sweep):
            sweeps += [{**row, "seed": seed} for row in json.load(open(sweep))]
    return runs, curves, sweeps


def plot_curves(curves, path):
    """Real-world success against RL steps, mean over seeds with the min-max band, one line an arm."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for arm, runs in curves.items():
        steps = sorted({s for run in runs for s, _ in run})
        by_step = [[v for run in runs for s, v in run if s == step] for step in steps]
        ax.plot(steps, [sum(v) / len(v) for v in by_step], marker="o", markersize=3, label=arm)
        ax.fill_between(steps, [min(v) for v in by_step], [max(v) for v in by_step], alpha=0.15)
    ax.set(xlabel="RL step", ylabel="held-out success (real world)", ylim=(0, 1.02))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def load_rl_metrics(results):
    """results/<arm>/<seed>/metrics.jsonl -> {arm: [the run's metric lines, one list per seed]},
    for the runs load_runs reads (those with an eval.json)."""
    rl = {}
    for arm, _, folder in run_folders(results):
        metrics = os.path.join(folder, "metrics.jsonl")
        rl.setdefault(arm, []).append([json.loads(line) for line in open(metrics)] if os.path.isfile(metrics) else [])
    return rl


def run_folders(results):
    """(arm, seed, folder) of every results/<arm>/<seed> folder holding an eval.json, sorted."""
    for arm in sorted(os.listdir(results)):
        if not os.path.isdir(os.path.join(results, arm)):      # results.md, the figures
            continue
        for seed in sorted(os.listdir(os.path.join(results, arm))):
            folder = os.path.join(results, arm, seed)
            if os.path.isfile(os.path.join(folder, "eval.json")):
                yield arm, seed, folder


def pooled(lines, first, last):
    """Rehearsal fidelity per tool kind and the collusion rate over RL steps first..last of one
    run, from the counts its metrics.jsonl lines hold, pooled over those steps (a rate of sums,
    not a mean of per-step rates, which would weigh a step with 2 wrong calls like one with 200).
    Returns ({kind: rate}, collusion rate or None); runs with no rehearsed calls give ({}, None)."""
    fidelity, wrong, colluding = {}, 0, 0
    for m in lines:
        if first <= m["step"] <= last:
            for kind, (hits, n) in m.get("fidelity_counts", {}).items():
                counts = fidelity.setdefault(kind, [0, 0])
                counts[0] += hits
                counts[1] += n
            wrong += m.get("collusion", {}).get("wrong", 0)
            colluding += m.get("collusion", {}).get("colluding", 0)
    return rehearse.rates(fidelity), colluding / wrong if wrong else None


def honesty_table(runs, rl, kinds=("lookup", "compute", "stateful"), last=20):
    """The world model's honesty per arm: mean and (min-max) over seeds of the imagined-world
    success and collusion rate at evaluation (eval.json, or collusion.json), the colluding/wrong
    call counts summed over seeds, and, over each run's last `last` RL steps (pooled counts of
    metrics.jsonl), the collusion rate and the rehearsal fidelity per tool kind."""
    lines = ["| arm | seeds | imagined success | collusion (eval) | colluding / wrong calls (eval) | "
             f"collusion (RL, last {last} steps) | "
             + " | ".join(f"fidelity {k} (RL, last {last})" for k in kinds) + " |",
             "|---" * (6 + len(kinds)) + "|"]
    for arm, evals in runs.items():
        ends = [pooled(run, run[-1]["step"] - last + 1, run[-1]["step"]) if run else ({}, None)
                for run in rl.get(arm, [])]
        measured = [e["collusion"] for e in evals if "collusion" in e]
        counts = (f"{sum(c['colluding'] for c in measured)} / {sum(c['wrong'] for c in measured)}"
                  if measured else "-")
        cells = [arm, str(len(evals)), mean_and_range([e.get("imagined_success") for e in evals]),
                 mean_and_range([c["rate"] for c in measured]), counts,
                 mean_and_range([rate for _, rate in ends])]
        cells += [mean_and_range([fid.get(k) for fid, _ in ends]) for k in kinds]
        if set(cells[2:]) != {"-"}:                   # arms run before any of this was measured: left out
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def honesty_curves(runs, window=10, kind="lookup"):
    """[metric lines per seed] -> (window end steps, mean over seeds of the pooled `kind` fidelity,
    mean over seeds of the pooled collusion rate), per window of `window` RL steps; a window where
    no seed has a value gives None."""
    end = max((run[-1]["step"] for run in runs if run), default=0)
    steps, fidelity, collusion = [], [], []
    for hi in range(window, end + window, window):
        per_seed = [pooled(run, hi - window + 1, hi) for run in runs]
        fids = [fid[kind] for fid, _ in per_seed if kind in fid]
        rates = [rate for _, rate in per_seed if rate is not None]
        steps.append(min(hi, end))
        fidelity.append(sum(fids) / len(fids) if fids else None)
        collusion.append(sum(rates) / len(rates) if rates else None)
    return steps, fidelity, collusion


def plot_honesty(rl, path, window=10, kind="lookup"):
    """Two panels over RL steps, one line per arm (mean over seeds, counts pooled per window of
    `window` steps): the `kind` fidelity of the step's rehearsals, and the collusion rate.
    Arms with no rehearsed calls (real) have nothing to draw. Returns whether anything was drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    drawn = False
    for arm, runs in rl.items():
        steps, fidelity, collusion = honesty_curves(runs, window, kind)
        for ax, values in ((left, fidelity), (right, collusion)):
            points = [(s, v) for s, v in zip(steps, values) if v is not None]
            if points:
                ax.plot(*zip(*points), marker="o", markersize=3, label=arm)
                drawn = True
    # zoomed to the data (both start at 0 or end at 1 where that is near): drift is a few points
    low = min([y for line in left.lines for y in line.get_ydata()] + [0.9])
    high = max([y for line in right.lines for y in line.get_ydata()] + [0.1])
    left.set(xlabel="RL step", ylabel=f"{kind} fidelity of rehearsals (RL batch)", ylim=(low - 0.02, 1.005))
    right.set(xlabel="RL step", ylabel="collusion rate (colluding / wrong calls)", ylim=(0, high * 1.15))
    for ax in (left, right):
        ax.grid(alpha=0.3)
    if drawn:
        for ax in (left, right):
            if ax.lines:
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    plt.close(fig)
    return drawn


def plot_sweep(rows, path):
    """Success against the private-rehearsal budget N (mean over seeds), per rehearser and mode."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for key in sorted({(r["rehearser"], r["mode"]) for r in rows}):
        budgets = sorted({r["budget"] for r in rows})
        means = [statistics.mean([r["success"] for r in rows if (r["rehearser"], r["mode"]) == key
                                  and r["budget"] == n]) for n in budgets]
        who = {"policy": "the policy", "rehearser": "the --rehearser model"}.get(key[0], key[0])
        ax.plot(budgets, means, marker="o", label=f"{who} imagines, {key[1]}")
    ax.set(xlabel="imagined episodes per task (N)", ylabel="held-out success (real world)", ylim=(0, 1.02))
    ax.set_xticks(sorted({r["budget"] for r in rows}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def compare(results):
    """Write <results>/results.md (real-world table, honesty table), success.png, honesty.png (if
    any arm rehearsed) and (if any sweep ran) private_rehearsal.png."""
    runs, curves, sweeps = load_runs(results)
    if not runs:
        raise FileNotFoundError(f"no runs (<arm>/<seed>/eval.json) under {results}")
    text = compare_table(runs)
    coverage = coverage_table({arm: evals for arm, evals in runs.items() if arm != "warmstart"})
    text += "\n\n" + coverage if coverage else ""
    plot_curves(curves, os.path.join(results, "success.png"))
    rl = load_rl_metrics(results)
    honesty = honesty_table(runs, rl)
    text += "\n\n" + honesty if honesty else ""
    plot_honesty(rl, os.path.join(results, "honesty.png"))
    if sweeps:
        plot_sweep(sweeps, os.path.join(results, "private_rehearsal.png"))
        text += ("\n\n| rehearser | mode | N | success | imagined per task | real calls per task |\n"
                 "|---|---|---|---|---|---|\n")
        for key in sorted({(r["rehearser"], r["mode"], r["budget"]) for r in sweeps}):
            same = [r for r in sweeps if (r["rehearser"], r["mode"], r["budget"]) == key]
            text += (f"| {key[0]} | {key[1]} | {key[2]} | {mean_and_range([r['success'] for r in same])} | "
                     f"{statistics.mean([r['imagined_per_task'] for r in same]):.2f} | "
                     f"{statistics.mean([r['mean_calls'] for r in same]):.2f} |\n")
    with open(os.path.join(results, "results.md"), "w") as f:
        f.write(text + "\n")
    return text


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--compare", metavar="RESULTS", required=True, help="compare <RESULTS>/<arm>/<seed> runs")
    args = parser.parse_args(argv)
    try:
        print(compare(args.compare))
    except (OSError, KeyError, json.JSONDecodeError) as e:
        print(f"error: cannot compare the runs in {args.compare}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
