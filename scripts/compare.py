"""Experiments: comparing runs of every arm and seed, the tables and figures of the README.

    python -m scripts.compare --compare results/toy_rehearse-real-frozen-act_only_seeds1-5
                              # FOLDER/results.md, success.png, honesty.png (docs/results.md)
    python -m scripts.compare --uncertain results/uncertain_rehearse-real-frozen-act_only_seeds1-5
                              # FOLDER/results.md, uncertain.png (world: uncertain, docs/uncertain.md)
    python evaluate.py --ckpt out/small --sweep      # the private-rehearsal sweep of one run
    python -m scripts.compare --before_after RUN [RUN ...]      # each run's success before and after RL
    python -m scripts.compare --difference RUN_A RUN_B [RUN_A RUN_B ...]   # A - B after RL, a pair a seed
    python -m scripts.compare --validation RUN [RUN ...]        # the validation curve (n_val > 0), paired

`compare` reads FOLDER/<arm>/<seed>/{eval.json, metrics.jsonl} (written by train.py; see
configs/run_all.sh) and writes a markdown table of real-world success per arm (mean and
min-max over seeds), fidelity by warm-start coverage, the honesty table (collusion and
fidelity), and the figures. `uncertain` does the same for the `world: uncertain` runs
(configs/run_uncertain.sh) with every difference between arms as a bootstrap over seeds and test
tasks (`seeds_bootstrap`: crossed, one task draw shared by the seeds, which share their test tasks)
beside the t-interval over the seed means, and the world's probability of the truth per subset.
"""
import json
import os
import statistics
import sys

import yaml

from machinery.config import DEFAULTS
from worldmodel import honesty


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
        result = read_eval(folder)
        extra = os.path.join(folder, "collusion.json")       # evaluate.py --collusion, run later
        if os.path.isfile(extra):                           # measured later: it supersedes
            result.update(read_json(extra))
        extra = os.path.join(folder, "coverage.json")        # evaluate.py --coverage, run later
        if os.path.isfile(extra):
            coverage = read_json(extra)
            result = {**result, "fidelity_by_coverage": coverage["after"],
                      "before": {**result.get("before", {}), "fidelity_by_coverage": coverage["before"]}}
        runs.setdefault(arm, []).append({**result, "seed": seed})
        curve = [(0, result["before"]["success"])] if "before" in result else []
        metrics = os.path.join(folder, "metrics.jsonl")
        lines = read_json_lines(metrics) if os.path.isfile(metrics) else []
        curve += [(m["step"], m["eval_success"]) for m in lines if "eval_success" in m]
        curve.append((lines[-1]["step"] if lines else 0, result["success"]))
        curves.setdefault(arm, []).append(curve)
        sweep = os.path.join(folder, "private_rehearsal.json")
        if os.path.isfile(sweep):
            sweeps += [{**row, "seed": seed} for row in read_json(sweep)]
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
        rl.setdefault(arm, []).append(read_json_lines(metrics) if os.path.isfile(metrics) else [])
    return rl


def read_json(path):
    """The JSON in the file `path`, or PoolError naming the file and what is wrong with it: of many
    runs, the one whose file was cut short (a full disk, a copy that stopped) is found by its name."""
    with open(path) as f:
        text = f.read()
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        end = len(text.rstrip())
        if e.pos >= end:                   # the text ran out before the JSON closed: its last line
            last_line = text[:end].count("\n") + 1
            raise PoolError(f"{path} is not whole JSON (cut at line {last_line}?)") from None
        raise PoolError(f"{path} is not JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None


def read_eval(folder):
    """A run's eval.json (read_json), which every mode reads through here; PoolError naming the file
    unless it holds the JSON object train.py writes."""
    path = os.path.join(folder, "eval.json")
    result = read_json(path)
    if not isinstance(result, dict):
        raise PoolError(f"{path} holds a JSON {type(result).__name__}, not the object that train.py writes")
    return result


def read_json_lines(path):
    """A metrics.jsonl file, one JSON value a line, or PoolError naming the file and its first bad line."""
    lines = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                raise PoolError(f"{path} line {number} is not whole JSON (cut?)") from None
    return lines


def run_folders(results, partial=False):
    """(arm, seed, folder) of every results/<arm>/<seed> folder holding an eval.json, sorted
    (partial: or a metrics.jsonl, a run still going)."""
    for arm in sorted(os.listdir(results)):
        if not os.path.isdir(os.path.join(results, arm)):      # results.md, the figures
            continue
        for seed in sorted(os.listdir(os.path.join(results, arm))):
            folder = os.path.join(results, arm, seed)
            if os.path.isfile(os.path.join(folder, "eval.json")) or \
                    partial and os.path.isfile(os.path.join(folder, "metrics.jsonl")):
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
    return honesty.rates(fidelity), colluding / wrong if wrong else None


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


# ----------------------------------------------------------------------------- what may be pooled

class PoolError(Exception):
    """Runs asked to be pooled (or paired task by task) that are not seeds of one config on one
    test set: one line naming two of them and what differs."""


# The keys seeds of one config may differ in besides `seed`: where a run writes, when it saves or
# evaluates during RL (an evaluation samples with a generator of its own), and how it spends
# memory and time (the update's gradient is the same whatever the micro-batching, the
# checkpointed activations, the shared prefix, the reused sampler logprobs or the sharding).
# device, bf16 and cpu_bf16 change the arithmetic: compared with the rest.
NOT_MEASURED_KEYS = ("seed", "out_dir", "save_every", "eval_every", "eval_batch_size", "micro_batch_tokens",
                     "gradient_checkpointing", "share_prefix", "reuse_sampler_logprobs", "fsdp")
# The keys that choose the test tasks and their subsets (world.make_splits draws the test split
# first, from data_seed; worlds/choice.py from data_seed and its item sets; files replace
# it; uncertain_items labels the subsets): arms compared task by task must agree on them.
TEST_SET_KEYS = ("format", "world", "data_seed", "n_test", "tasks_file", "test_file", "uncertain_items",
                 "choice_items", "choice_kind")


def run_config(folder):
    """A run's config.yaml, a key it lacks at its default (the run was made before the key existed)."""
    path = os.path.join(folder, "config.yaml")
    try:
        with open(path) as f:
            saved = yaml.safe_load(f)
    except FileNotFoundError:
        raise PoolError(f"{folder} has no config.yaml: which config and test tasks its results are of "
                        f"cannot be told") from None
    except yaml.YAMLError as e:
        raise PoolError(f"{path} is not YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(saved, dict):
        raise PoolError(f"{path} holds no config")
    return {**DEFAULTS, **saved}


def own_seed(model, seed):
    """A `model` path with its component seed<seed> (the run's own seed) read as seed<S>:
    configs/run_all.sh starts each seed's arms from that seed's own warm start,
    $R/warmstart/seed$s/warmstart."""
    return "/".join("seed<S>" if part == f"seed{seed}" else part for part in str(model).split("/"))


def n_test_tasks(result):
    """How many test tasks an eval.json (or its `before`) holds outcomes of."""
    return len(result["task_rewards"]) if "task_rewards" in result else result.get("n_tasks")


def check_test_set(runs, keys=TEST_SET_KEYS, why=""):
    """runs: [(folder, eval.json)] compared task by task. PoolError naming the first run and the
    first other one that differs from it in a config key of `keys` (None: every key but
    NOT_MEASURED_KEYS, `model` read with own_seed) or in its number of test tasks (after RL, and
    before it where both hold it); `why` ends its message."""
    (first, result), mine = runs[0], run_config(runs[0][0])
    for folder, other in runs[1:]:
        theirs = run_config(folder)
        for key in keys if keys is not None else sorted((set(mine) | set(theirs)) - set(NOT_MEASURED_KEYS)):
            a, b = mine.get(key), theirs.get(key)
            if a != b and (key != "model" or own_seed(a, mine["seed"]) != own_seed(b, theirs["seed"])):
                raise PoolError(f"{first} and {folder} differ in {key}: {json.dumps(mine.get(key))} and "
                                f"{json.dumps(theirs.get(key))}{why}")
        pairs = [("", result, other)]
        if result.get("before") and other.get("before"):
            pairs.append((" before RL", result["before"], other["before"]))
        for when, a, b in pairs:
            if n_test_tasks(a) != n_test_tasks(b):
                raise PoolError(f"{first} and {folder} were evaluated{when} on different test tasks: "
                                f"{n_test_tasks(a)} and {n_test_tasks(b)}{why}")


def check_seeds(runs):
    """runs: [(folder, eval.json)] pooled as seeds of one config on one test set: PoolError unless
    their configs agree on every key but NOT_MEASURED_KEYS and they hold outcomes of as many
    test tasks (check_test_set)."""
    if len(runs) > 1:
        check_test_set(runs, keys=None, why=f" (runs pooled are seeds of one config on one test set: only "
                                            f"{', '.join(NOT_MEASURED_KEYS)} may differ)")


def check_once(runs):
    """PoolError naming the first run folder given twice: by its real path, so A, A/, ./A and a link
    to A are one run. Every mode that pools runs (before_after, difference, check_results) calls it
    first, before a file is read: a run counted twice would narrow the interval as a second seed."""
    seen = {}
    for run in runs:
        real = os.path.realpath(run)
        if real in seen:
            raise PoolError(f"{seen[real]} and {run} are one run ({real}): each run counts once (given twice, "
                            f"its outcomes would be pooled as two seeds' and the interval drawn too narrow)")
        seen[real] = run


def check_results(results):
    """Every arm's finished runs under RESULTS (<arm>/<seed>/eval.json) seeds of one config on one
    test set, and every arm on the same test set as the others (check_seeds, check_test_set); no
    run twice (check_once: a seed folder that links to another)."""
    check_once([folder for _, _, folder in run_folders(results)])
    arms = {}
    for arm, _, folder in run_folders(results):
        arms.setdefault(arm, []).append((folder, read_eval(folder)))
    for runs in arms.values():
        check_seeds(runs)
    if len(arms) > 1:
        check_test_set([runs[0] for runs in arms.values()], why=" (arms are compared on one test set)")


def compare(results):
    """Write <results>/results.md (real-world table, honesty table), success.png, honesty.png (if
    any arm rehearsed) and (if any sweep ran) private_rehearsal.png."""
    check_results(results)
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
    paired = paired_table(runs)
    text += "\n\n" + paired if paired else ""
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


# ----------------------------------------------------------------------------- statistics, world: uncertain

def paired_bootstrap(a, b=None, n_boot=4000, seed=0, level=0.95):
    """Mean and 95% interval of an arm's per-task outcome (b None) or of the paired difference a - b.
    a, b: {seed: [outcome per test task]}, the same tasks in the same order for both arms. Each
    resample draws seeds with replacement, then within each drawn seed the test tasks with
    replacement; both arms get the SAME seeds and tasks (paired). Returns (mean, low, high, called):
    `called` when the interval excludes 0 (a difference) -- for b None always False.
    Where every seed has as many tasks, a resample's task draws are one call of the generator (the
    same numbers as one call per drawn seed: integers() of one bound is one stream) and its means
    one reduction per row (the same sums, row by row, as one mean per seed); with one seed, 256
    resamples' task draws are one call."""
    import numpy as np
    seeds = sorted(a)
    if b is not None and (sorted(b) != seeds or any(len(a[s]) != len(b[s]) for s in seeds)):
        raise ValueError("paired_bootstrap needs the same seeds and test tasks in both arms")
    diff = [np.asarray(a[s], float) - (np.asarray(b[s], float) if b is not None else 0.0) for s in seeds]
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot)
    n_seeds, n_tasks = len(seeds), {len(d) for d in diff}
    if n_seeds == 1:                    # the seed drawn (of 1) takes nothing from the stream: the task
        (n_tasks,) = n_tasks            # draws of 256 resamples in one call
        for start in range(0, n_boot, 256):
            tasks = rng.integers(n_tasks, size=(min(256, n_boot - start), n_tasks))
            means[start:start + len(tasks)] = diff[0][tasks].sum(axis=1) / n_tasks
    elif len(n_tasks) == 1:
        table, (n_tasks,) = np.stack(diff), n_tasks
        for k in range(n_boot):
            drawn = rng.integers(n_seeds, size=n_seeds)
            tasks = rng.integers(n_tasks, size=(n_seeds, n_tasks))
            means[k] = (table[drawn[:, None], tasks].sum(axis=1) / n_tasks).sum() / n_seeds
    else:
        for k in range(n_boot):
            drawn = rng.integers(n_seeds, size=n_seeds)
            means[k] = np.mean([diff[i][rng.integers(len(diff[i]), size=len(diff[i]))].mean() for i in drawn])
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    mean = float(np.mean([d.mean() for d in diff]))
    return mean, float(low), float(high), b is not None and (low > 0 or high < 0)


# the t distribution's 97.5% quantile by degrees of freedom (seed_t_interval)
T_975 = {1: 12.7062, 2: 4.3027, 3: 3.1824, 4: 2.7764, 5: 2.5706, 6: 2.4469, 7: 2.3646, 8: 2.3060, 9: 2.2622, 10: 2.2281}


def crossed_mean(table, seeds, tasks):
    """One crossed resample's mean: `table` [seed, task] (outcomes or differences, every seed on the
    same test tasks in the same order), `seeds` the seed rows drawn, `tasks` the task columns drawn
    ONCE for all of them: the mean over the drawn seeds of each one's mean over the drawn tasks."""
    return float(table[seeds][:, tasks].mean())


def crossed_bootstrap(a, b=None, n_boot=4000, seed=0, level=0.95):
    """As paired_bootstrap, but for seeds that share their test tasks: each resample draws the seeds
    with replacement and ONE draw of the test tasks that every drawn seed takes (`crossed_mean`), so
    a task that is hard (or gains) in every seed moves every seed's mean together, as it does in the
    data; drawing tasks apart per seed treats those as independent and makes the interval too
    narrow. Returns (mean, low, high, called)."""
    import numpy as np
    seeds = sorted(a)
    if b is not None and (sorted(b) != seeds or any(len(a[s]) != len(b[s]) for s in seeds)):
        raise ValueError("crossed_bootstrap needs the same seeds and test tasks in both arms")
    if len({len(a[s]) for s in seeds}) != 1:
        raise ValueError("crossed_bootstrap needs every seed on the same test tasks")
    table = np.stack([np.asarray(a[s], float) - (np.asarray(b[s], float) if b is not None else 0.0) for s in seeds])
    rng = np.random.default_rng(seed)
    n_seeds, n_tasks = table.shape
    means = np.array([crossed_mean(table, rng.integers(n_seeds, size=n_seeds), rng.integers(n_tasks, size=n_tasks))
                      for _ in range(n_boot)])
    low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(table.mean()), float(low), float(high), b is not None and (low > 0 or high < 0)


def seed_t_interval(a, b=None):
    """The t-interval (95%) over the seeds' means of a (or of a - b): mean +- t(n-1) x sd / sqrt(n),
    n the number of seeds (the seed level alone, tasks taken as fixed). (mean, low, high); None for
    one seed or more than 11."""
    means = [statistics.mean(a[s]) - (statistics.mean(b[s]) if b is not None else 0.0) for s in sorted(a)]
    if len(means) - 1 not in T_975:
        return None
    mean, half = statistics.mean(means), T_975[len(means) - 1] * statistics.stdev(means) / len(means) ** 0.5
    return mean, mean - half, mean + half


def pooled_cell(a, b, what):
    """The pooled line's figures for several seeds on one test set: the crossed bootstrap (seeds and
    tasks resampled, one task draw for every seed), **called** only where it excludes 0, and beside
    it the t-interval over the seeds' means, naming how many seeds it rests on."""
    diff, low, high, called = crossed_bootstrap(a, b)
    t = seed_t_interval(a, b)
    over = f"; t-interval over the {len(a)} seed means [{t[1]:+.3f}, {t[2]:+.3f}]" if t else ""
    return (f"{diff:+.3f} [{low:+.3f}, {high:+.3f}]{' (called)' if called else ''} "
            f"(crossed bootstrap: {what} resampled, one task draw shared by all{over})")


def seeds_bootstrap(a, b=None):
    """The bootstrap of a cell pooled over the seeds of `a` (and `b`): crossed_bootstrap where there
    are several seeds with as many test tasks each, paired_bootstrap for one seed or for seeds on
    other numbers of tasks. Equal counts are the same tasks in the same order wherever this is
    called: --compare and --uncertain pool seeds of one config on one test set (check_results: the
    test split is drawn from data_seed, never from the seed; a subset picks the same tasks in every
    seed), and configs/run_choice.sh sweeps every seed on the test split of configs/choice3.yaml."""
    shared = len(a) > 1 and len({len(v) for v in a.values()}) == 1
    return (crossed_bootstrap if shared else paired_bootstrap)(a, b)


def interval_end(x, called):
    """An interval's end, signed, to 3 decimals; the end of a called interval that rounds to 0.000
    to as many more decimals as show it is not 0 (called means the interval excludes 0: its ends say so)."""
    digits = 3
    while called and float(f"{x:.{digits}f}") == 0 and digits < 8:
        digits += 1
    return f"{x:+.{digits}f}"


def cell(a, b=None):
    """A table cell: 'mean [low, high]' of one arm, or '+diff [low, high]' (with **called** when the
    interval excludes 0) of a - b, by seeds_bootstrap (crossed over seeds that share their test
    tasks); '-' where a seed has no task (an empty subset)."""
    if any(not v for v in a.values()):
        return "-"
    mean, low, high, called = seeds_bootstrap(a, b)
    if b is None:
        return f"{mean:.3f} [{low:.3f}, {high:.3f}]"
    ends = f"[{interval_end(low, called)}, {interval_end(high, called)}]"
    return f"{mean:+.3f} {ends}{' **called**' if called else ''}"


def t_cell(a, b=None):
    """A table cell: '[low, high]' of seed_t_interval (a - b over the seeds' means; the seed level
    alone, the test tasks taken as fixed); '-' for one seed or where a seed has no task."""
    t = None if any(not v for v in a.values()) else seed_t_interval(a, b)
    return "-" if t is None else f"[{t[1]:+.3f}, {t[2]:+.3f}]"


def paired_table(runs, pairs=(("rehearse", "frozen"), ("rehearse", "act_only"), ("real", "rehearse"),
                              ("rehearse", "warmstart"))):
    """{arm: [eval.json with its "seed"]} -> success per arm with its 95% interval (the crossed
    bootstrap over seeds and test tasks, `seeds_bootstrap`) and the paired differences of `pairs`
    (called when that interval excludes 0), each with the t-interval over the seed means beside
    it, for the arms whose every run has `task_rewards`; '' when none has."""
    rewards = {arm: {e["seed"]: e["task_rewards"] for e in evals} for arm, evals in runs.items()
               if all("task_rewards" in e for e in evals)}
    if not rewards:
        return ""
    lines = ["| arm | seeds | success, 95% interval (crossed bootstrap over seeds and test tasks) |",
             "|---|---|---|"]
    lines += [f"| {arm} | {len(by_seed)} | {cell(by_seed)} |" for arm, by_seed in rewards.items()]
    lines += ["", "| difference, all test tasks | seeds | crossed bootstrap, 95% | "
                  "t-interval over the seed means, 95% |", "|---|---|---|---|"]
    lines += [f"| {a} - {b} | {len(rewards[a])} | {cell(rewards[a], rewards[b])} | "
              f"{t_cell(rewards[a], rewards[b])} |"
              for a, b in pairs if a in rewards and b in rewards and sorted(rewards[a]) == sorted(rewards[b])]
    return "\n".join(lines)


def uncertain_runs(results):
    """{arm: {seed: eval.json}} and {arm: {seed: [metric lines]}} of results/<arm>/<seed>, and the
    test tasks' subset ('uncertain' / 'faithful') from the first run's config (same data for all)."""
    from worlds import uncertain as world_uncertain
    from machinery.config import load_config
    from formats.features import build_tasks
    evals, lines, subsets = {}, {}, None
    for arm, seed, folder in run_folders(results, partial=True):
        if os.path.isfile(os.path.join(folder, "eval.json")):      # a run still going has none yet
            evals.setdefault(arm, {})[seed] = read_eval(folder)
            if os.path.isfile(os.path.join(folder, "lookups.json")):     # scripts/uncertain_report.py --lookups
                evals[arm][seed]["lookups"] = read_json(os.path.join(folder, "lookups.json"))
        path = os.path.join(folder, "metrics.jsonl")
        lines.setdefault(arm, {})[seed] = read_json_lines(path) if os.path.isfile(path) else []
        start = os.path.join(folder, "warmstart", "eval.json")      # the warm start the arm began from: step 0
        if lines[arm][seed] and os.path.isfile(start):
            before = read_json(start)
            lines[arm][seed].insert(0, {"step": 0, "eval_success": before["success"],
                                        **({"truth": before["extras"]["truth"]} if "extras" in before else {})})
        if lines[arm][seed] and "success" in evals.get(arm, {}).get(seed, {}):    # the final evaluation, last step
            lines[arm][seed].append({"step": lines[arm][seed][-1]["step"], "eval_success": evals[arm][seed]["success"]})
        if subsets is None and os.path.isfile(os.path.join(folder, "config.yaml")):
            cfg = load_config(os.path.join(folder, "config.yaml"))
            uncertain = world_uncertain.uncertain_set(cfg["data_seed"], cfg["uncertain_items"])
            subsets = [world_uncertain.task_subset(t, uncertain) for t in build_tasks(cfg)["test"]]
    return evals, lines, subsets


def uncertain_tables(evals, subsets, pairs=(("rehearse", "warmstart"), ("rehearse", "frozen"), ("rehearse", "act_only"),
                                            ("real", "rehearse"), ("act_only", "frozen"))):
    """The markdown tables of the world: uncertain experiment: per arm, success with its 95%
    interval on all test tasks and on each subset, and the world's probability of the truth after
    RL; then the paired differences between arms (`difference_tables`: the crossed bootstrap,
    called only when it excludes 0, and the t-interval over the seed means)."""
    def outcomes(arm, subset=None, key="task_rewards"):
        return {s: [r for r, k in zip(e[key], subsets) if subset in (None, k)] for s, e in evals[arm].items()}
    lines = ["| arm | seeds | success, all test tasks | uncertain-item tasks | faithful-item tasks | "
             "p(true) uncertain | p(true) faithful | p(exact) uncertain | imagined success T=1, uncertain / faithful |",
             "|---" * 9 + "|"]
    for arm in evals:
        cells = [arm, str(len(evals[arm]))] + [cell(outcomes(arm, sub)) for sub in (None, "uncertain", "faithful")]
        truth = [e.get("extras", {}).get("truth", {}) for e in evals[arm].values()]
        cells += [mean_and_range([t.get(sub, {}).get(k) for t in truth])
                  for sub, k in (("uncertain", "p_true"), ("faithful", "p_true"), ("uncertain", "p_exact"))]
        imagined = [e.get("extras", {}).get("imagined_sampled") for e in evals[arm].values()]
        cells.append(" / ".join(mean_and_range([i[sub][0] / i[sub][1] if i and i[sub][1] else None for i in imagined])
                                for sub in ("uncertain", "faithful")))
        lines.append("| " + " | ".join(cells) + " |")
    shown = [(a, b) for a, b in pairs if a in evals and b in evals and sorted(evals[a]) == sorted(evals[b])]
    return "\n".join(lines + difference_tables("difference", shown, outcomes))


def difference_tables(what, pairs, outcomes, subsets=(None, "uncertain", "faithful")):
    """The lines of two tables of the differences a - b of `pairs` ({seed: outcomes} from
    outcomes(arm, subset)) on all test tasks and each subset: the crossed bootstrap over seeds and
    test tasks (`cell`; called only when it excludes 0), then (several seeds) the t-interval over
    the seed means."""
    names = " | ".join({None: "all test tasks", "uncertain": "uncertain-item tasks",
                        "faithful": "faithful-item tasks"}[sub] for sub in subsets)
    rule = "|---" * (len(subsets) + 1) + "|"
    lines = ["", f"| {what} (crossed bootstrap over seeds and test tasks, 95%) | {names} |", rule]
    lines += [f"| {a} - {b} | " + " | ".join(cell(outcomes(a, sub), outcomes(b, sub)) for sub in subsets) + " |"
              for a, b in pairs]
    if any(len(outcomes(a, None)) > 1 for a, _ in pairs):          # one seed has no t-interval
        lines += ["", f"| {what}, t-interval over the seed means (95%) | seeds | {names} |", "|---" + rule]
        lines += [f"| {a} - {b} | {len(outcomes(a, None))} | "
                  + " | ".join(t_cell(outcomes(a, sub), outcomes(b, sub)) for sub in subsets) + " |"
                  for a, b in pairs]
    return lines


def uncertain_seed_table(evals, subsets):
    """Per arm, seed by seed (in folder order, seed1 first): real-world success, the policy's
    p(true price) on the uncertain items at the end, and the uncertain-item test tasks whose named
    items the actor looked up (a count, from lookups.json; "-" where a file is missing)."""
    n = sum(k == "uncertain" for k in subsets)
    rows = ["| arm | seeds | success per seed | p(true) uncertain per seed | "
            f"uncertain-item tasks (of {n}) with their items looked up, per seed |", "|---" * 5 + "|"]
    for arm, runs in evals.items():
        seeds = sorted(runs)
        success = [f"{runs[s]['success']:.3f}" if "success" in runs[s] else "-" for s in seeds]
        truth = [runs[s].get("extras", {}).get("truth", {}).get("uncertain", {}).get("p_true") for s in seeds]
        seen = [str(sum(v for v, k in zip(runs[s]["lookups"]["looked_up"], subsets) if k == "uncertain"))
                if "lookups" in runs[s] else "-" for s in seeds]
        rows.append(f"| {arm} | {len(seeds)} | {' / '.join(success)} | "
                    + " / ".join("-" if t is None else f"{t:.3f}" for t in truth) + f" | {' / '.join(seen)} |")
    return "\n".join(rows)


def uncertain_lookup_table(evals, subsets, pairs=(("rehearse", "frozen"), ("rehearse", "act_only"),
                                                  ("real", "rehearse"), ("act_only", "frozen"))):
    """Per arm whose every seed has lookups.json (scripts/uncertain_report.py --lookups): the share of test
    tasks whose named items the actor looked up, per subset, and the success that also needs them
    looked up ("strict"), with 95% intervals; then the paired differences of strict success
    (`difference_tables`)."""
    arms = [arm for arm, runs in evals.items() if all("lookups" in e for e in runs.values())]
    if not arms:
        return ""
    def outcomes(arm, key, subset=None):
        return {s: [r for r, k in zip(e["lookups"][key], subsets) if subset in (None, k)] for s, e in evals[arm].items()}
    rows = ["| arm | seeds | named items looked up, uncertain-item tasks | faithful-item tasks | "
            "strict success (answer right and named items looked up), all | uncertain-item tasks | faithful-item tasks |",
            "|---" * 7 + "|"]
    for arm in arms:
        rows.append(f"| {arm} | {len(evals[arm])} | " + " | ".join(
            [cell(outcomes(arm, "looked_up", sub)) for sub in ("uncertain", "faithful")]
            + [cell(outcomes(arm, "strict", sub)) for sub in (None, "uncertain", "faithful")]) + " |")
    shown = [(a, b) for a, b in pairs if a in arms and b in arms and sorted(evals[a]) == sorted(evals[b])]
    return "\n".join(rows + difference_tables("strict success, difference", shown,
                                               lambda arm, sub: outcomes(arm, "strict", sub)))


def uncertain_family_table(evals, families=("price", "cost", "buy1", "buyq", "buy2", "buyq2")):
    """Real-world success per task family of each arm (eval.json `success_by_family`), mean
    (min-max) over seeds: where the actor, not the world, fails (docs/uncertain.md)."""
    rows = ["| arm | " + " | ".join(families) + " |", "|---" * (len(families) + 1) + "|"]
    for arm, runs in evals.items():
        by_family = [e.get("success_by_family", {}) for e in runs.values()]
        rows.append(f"| {arm} | " + " | ".join(mean_and_range([b.get(f) for b in by_family]) for f in families) + " |")
    return "\n".join(rows)


def uncertain_collusion_table(lines, last=20):
    """Collusion in the RL batches of each arm that rehearses, counts pooled over each run's last
    `last` steps and the seeds: colluding / wrong calls on uncertain-item and faithful-item tasks,
    and over the calls whose earlier rehearsals were faithful (`decided`), with the batch's
    sampled price fidelity per subset over the same steps."""
    rows = ["| arm | steps pooled | colluding / wrong, uncertain-item tasks | faithful-item tasks | decided calls | "
            "sampled price fidelity, uncertain / faithful |", "|---" * 6 + "|"]
    for arm, runs in lines.items():
        pooled, fidelity, spans = {}, {"uncertain": [0, 0], "faithful": [0, 0]}, []
        for run in runs.values():
            steps = [m for m in run if "collusion_subsets" in m]
            if not steps:
                continue
            tail = [m for m in steps if m["step"] > steps[-1]["step"] - last]
            spans.append(f"{tail[0]['step']}-{tail[-1]['step']}")
            for m in tail:
                for sub, counts in m["collusion_subsets"].items():
                    cell = pooled.setdefault(sub, [0, 0])
                    cell[0] += counts["colluding"]
                    cell[1] += counts["wrong"]
                for sub, (hits, n) in m["price_fidelity_subsets"].items():
                    fidelity[sub][0] += hits
                    fidelity[sub][1] += n
        if spans:
            rate = [f"{fidelity[sub][0] / fidelity[sub][1]:.3f}" if fidelity[sub][1] else "-" for sub in ("uncertain", "faithful")]
            rows.append(f"| {arm} | {', '.join(spans)} | " + " | ".join(
                f"{pooled.get(sub, [0, 0])[0]} / {pooled.get(sub, [0, 0])[1]}" for sub in ("uncertain", "faithful", "decided"))
                + f" | {rate[0]} / {rate[1]} |")
    return "\n".join(rows) if len(rows) > 2 else ""


def plot_uncertain(lines, path):
    """Four panels against RL steps, one colour per arm (mean over seeds): the policy's p(true
    price) on uncertain (solid) and faithful (dashed) items; the sampled price fidelity of the RL
    batch's rehearsals on uncertain items (whoever played the world, pooled over 10 steps); the
    share of the batch's catalogue lookups that price an uncertain item (pooled over 10 steps: an
    actor that avoids them prices others); and real-world success at each evaluation."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 4, figsize=(20, 4.2))
    for n, (arm, runs) in enumerate(lines.items()):
        colour = f"C{n}"
        for sub, style in (("uncertain", "-"), ("faithful", "--")):
            steps = sorted({m["step"] for run in runs.values() for m in run if "truth" in m})
            values = [statistics.mean([m["truth"][sub]["p_true"] for run in runs.values() for m in run
                                       if m["step"] == s and "truth" in m]) for s in steps]
            if steps:
                axes[0].plot(steps, values, style, color=colour, label=f"{arm}, {sub}")
        steps, values, shares = [], [], []
        end = max((m["step"] for run in runs.values() for m in run), default=0)
        for hi in range(10, end + 10, 10):
            window = [m["price_fidelity_subsets"] for run in runs.values() for m in run
                      if hi - 10 < m["step"] <= hi and "price_fidelity_subsets" in m]
            hits = [w["uncertain"] for w in window]
            if sum(h[1] for h in hits):
                steps.append(hi)
                values.append(sum(h[0] for h in hits) / sum(h[1] for h in hits))
                shares.append(sum(h[1] for h in hits) / sum(w["uncertain"][1] + w["faithful"][1] for w in window))
        if steps:
            axes[1].plot(steps, values, marker="o", markersize=3, color=colour, label=arm)
            axes[2].plot(steps, shares, marker="o", markersize=3, color=colour, label=arm)
        points = sorted({m["step"] for run in runs.values() for m in run if "eval_success" in m})
        if points:
            axes[3].plot(points, [statistics.mean([m["eval_success"] for run in runs.values() for m in run
                                                   if m["step"] == s and "eval_success" in m]) for s in points],
                         marker="o", markersize=3, color=colour, label=arm)
    axes[0].set(xlabel="RL step", ylabel="policy's p(true price) after <env>", ylim=(0, 1.02))
    axes[1].set(xlabel="RL step", ylabel="sampled fidelity, uncertain items (RL batch)", ylim=(0, 1.02))
    axes[2].set(xlabel="RL step", ylabel="share of the RL batch's lookups: uncertain items", ylim=(0, 0.6))
    axes[3].set(xlabel="RL step", ylabel="held-out success (real world)", ylim=(0, 1.02))
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def uncertain(results):
    """Write <results>/results.md (uncertain_tables, uncertain_seed_table, uncertain_family_table,
    uncertain_lookup_table, uncertain_collusion_table) and <results>/uncertain.png (plot_uncertain)."""
    check_results(results)
    evals, lines, subsets = uncertain_runs(results)
    if not evals and not lines:
        raise FileNotFoundError(f"no runs (<arm>/<seed>/eval.json) under {results}")
    text = (uncertain_tables(evals, subsets) + "\n\nseed by seed\n\n" + uncertain_seed_table(evals, subsets)
            + "\n\nreal-world success per task family\n\n" + uncertain_family_table(evals))
    lookups = uncertain_lookup_table(evals, subsets)
    text += "\n\nthe items the actor looked up (real world, greedy; scripts/uncertain_report.py --lookups)\n\n" + lookups if lookups else ""
    collusion = uncertain_collusion_table(lines)
    text += "\n\n" + collusion if collusion else ""
    going = {arm: {seed: run[-1]["step"] for seed, run in runs.items() if run}
             for arm, runs in lines.items() if set(runs) - set(evals.get(arm, {}))}
    if going:
        text += f"\n\nRuns still going (no eval.json yet; the figure has their steps so far): {going}"
    plot_uncertain({arm: runs for arm, runs in lines.items() if arm != "warmstart"}, os.path.join(results, "uncertain.png"))
    with open(os.path.join(results, "results.md"), "w") as f:
        f.write(text + "\n")
    return text


def before_after(runs, families=False):
    """Each run's eval.json: real-world success before RL (the warm start, `before`) and after, and
    the paired bootstrap of after - before over its test tasks; for several runs (seeds of one
    config, the same test tasks), a last line pooling them (`pooled_cell`: the crossed bootstrap,
    seeds resampled and one task draw shared by all, and the t-interval over the seed means)."""
    check_once(runs)
    results = [read_eval(run) for run in runs]
    check_seeds(list(zip(runs, results)))
    lines, afters, befores = [], {}, {}
    for k, (run, after) in enumerate(zip(runs, results)):
        before = after["before"]
        afters[k], befores[k] = after["task_rewards"], before["task_rewards"]
        diff, low, high, called = paired_bootstrap({1: afters[k]}, {1: befores[k]})
        lines.append(f"{run}: real-world success {before['success']:.3f} -> {after['success']:.3f} on "
                     f"{len(after['task_rewards'])} test tasks; after - before {diff:+.3f} [{low:+.3f}, {high:+.3f}]"
                     f"{' (called)' if called else ''}")
    if len(runs) > 1:
        mean = {name: sum(sum(r) / len(r) for r in rewards.values()) / len(runs)
                for name, rewards in (("before", befores), ("after", afters))}
        lines.append(f"{len(runs)} runs pooled: real-world success {mean['before']:.3f} -> {mean['after']:.3f}; "
                     f"after - before {pooled_cell(afters, befores, 'runs')}")
        if families:
            lines += ["per family, before -> after; after - before:"] + by_family(afters, befores, test_families(runs[0]))
    return "\n".join(lines)


def test_families(run):
    """The family of each test task of a run, in its eval.json's order: the test split its saved
    config makes (formats/features.build_tasks; generated or read from its files)."""
    from formats import features
    from machinery.config import load_config
    return [t.get("family", "file") for t in features.build_tasks(load_config(os.path.join(run, "config.yaml")))["test"]]


def by_family(a, b, families, what="runs"):
    """Lines per task family of pooled seeds: a's and b's mean success (b: before RL, or the other
    arm) and a - b with `pooled_cell`'s crossed bootstrap over the family's tasks. a, b: {seed:
    [outcome per test task]}; families: the family of each test task. The toy's purchase families
    (buy*) are also pooled as one line, "purchases"."""
    groups = {f: [i for i, x in enumerate(families) if x == f] for f in sorted(set(families))}
    buys = [i for i, x in enumerate(families) if x.startswith("buy")]
    if buys and len(groups) > 1:
        groups["purchases (buy*)"] = buys
    lines = []
    for name, idx in groups.items():
        pick = lambda arm: {k: [v[i] for i in idx] for k, v in arm.items()}        # noqa: E731
        mean = lambda arm: sum(sum(v) for v in arm.values()) / (len(arm) * len(idx))    # noqa: E731
        lines.append(f"  {name} ({len(idx)} tasks): {mean(pick(b)):.3f} -> {mean(pick(a)):.3f}; "
                     f"{pooled_cell(pick(a), pick(b), what)}")
    return lines


def difference(runs, families=False):
    """After RL, run A minus run B for each pair (A, B) of `runs` (two arms of one seed on one test
    set, e.g. real and rehearse continued from one warm start): the paired bootstrap over the test
    tasks; for several pairs (seeds), a last line pooling them (`pooled_cell`: the crossed
    bootstrap, pairs resampled and one task draw shared by all, and the t-interval over the pairs)."""
    check_once(runs)
    results = [read_eval(run) for run in runs]
    pairs = list(zip(zip(runs[0::2], results[0::2]), zip(runs[1::2], results[1::2])))
    for first, second in pairs:         # one seed's arms: the same test tasks, evaluated alike
        check_test_set([first, second], why=" (a difference is taken task by task)")
    check_seeds([first for first, _ in pairs])
    check_seeds([second for _, second in pairs])
    lines, a, b = [], {}, {}
    for k, ((run_a, result_a), (run_b, result_b)) in enumerate(pairs):
        a[k], b[k] = result_a["task_rewards"], result_b["task_rewards"]
        diff, low, high, called = paired_bootstrap({1: a[k]}, {1: b[k]})
        lines.append(f"{run_a} - {run_b}: real-world success {result_a['success']:.3f} - {result_b['success']:.3f} "
                     f"on {len(a[k])} test tasks = {diff:+.3f} [{low:+.3f}, {high:+.3f}]{' (called)' if called else ''}")
    if len(pairs) > 1:
        lines.append(f"{len(pairs)} pairs pooled: {pooled_cell(a, b, 'pairs')}")
        if families:
            lines += ["per family, B -> A; A - B:"] + by_family(a, b, test_families(runs[0]), "pairs")
    return "\n".join(lines)


def validation(runs):
    """Each run's validation curve (a run with n_val > 0, finished or not): success on the validation
    split at step 0 (the warm start: warmstart/eval_val.json), at every eval_every step
    (metrics.jsonl's val_task_rewards) and at the latest checkpoint's step where evaluate.py
    --validation measured it (ckpt/eval_val.json), each step minus step 0 with the paired bootstrap over the
    validation tasks. For several runs (seeds or recipes on one split), a line per step that every
    run reached, pooling them (`pooled_cell`: the crossed bootstrap and the t-interval over the runs)."""
    check_once(runs)
    curves = {}
    for run in runs:
        path = os.path.join(run, "warmstart", "eval_val.json")
        if not os.path.isfile(path):
            raise PoolError(f"{path}: no such file (a run with n_val > 0 writes it after its warm start)")
        steps = [(0, read_json(path)["task_rewards"])]
        steps += [(m["step"], m["val_task_rewards"]) for m in read_json_lines(os.path.join(run, "metrics.jsonl"))
                  if "val_task_rewards" in m]
        last_path = os.path.join(run, "ckpt", "eval_val.json")      # evaluate.py --validation on the latest checkpoint
        last = read_json(last_path) if os.path.isfile(last_path) else None
        if last and last["step"] not in dict(steps):
            steps.append((last["step"], last["task_rewards"]))
        curves[run] = dict(sorted(steps))
    lines = []
    for run, curve in curves.items():
        base, cells = curve[0], [f"step 0 {statistics.mean(curve[0]):.3f}"]
        for step, rewards in list(curve.items())[1:]:
            diff, low, high, called = paired_bootstrap({1: rewards}, {1: base})
            cells.append(f"step {step} {statistics.mean(rewards):.3f} ({diff:+.3f} [{low:+.3f}, {high:+.3f}]"
                         f"{' called' if called else ''})")
        lines.append(f"{run}: validation success on {len(base)} tasks, minus step 0 per step: " + "; ".join(cells))
    if len(runs) > 1:
        shared = sorted(set.intersection(*(set(curve) for curve in curves.values())) - {0})
        for step in shared:
            lines.append(f"{len(runs)} runs pooled, step {step} minus step 0: "
                         + pooled_cell({k: c[step] for k, c in enumerate(curves.values())},
                                       {k: c[0] for k, c in enumerate(curves.values())}, "runs"))
    return "\n".join(lines)


def main(argv=None):
    from machinery.config import ArgumentParser, ConfigError
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--compare", metavar="RESULTS", help="compare <RESULTS>/<arm>/<seed> runs")
    group.add_argument("--uncertain", metavar="RESULTS", help="the world: uncertain runs under RESULTS")
    group.add_argument("--before_after", metavar="RUN", nargs="+",
                       help="each run's success before and after RL, paired; several runs (seeds) pooled too")
    group.add_argument("--difference", metavar="RUN", nargs="+",
                       help="pairs RUN_A RUN_B: A - B after RL, paired over test tasks; several pairs (seeds) pooled")
    group.add_argument("--validation", metavar="RUN", nargs="+",
                       help="each run's validation curve (n_val > 0): every step minus step 0, paired; runs pooled")
    group.add_argument("--curves", metavar="RUN", nargs="+",
                       help="draw the runs' curves (real-world success, reward, clip_frac) on one figure: --out")
    parser.add_argument("--out", default="curves.png", help="--curves: the PNG to write (default curves.png)")
    parser.add_argument("--by_family", action="store_true",
                        help="--before_after, --difference: the pooled figures per task family too")
    try:
        args = parser.parse_args(argv)            # (--help prints and exits 0 here)
        for option, results in (("--compare", args.compare), ("--uncertain", args.uncertain)):
            if results is not None and not os.path.isdir(results):
                raise ConfigError(f"{option} {results}: no such folder (a results folder holds <arm>/<seed>/ runs)")
        if args.difference and len(args.difference) % 2:
            raise ConfigError(f"--difference takes pairs of runs (RUN_A RUN_B ...), got {len(args.difference)} runs")
        for option, runs in (("--before_after", args.before_after), ("--difference", args.difference)):
            for run in runs or []:
                if not os.path.isfile(os.path.join(run, "eval.json")):
                    raise ConfigError(f"{option} {run}: " + ("no eval.json in it (a finished run of train.py has one)"
                                                             if os.path.isdir(run) else "no such folder"))
        for run in args.validation or []:
            if not os.path.isdir(run):
                raise ConfigError(f"--validation {run}: no such folder")
        for run in args.curves or []:
            if not os.path.isfile(os.path.join(run, "metrics.jsonl")):
                raise ConfigError(f"--curves {run}: " + ("no metrics.jsonl in it (a train.py run with RL steps has one)"
                                                         if os.path.isdir(run) else "no such folder"))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        if args.curves:
            from reporting.metrics import draw_curves
            draw_curves(args.curves, args.out, [os.path.basename(os.path.normpath(r)) for r in args.curves])
            print(f"the curves of {len(args.curves)} run(s) written to {args.out}")
        elif args.validation:
            print(validation(args.validation))
        elif args.before_after or args.difference:
            print(before_after(args.before_after, args.by_family) if args.before_after
                  else difference(args.difference, args.by_family))
        else:
            print(compare(args.compare) if args.compare else uncertain(args.uncertain))
    except (OSError, KeyError, json.JSONDecodeError, PoolError) as e:
        where = args.compare or args.uncertain or " ".join(args.before_after or args.difference or args.validation
                                                          or args.curves)
        print(f"error: cannot compare the runs in {where}: {e}",
              file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
