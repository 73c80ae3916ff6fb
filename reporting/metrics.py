"""What an RL step logs (out_dir/metrics.jsonl): sums that add up over micro-batches and ranks.

Diagnostics only: nothing here feeds the loss. Each step's line holds its reward (= success in the
world it was sampled in), how episodes ended, tokens and mean advantage per role, the update's
stats (loss, clip fractions, entropy and KL to the reference per role, gradient norm), with
replay_fidelity rehearsal fidelity and collusion against a real replay, and its time and tokens per
second. Also the run's evaluations in the real world (`real_world_eval`: eval.json), the lines that
report them, and the run's curve (`draw_curves`: out_dir/curve.png).
"""
import json
import os

import torch

from worldmodel import honesty
from machinery.checkpoint import CheckpointError, write_file
from machinery.distributed import from_rank0, gathered, summed_over_ranks, world
from envace import ACT, OBS, REHEARSE, ROLE_NAMES
from evaluate import evaluate, success_name, summary
from reward import cause_counts


def add_micro_batch(totals, stats, entropy, new, ref, target_roles, mask, weight):
    """Add one micro-batch's loss stats, its entropy per role (over every ACT/REHEARSE target)
    and the k3 KL to the reference per role over trained targets, into `totals` (weight 0: a
    rank's padding pass, counted as nothing)."""
    for k, v in stats.items():
        totals[k] = totals.get(k, 0.0) + v * weight
    kl = None
    if ref is not None:
        d = ref - new
        kl = torch.exp(d) - d - 1
    for r in (ACT, REHEARSE):
        name, sel = ROLE_NAMES[r], target_roles == r
        totals[f"entropy_{name}"] = totals.get(f"entropy_{name}", 0.0) + float((entropy * sel).sum()) * weight
        totals[f"entropy_count_{name}"] = totals.get(f"entropy_count_{name}", 0) + int(sel.sum()) * weight
        if kl is not None:
            trained = sel & mask
            totals[f"kl_sum_{name}"] = totals.get(f"kl_sum_{name}", 0.0) + float((kl * trained).sum()) * weight
            totals[f"kl_count_{name}"] = totals.get(f"kl_count_{name}", 0) + int(trained.sum()) * weight


def step_sums(episodes, rewards, batch):
    """This rank's episode-level metric sums (they add up over ranks), and per role of the batch
    ([B, L] roles, [B, L-1] A) its trained-target counts and advantage sums."""
    sums = {"n_episodes": len(episodes), "reward_sum": sum(rewards),
            "calls_sum": sum(len(e["calls"]) for e in episodes),
            "n_tok": sum(len(r["ids"]) for e in episodes for r in [e] + e.get("rehearsals", [])),
            "rehearse_rows": sum(len(e.get("rehearsals", [])) for e in episodes), "causes": cause_counts(episodes),
            "all_equal_groups": batch["all_equal_groups"]}
    for r in (ACT, REHEARSE, OBS):
        sel = batch["roles"][:, 1:] == r
        sums[f"tokens_{ROLE_NAMES[r]}"] = int(sel.sum())
        sums[f"adv_sum_{ROLE_NAMES[r]}"] = float(batch["advantages"][sel].sum())
    return sums


def metrics_record(step, s, progress, seconds):
    """One metrics.jsonl line from the summed-over-ranks metric sums `s`, the run's counters."""
    n = s["n_episodes"]
    record = {"step": step, "status": s["status"], "reward": s["reward_sum"] / n,
              "success": s["reward_sum"] / n, "mean_calls": s["calls_sum"] / n,
              "causes": s["causes"], "all_equal_groups": s["all_equal_groups"],
              "rehearse_rows": s.get("rehearse_rows", 0), "skipped_steps": progress["skipped"],
              "nonfinite_steps": progress["nonfinite"]}
    for name in ("act", "rehearse", "obs"):
        record[f"tokens_{name}"] = s[f"tokens_{name}"]
        record[f"adv_{name}"] = s[f"adv_sum_{name}"] / max(s[f"tokens_{name}"], 1)
    for k in ("loss", "clip_frac", "dual_clip_frac", "approx_kl", "kl_ref", "grad_norm", "rows_updated"):
        if k in s:
            record[k] = s[k]
    for name in ("act", "rehearse"):      # over the rows that got a gradient
        if f"entropy_{name}" in s:
            record[f"entropy_{name}"] = s[f"entropy_{name}"] / max(s[f"entropy_count_{name}"], 1)
        if s.get(f"kl_count_{name}"):     # k3 KL to the reference per role, over trained targets
            record[f"kl_ref_{name}"] = s[f"kl_sum_{name}"] / s[f"kl_count_{name}"]
    if "fidelity" in s:
        record["fidelity"] = honesty.rates(s["fidelity"])
        record["fidelity_counts"] = s["fidelity"]
    if "collusion" in s:
        record["collusion"] = honesty.collusion_rate(s["collusion"])
    record.update(time_step=seconds, tok_per_s=s["n_tok"] / seconds)
    return record


def start_metrics(out, first_step):
    """out_dir/metrics.jsonl (rank 0), keeping the lines of the steps a resumed checkpoint has."""
    path = os.path.join(out, "metrics.jsonl")
    if world()[0] == 0:
        kept = [line for line in open(path) if json.loads(line)["step"] < first_step] \
            if first_step > 1 and os.path.exists(path) else []
        write_file(path, "".join(kept))


def log_step(bar, out, step, episodes, rewards, batch, stats, progress, evaluation, seconds, cfg, diagnostics):
    """An RL step's one logging call: its line in out_dir/metrics.jsonl (the sums of every rank added
    up; rank 0 appends it), the evaluation's line when one ran this step (eval_every), and the live
    figures of the progress bar. `diagnostics`: {"replay": sums added up with the rest, "world": a
    world's own figures} (train.py's `diagnose`), or {}."""
    sums = {**{k: v for k, v in stats.items() if k != "status"}, **step_sums(episodes, rewards, batch),
            **diagnostics.get("replay", {})}
    record = metrics_record(step, {**summed_over_ranks(sums), "status": stats["status"]}, progress, seconds)
    record.update({**episodes[0].get("sampling", {}), **diagnostics.get("world", {})})   # dynamic sampling's counts
    if world()[0] == 0:                  # rank 0 alone prints and writes
        if evaluation is not None:
            bar.write(evaluation_line(evaluation, record, cfg, step))
        try:                             # (metrics.jsonl is whole at start: start_metrics; a full disk since)
            with open(os.path.join(out, "metrics.jsonl"), "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError as e:
            raise CheckpointError(f"cannot write {os.path.join(out, 'metrics.jsonl')}: {e.strerror or e}") from None
    bar.set_postfix(reward=f"{record['reward']:.3f}", eval=f"{progress['real_success']:.3f}",
                    skip=progress["skipped"], tok_s=f"{record['tok_per_s']:.0f}")
    return record


def evaluation_line(result, record, cfg, step):
    """An evaluation every eval_every steps: into the step's record (`eval_success`, or `val_success`
    and `val_task_rewards` on the validation split, n_val > 0); its line."""
    validation = cfg.get("n_val", 0) > 0
    record["val_success" if validation else "eval_success"] = result["success"]
    if validation:              # per validation task, in order: the paired interval against step 0's
        record["val_task_rewards"] = result["task_rewards"]       # (python -m scripts.compare --validation)
    record.update({"eval_extras": result["extras"]} if result.get("extras") else {})
    # what the clip did this step: with ppo_epochs 1 the ratio is 1 on every token and it never acts
    clipped = f", clip_frac {record['clip_frac']:.3f}" if "clip_frac" in record else ""
    name = f"validation ({result['n_tasks']} tasks): {success_name(result)}" if validation else success_name(result)
    return (f"step {step}: {name} {result['success']:.3f} (reward in the "
            f"{cfg['env_mode']} world this step {record['reward']:.3f}{clipped})")


def rl_updates(progress, steps):
    """How the run's `steps` RL steps went (eval.json's "rl_updates", the final line): updated,
    skipped (no group with reward variance), non-finite, and the share that updated."""
    return {"steps": steps, "updated": progress["updated"], "skipped": progress["skipped"],
            "nonfinite": progress["nonfinite"], "updated_share": progress["updated"] / steps if steps else None}


def final_report(progress, after, cfg, seconds):
    """The run's last lines: before and after RL, and how its steps went."""
    before, steps = progress["before"], cfg["rl_steps"]
    share = f" ({progress['updated'] / steps:.0%})" if steps else ""
    return (f"before RL: {summary(before)}\nafter RL:  {summary(after)}\n"
            f"{success_name(after)} {before['success']:.3f} -> {after['success']:.3f} ({cfg['env_mode']} "
            f"mode, {steps} steps: {progress['updated']} updated{share}, {progress['skipped']} skipped, "
            f"{progress['nonfinite']} non-finite, {seconds:.0f}s); saved to {cfg['out_dir']}/ckpt")


def warm_start_result(path, rank, **extra):
    """The final evaluation of a run with no RL step (rl_steps 0, a warm start only): the policy is
    the warm start, whose evaluation (extra["before"]) is the result; written to `path` with
    `extra` on rank 0 as real_world_eval writes it, not run again on the same weights."""
    if rank == 0:
        write_file(path, json.dumps({**extra["before"], **extra}, indent=1))
    return extra["before"]


def real_world_eval(model, tokenizer, tasks, cfg, fmt, setting, amp, path=None, **extra):
    """evaluate.evaluate on rank 0 (FSDP: every rank gathers the weights first), written to
    `path` with `extra`; the result on every rank. A failure there stops every rank (from_rank0)."""
    def on_rank0():
        with amp:
            result = evaluate(model, tokenizer, tasks, cfg, fmt, setting, seed=cfg["seed"])
        if path:
            write_file(path, json.dumps({**result, **extra}, indent=1))    # a full disk: one line
        return result
    with gathered(model):
        return from_rank0(on_rank0)


def curve_points(run):
    """What a run folder of train.py shows over RL steps: {"steps", "reward" (the step's reward in the
    world it trained in), "clip_frac" (None where a step made no update), "success": [(step,
    real-world success)] on the test split (eval.json's before at step 0, the evaluations every
    eval_every steps, the final one at the last step), "validation": the same on the validation
    split (n_val > 0)}."""
    lines = [json.loads(line) for line in open(os.path.join(run, "metrics.jsonl"))]
    result = json.load(open(os.path.join(run, "eval.json"))) if os.path.isfile(os.path.join(run, "eval.json")) else {}
    before, last = result.get("before", {}), lines[-1]["step"] if lines else 0
    success = ([(0, before["success"])] if "success" in before else []) + \
        [(m["step"], m["eval_success"]) for m in lines if "eval_success" in m] + \
        ([(last, result["success"])] if "success" in result else [])
    validation = ([(0, before["val_success"])] if "val_success" in before else []) + \
        [(m["step"], m["val_success"]) for m in lines if "val_success" in m]
    return {"steps": [m["step"] for m in lines], "reward": [m["reward"] for m in lines],
            "clip_frac": [m.get("clip_frac") for m in lines], "success": success, "validation": validation}


def draw_curves(runs, path, names=None):
    """One figure of train.py runs (`runs`: their folders; `names`: their labels): above, real-world
    success at each evaluation (dots; validation split dashed) and each step's reward in the world it
    trained in (a thin line); below, clip_frac, the share of trained tokens the PPO clip acted on (0
    with ppo_epochs 1, where the ratio is 1 on every token). Written to `path` (a PNG)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5), sharex=True, height_ratios=(3, 1))
    for i, run in enumerate(runs):
        p, name, color = curve_points(run), (names or runs)[i], f"C{i}"
        top.plot(p["steps"], p["reward"], color=color, lw=0.7, alpha=0.5, label=f"{name}: reward in its RL world")
        if p["success"]:
            top.plot(*zip(*p["success"]), color=color, marker="o", ms=4, label=f"{name}: real-world success (test)")
        if p["validation"]:
            top.plot(*zip(*p["validation"]), color=color, marker="s", ms=3, ls="--",
                     label=f"{name}: real-world success (validation)")
        clipped = [(s, c) for s, c in zip(p["steps"], p["clip_frac"]) if c is not None]
        if clipped:
            bottom.plot(*zip(*clipped), color=color, lw=0.8)
    top.set(ylabel="success / reward", ylim=(0, 1.02))
    top.legend(fontsize=7, loc="lower right")
    bottom.set(xlabel="RL step", ylabel="clip_frac")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
