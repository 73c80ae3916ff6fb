"""Evaluation in the REAL toy world: the only place the true dynamics are used.

The paper trains with rehearsal but reports success on real benchmarks; likewise here every
success figure is measured with the real world answering the policy's calls, never with the
policy's own rehearsals (an imagined success can rise while the real one does not). Besides
success, it reports how episodes ended (format errors), the mean number of calls, and the
rehearsal fidelity the model would have had if it had rehearsed those calls itself. To see
whether the world model stayed honest, it also lets the policy act AND rehearse (no real call in
the loop) on the first `n_collusion` test tasks: success in that imagined world, the fidelity of
those rehearsals against a real replay, and the collusion rate (rehearse.collusion_counts).

    python evaluate.py --ckpt out/small                 # the RL'd policy
    python evaluate.py --ckpt out/small/warmstart       # the warm start it came from
    python evaluate.py --ckpt out/small --coverage      # fidelity by warm-start coverage, before and
                                                        # after RL: <ckpt>/coverage.json
    python evaluate.py --ckpt out/small --collusion     # the imagined-world measures only:
                                                        # <ckpt>/collusion.json, eval.json untouched

Chat-format tasks (chat.py) run in the real toy world when they are the toy's (`env: toy`);
other chat tasks have no executor: the policy rehearses their tool responses and success is
judged by the task's criteria alone (answer, gold calls, checklist judge).

Writes <ckpt>/eval.json with at least {"success": float, "n_tasks": int}.
"""
import argparse
import functools
import json
import os
import statistics
import sys

import torch

import rehearse
import world as toy_world
from envace import encode_episode
from reward import cause_counts, task_reward
from rollout import sample_episodes, sample_separate


def evaluate(model, tokenizer, tasks, cfg, batch_size=512, seed=0, rehearser=None, world=toy_world,
             warm_start_counts=None, examples=None):
    """Run `tasks` in the real world (sampling per cfg eval_temperature/top_p) and measure. With
    cfg rehearsal_budget N > 0, each task is first privately rehearsed N times (rehearse.py;
    `rehearser` plays the world in imagination instead of the policy if given) and the real
    execution commits to the plan. `warm_start_counts` ({call: count}) adds fidelity by coverage.
    With cfg rehearsal_context separate, would-rehearse fidelity and private rehearsal ask the model
    in separate rehearse rows, with `examples` (train.logged_examples) as its grounding examples.
    Chat-format tasks go to `evaluate_chat`."""
    if cfg["format"] == "chat":
        return evaluate_chat(model, tokenizer, tasks, cfg, batch_size, seed, warm_start_counts)
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    limits = {k: cfg[k] for k in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
    episodes, imagined = [], []
    for i in range(0, len(tasks), batch_size):
        prompts = [t["prompt"] for t in tasks[i:i + batch_size]]
        plans, used = None, [0] * len(prompts)
        if cfg["rehearsal_budget"]:
            plans, used = rehearse.private_rehearsal_plans(
                model, tokenizer, prompts, cfg["rehearsal_budget"], cfg["rehearsal_mode"], rehearser,
                temperature=cfg["imagine_temperature"], generator=generator, world=world,
                context=cfg["rehearsal_context"], examples=examples, **limits)
        episodes += sample_episodes(model, tokenizer, prompts, "real", world=world, plans=plans,
                                    temperature=cfg["eval_temperature"], top_p=cfg["top_p"],
                                    generator=generator, **limits)
        imagined += used
    rewards = [task_reward(e, t) for e, t in zip(episodes, tasks)]
    causes = cause_counts(episodes)
    if cfg["rehearsal_context"] == "separate":     # asked in the context it rehearses in
        calls = rehearse.would_rehearse_separate(model, tokenizer, episodes, examples, world)
    else:
        calls = rehearse.would_rehearse_calls(model, tokenizer, episodes)
    fidelity = rehearse.by_kind(calls, world)
    by_family = {}
    for t, r in zip(tasks, rewards):
        by_family.setdefault(t["family"], []).append(r)
    result = {
        "success": sum(rewards) / len(tasks),
        "n_tasks": len(tasks),
        "format_errors": sum(n for c, n in causes.items() if c != "answer") / len(tasks),
        "causes": causes,
        "mean_calls": sum(len(e["calls"]) for e in episodes) / len(tasks),
        "fidelity": rehearse.rates(fidelity),
        "fidelity_counts": fidelity,
        "success_by_family": {f: sum(r) / len(r) for f, r in sorted(by_family.items())},
        "rehearsal_budget": cfg["rehearsal_budget"], "rehearsal_mode": cfg["rehearsal_mode"],
        "imagined_per_task": sum(imagined) / len(tasks),
    }
    if warm_start_counts is not None:
        result["fidelity_by_coverage"] = coverage_fidelity(model, tokenizer, tasks, cfg, warm_start_counts,
                                                           examples, world)
    if cfg["n_collusion"]:
        result.update(imagined_world(model, tokenizer, tasks[:cfg["n_collusion"]], cfg, generator,
                                     world, batch_size, examples))
    return result


def coverage_fidelity(model, tokenizer, tasks, cfg, warm_start_counts, examples=None, world=toy_world):
    """The coverage caveat: would-rehearse fidelity on the EXPERT's calls of `tasks` (their real
    responses replayed), bucketed by how often each exact call was in the warm-start data. The
    expert's calls, not the policy's: a policy that never calls an unseen item would hide it."""
    expert = []
    for t in tasks:
        if t.get("calls"):
            responses = world.replay(t["calls"])
            expert.append({**encode_episode(tokenizer, t["prompt"], t["calls"], responses, t["answer"]),
                           "calls": t["calls"], "responses": responses})
    if cfg["rehearsal_context"] == "separate":
        pairs = rehearse.would_rehearse_separate(model, tokenizer, expert, examples, world)
    else:
        pairs = rehearse.would_rehearse_calls(model, tokenizer, expert)
    return rehearse.fidelity_by_coverage(pairs, warm_start_counts)


def imagined_world(model, tokenizer, tasks, cfg, generator=None, world=toy_world, batch_size=512,
                   examples=None):
    """The world model's honesty on `tasks`: the policy acts and rehearses (rehearse mode, the
    eval sampling, no real call in the loop; in separate rows with `examples` if cfg
    rehearsal_context is separate), and the episodes are scored against a real replay.
    Returns imagined_success (the task reward in that imagined world), imagined_fidelity (per tool
    kind) and collusion ({calls, wrong, colluding, rate}, rehearse.collusion_counts)."""
    model.eval()
    limits = {k: cfg[k] for k in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
    sampler = sample_episodes
    if cfg["rehearsal_context"] == "separate":      # it rehearses where it was trained to
        sampler = functools.partial(sample_separate, examples=examples)
    episodes = []
    for i in range(0, len(tasks), batch_size):
        episodes += sampler(model, tokenizer, [t["prompt"] for t in tasks[i:i + batch_size]], "rehearse",
                            world=world, temperature=cfg["eval_temperature"], top_p=cfg["top_p"],
                            generator=generator, **limits)
    fidelity = rehearse.replay_fidelity(episodes, world)
    return {"imagined_success": sum(task_reward(e, t) for e, t in zip(episodes, tasks)) / len(tasks),
            "imagined_fidelity": rehearse.rates(fidelity), "imagined_fidelity_counts": fidelity,
            "collusion": rehearse.collusion_rate(rehearse.collusion_counts(episodes, tasks, world))}


def evaluate_chat(model, tokenizer, tasks, cfg, batch_size=512, seed=0, warm_start_counts=None):
    """Chat-format tasks: those a real environment executes (env: toy) run in it, with would-
    rehearse fidelity per tool kind; the others have no executor, so the policy rehearses their
    tool responses itself and success is judged by the task's criteria only (answer, gold_calls,
    checklist judge). Same keys as `evaluate`, plus how many tasks ran in each way. With
    rehearsal_context separate, fidelity asks in separate rehearse rows (chat.rehearse_rows) and
    tasks without an executor are rehearsed in them (rollout.sample_separate)."""
    import chat
    from reward import chat_reward
    model.eval()
    tags = chat.chat_format(tokenizer)
    generator = torch.Generator().manual_seed(seed)
    limits = {k: cfg[k] for k in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
    episodes = [None] * len(tasks)
    real = [i for i, t in enumerate(tasks) if t.get("env") == "toy"]
    for mode, index in (("real", real), ("rehearse", [i for i in range(len(tasks)) if i not in set(real)])):
        for k in range(0, len(index), batch_size):
            part = index[k:k + batch_size]
            prompts, worlds = chat.episode_inputs(tokenizer, tags, [tasks[i] for i in part])
            sample = sample_episodes
            if mode == "rehearse" and cfg["rehearsal_context"] == "separate":   # as it was trained
                sample = functools.partial(sample_separate, rehearse_prompt=functools.partial(
                    chat.separate_prompt, tokenizer, cfg["grounding_examples"]))
            out = sample(model, tokenizer, prompts, mode, world=worlds, tags=tags,
                         temperature=cfg["eval_temperature"], top_p=cfg["top_p"],
                         generator=generator, **limits)
            for i, e in zip(part, out):
                episodes[i] = e
    judge = load_judge(cfg, next(model.parameters()).device)
    rewards = [chat_reward(e, t, judge) for e, t in zip(episodes, tasks)]
    causes = cause_counts(episodes)
    real_eps = [episodes[i] for i in real]
    if cfg["rehearsal_context"] == "separate":      # asked in the rows it rehearses in
        rows = [r for i in real for r in chat.rehearse_rows(
            tokenizer, tags, tasks[i], [json.loads(c) for c in episodes[i]["calls"]], episodes[i]["responses"],
            cfg["grounding_examples"])]
        calls = rehearse.would_rehearse_rows(model, rows, tokenizer.pad_token_id)
    else:
        calls = rehearse.would_rehearse_calls(model, tokenizer, real_eps, env_end=tags["env_end"]) if real else []
    fidelity = rehearse.by_kind(calls, tasks[real[0]]["world"]) if calls else {}
    by_family = {}
    for t, r in zip(tasks, rewards):
        by_family.setdefault(t.get("family", "file"), []).append(r)
    result = {
        "success": sum(rewards) / len(tasks), "n_tasks": len(tasks),
        "format_errors": sum(n for c, n in causes.items() if c != "answer") / len(tasks),
        "causes": causes, "mean_calls": sum(len(e["calls"]) for e in episodes) / len(tasks),
        "fidelity": rehearse.rates(fidelity), "fidelity_counts": fidelity, "fidelity_measured": bool(real),
        "success_by_family": {f: sum(r) / len(r) for f, r in sorted(by_family.items())},
        "real_tasks": len(real), "rehearsed_tasks": len(tasks) - len(real),
        "rehearsal_budget": 0, "rehearsal_mode": cfg["rehearsal_mode"], "imagined_per_task": 0.0,
    }
    if warm_start_counts is not None:
        result["fidelity_by_coverage"] = rehearse.fidelity_by_coverage(calls, warm_start_counts)
    return result


_JUDGES = {}


def load_judge(cfg, device):
    """chat_reward's judge from cfg judge_model (loaded once per path), or None."""
    if not cfg["judge_model"]:
        return None
    if cfg["judge_model"] not in _JUDGES:
        from reward import make_judge
        from train import load_policy
        model, tokenizer = load_policy(cfg["judge_model"], device)
        _JUDGES[cfg["judge_model"]] = make_judge(model.eval(), tokenizer)
    return _JUDGES[cfg["judge_model"]]


def summary(m):
    """One line for the terminal."""
    fid = " ".join(f"{k} {v:.3f}" for k, v in m["fidelity"].items())
    line = (f"success {m['success']:.3f} on {m['n_tasks']} tasks | format errors "
            f"{m['format_errors']:.3f} | mean calls {m['mean_calls']:.2f} | would-rehearse fidelity: {fid}")
    return line + (f" | {imagined_summary(m)}" if "collusion" in m else "")


def imagined_summary(m):
    c = m["collusion"]
    rate = "-" if c["rate"] is None else f"{c['rate']:.3f}"
    return (f"imagined success {m['imagined_success']:.3f}, collusion {rate} "
            f"({c['colluding']} of {c['wrong']} wrong calls)")


# ----------------------------------------------------------------------------- private rehearsal sweep

def rehearsal_sweep(model, tokenizer, tasks, cfg, rehearsers, budgets=(0, 1, 2, 4),
                    modes=("parallel", "sequential"), examples=None):
    """Success against the private-rehearsal budget N, for each mode and each model that plays the
    world in imagination ({name: model or None for the policy itself}). One row per setting."""
    rows = []
    for name, rehearser in rehearsers.items():
        for mode in modes:
            for n in budgets:
                m = evaluate(model, tokenizer, tasks, {**cfg, "rehearsal_budget": n, "rehearsal_mode": mode,
                                                             "n_collusion": 0},
                             seed=cfg["seed"], rehearser=rehearser, examples=examples)
                rows.append({"rehearser": name, "mode": mode, "budget": n, "success": m["success"],
                             "imagined_per_task": m["imagined_per_task"], "mean_calls": m["mean_calls"]})
    return rows


# ----------------------------------------------------------------------------- comparing runs

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
    for arm in sorted(os.listdir(results)):
        if not os.path.isdir(os.path.join(results, arm)):      # results.md, the figures
            continue
        for seed in sorted(os.listdir(os.path.join(results, arm))):
            folder = os.path.join(results, arm, seed)
            if not os.path.isfile(os.path.join(folder, "eval.json")):
                continue
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
    for arm in sorted(os.listdir(results)):
        if not os.path.isdir(os.path.join(results, arm)):
            continue
        for seed in sorted(os.listdir(os.path.join(results, arm))):
            folder = os.path.join(results, arm, seed)
            metrics = os.path.join(folder, "metrics.jsonl")
            if os.path.isfile(os.path.join(folder, "eval.json")):
                lines = [json.loads(line) for line in open(metrics)] if os.path.isfile(metrics) else []
                rl.setdefault(arm, []).append(lines)
    return rl


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


# ----------------------------------------------------------------------------- command line

def main(argv=None):
    from envace import find_checkpoint
    from train import (ConfigError, build_tasks, chat_tags, load_config, load_policy, logged_examples, pick_device,
                       warm_start_call_counts)
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", help="a run folder of train.py, or a checkpoint in it")
    parser.add_argument("--n_test", type=int, default=None, help="evaluate on the first N test tasks")
    parser.add_argument("--rehearser", help="a checkpoint that plays the world in private rehearsal")
    parser.add_argument("--sweep", action="store_true",
                        help="private rehearsal with N = 0, 1, 2, 4, parallel and sequential")
    parser.add_argument("--compare", metavar="RESULTS", help="compare <RESULTS>/<arm>/<seed> runs")
    parser.add_argument("--coverage", action="store_true",
                        help="fidelity by warm-start coverage of the run's warm start and latest checkpoint, "
                             "into <ckpt>/coverage.json")
    parser.add_argument("--collusion", action="store_true",
                        help="only the imagined-world measures (collusion), into <ckpt>/collusion.json")
    args, overrides = parser.parse_known_args(argv)
    if args.compare:
        try:
            print(compare(args.compare))
        except (OSError, KeyError, json.JSONDecodeError) as e:
            print(f"error: cannot compare the runs in {args.compare}: {e}", file=sys.stderr)
            return 2
        return 0
    try:
        if not args.ckpt:
            raise ConfigError("give --ckpt <run folder> (or --compare <results folder>)")
        # a run folder holds its latest checkpoint in ckpt/; warmstart/ is a checkpoint itself
        path = find_checkpoint(os.path.join(args.ckpt, "ckpt")) or find_checkpoint(args.ckpt)
        if path is None or not os.path.isfile(os.path.join(path, "config.yaml")):
            raise ConfigError(f"no checkpoint written by train.py in {args.ckpt}")
        cfg = load_config(os.path.join(path, "config.yaml"), overrides)
        model, tokenizer = load_policy(path, pick_device(cfg))
        rehearser = load_policy(args.rehearser, pick_device(cfg))[0] if args.rehearser else None
        splits = build_tasks(cfg)
        tasks, examples = splits["test"], logged_examples(cfg, splits)
        if cfg["format"] == "chat":
            chat_tags(tokenizer)              # a template that does not fit: one line
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = tasks[:args.n_test] if args.n_test else tasks
    counts = warm_start_call_counts(cfg, splits) if cfg["format"] == "plain" else None
    if args.coverage:
        try:
            warm = load_policy(os.path.join(args.ckpt, "warmstart"), pick_device(cfg))[0]
        except ConfigError as e:
            print(f"error: --coverage compares the run's warm start with its checkpoint: {e}", file=sys.stderr)
            return 2
        result = {when: coverage_fidelity(m, tokenizer, tasks, cfg, counts, examples)
                  for when, m in (("before", warm), ("after", model))}
        for when, buckets in result.items():
            print(f"{when}: " + ", ".join(f"{b} {m}/{n}" for b, (m, n) in buckets.items()))
        with open(os.path.join(args.ckpt, "coverage.json"), "w") as f:
            json.dump(result, f, indent=1)
        return 0
    if args.collusion:
        n = cfg["n_collusion"] or len(tasks)
        metrics = imagined_world(model, tokenizer, tasks[:n], cfg, torch.Generator().manual_seed(cfg["seed"]),
                                 examples=examples)
        print(imagined_summary(metrics))
        with open(os.path.join(args.ckpt, "collusion.json"), "w") as f:
            json.dump(metrics, f, indent=1)
        return 0
    if args.sweep:
        rehearsers = {"policy": None, **({"rehearser": rehearser} if rehearser is not None else {})}
        rows = rehearsal_sweep(model, tokenizer, tasks, cfg, rehearsers, examples=examples)
        for r in rows:
            print(f"{r['rehearser']:9s} {r['mode']:10s} N={r['budget']}: success {r['success']:.3f}, "
                  f"{r['imagined_per_task']:.2f} imagined and {r['mean_calls']:.2f} real calls per task")
        with open(os.path.join(args.ckpt, "private_rehearsal.json"), "w") as f:
            json.dump(rows, f, indent=1)
        return 0
    metrics = evaluate(model, tokenizer, tasks, cfg, seed=cfg["seed"], rehearser=rehearser, examples=examples,
                       warm_start_counts=counts)
    print(summary(metrics))
    with open(os.path.join(args.ckpt, "eval.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
