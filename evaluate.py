"""Evaluation in the REAL toy world: the only place the true dynamics are used.

The paper trains with rehearsal but reports success on real benchmarks; likewise every success
figure here is measured with the real world answering the policy's calls, never with its own
rehearsals (an imagined success can rise while the real one does not). Besides success: how
episodes ended, the mean number of calls, the would-rehearse fidelity per tool kind, and on the
first `n_collusion` test tasks the imagined world's success and collusion rate (worldmodel/honesty.py).
Every rehearse prompt here is grounded by the tool cache (worldmodel/toolcache.py), built from
training traffic only; `cache_coverage` and `fidelity_by_cache` say which test calls it holds.

    python evaluate.py --ckpt out/small                 # the RL'd policy: <ckpt>/eval.json
    python evaluate.py --ckpt out/small/warmstart       # the warm start it came from
    python evaluate.py --model PATH --config CONFIG     # a model as it is, untrained: <out_dir>/eval.json
    python evaluate.py --ckpt out/small --sweep         # private rehearsal at N = 0, 1, 2, 4
(--coverage, --collusion, --oracle and the command line itself: scripts/evaluate_cli.py). What depends on
the format and the rehearsal layout comes from the format module `fmt` and its `setting`
(features.setup; formats/format_plain.py for the demo); chat tasks with no executor are rehearsed by the
policy, their figure "rehearsed success (no executor)" (`success_name`).
"""
import functools
import runpy
import time

import torch
from tqdm import tqdm

from worldmodel import honesty
import rehearse
from reward import outcome_record
import rollout
from rollout import sample_episodes


def evaluate(model, tokenizer, tasks, cfg, fmt, setting, seed=0, rehearser=None):
    """Paper, evaluation by real execution: run `tasks` in the REAL world (sampling per cfg eval_temperature/top_p) and measure
    success, how episodes ended, and would-rehearse fidelity per tool kind. Tasks no executor can
    run (fmt.executes) are rehearsed by the policy instead, and counted apart. With cfg
    rehearsal_budget N > 0, each task is first privately rehearsed N times (rehearse.py;
    `rehearser` plays the world in imagination instead of the policy if given) and the real
    execution commits to the plan. Returns the eval.json dict, with `seconds` (wall time of the
    episodes, the would-rehearse check, the imagined world, the world's extras), `task_rewards`
    (per task, in order: scripts/compare.py's paired_bootstrap) and the world's own figures in
    `extras` (fmt.eval_extras: world: uncertain's per-subset truth probe and success; absent for
    the demo's world)."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    imagining = {**rollout.limits(cfg), "temperature": cfg["imagine_temperature"]}   # private rehearsal's settings
    executed = [i for i, t in enumerate(tasks) if fmt.executes(setting, t)]
    episodes, imagined, rewards = [None] * len(tasks), [0] * len(tasks), [None] * len(tasks)
    seconds, t0 = {}, time.time()
    with tqdm(total=len(tasks), desc="evaluate", dynamic_ncols=True, leave=False) as bar:   # tasks done
        for mode, index in (("real", executed), ("rehearse", [i for i in range(len(tasks)) if i not in set(executed)])):
            for k in range(0, len(index), cfg["eval_batch_size"]):      # tasks sampled at once
                part = index[k:k + cfg["eval_batch_size"]]
                prompts, worlds, tags = fmt.inputs(setting, [tasks[i] for i in part])
                settings = rollout.sampling(cfg, temperature=cfg["eval_temperature"], tags=tags)
                if mode == "rehearse":             # no executor: the policy plays the world
                    out = fmt.sample(setting, model, tokenizer, prompts, mode, world=worlds, settings=settings,
                                     generator=generator)
                else:
                    plans, used = None, [0] * len(part)
                    if cfg["rehearsal_budget"]:
                        plans, used = rehearse.private_rehearsal_plans(
                            model, tokenizer, prompts, cfg["rehearsal_budget"], cfg["rehearsal_mode"], rehearser,
                            generator=generator, world=worlds, settings=imagining,
                            sample=functools.partial(fmt.sample, setting))   # the layout's sampler
                    out = sample_episodes(model, tokenizer, prompts, mode, world=worlds, settings=settings,
                                          generator=generator, plans=plans)
                    for i, n in zip(part, used):
                        imagined[i] = n
                for i, e in zip(part, out):
                    episodes[i], rewards[i] = e, fmt.reward(setting, e, tasks[i])
                bar.update(len(part))
                bar.set_postfix(success=f"{sum(r for r in rewards if r is not None) / bar.n:.3f}")
    seconds["episodes"], t0 = time.time() - t0, time.time()
    pairs = fmt.would_rehearse(setting, model, tokenizer, [tasks[i] for i in executed], [episodes[i] for i in executed])
    fidelity = fmt.by_kind(setting, pairs, [tasks[i] for i in executed])
    result = {**outcome_record(tasks, episodes, rewards),
              "fidelity": honesty.rates(fidelity), "fidelity_counts": fidelity,
              "executed_tasks": len(executed),
              "rehearsed_tasks": len(tasks) - len(executed),
              "rehearsal_budget": cfg["rehearsal_budget"], "rehearsal_mode": cfg["rehearsal_mode"],
              "imagined_per_task": sum(imagined) / len(tasks),
              "fidelity_by_coverage": fmt.coverage(setting, model, tokenizer, tasks, pairs),
              # grounded by the tool cache of training traffic only: the test calls it holds, fidelity split by it
              **honesty.fidelity_by_cache(pairs, setting.cache,
                                          lambda part: fmt.by_kind(setting, part, [tasks[i] for i in executed]))}
    seconds["would_rehearse"], t0 = time.time() - t0, time.time()
    if cfg["n_collusion"]:
        result.update(fmt.imagined_world(setting, model, tokenizer, tasks[:cfg["n_collusion"]], cfg, generator))
    seconds["imagined_world"], t0 = time.time() - t0, time.time()
    extras = fmt.eval_extras(setting, model, tasks, episodes, rewards)      # the world's own figures, or {}
    if extras:
        result["extras"] = extras
    seconds["extras"] = time.time() - t0
    result["seconds"] = {k: round(v, 2) for k, v in seconds.items()}      # where the evaluation's time went
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
    fid = " ".join(f"{k} {v:.3f}" for k, v in m["fidelity"].items()) or "not measured (no tool called in the real world)"
    cut = f" | cut at max_act_tokens {m['cut_at_act_limit']:.3f}" if m.get("cut_at_act_limit") else ""
    name = "success" if success_name(m) == "real-world success" else success_name(m)
    line = (f"{name} {m['success']:.3f} on {m['n_tasks']} tasks | format errors {m['format_errors']:.3f}{cut} | "
            f"mean calls {m['mean_calls']:.2f} | would-rehearse fidelity: {fid}")
    return line + (f" | {imagined_summary(m)}" if "collusion" in m else "")


def imagined_summary(m):
    c = m["collusion"]
    rate = "-" if c["rate"] is None else f"{c['rate']:.3f}"
    return (f"imagined success {m['imagined_success']:.3f}, collusion {rate} "
            f"({c['colluding']} of {c['wrong']} wrong calls)")


if __name__ == "__main__":    # the command line is scripts/evaluate_cli.py, which imports this module
    runpy.run_module("scripts.evaluate_cli", run_name="__main__")
