"""What an RL step logs (out_dir/metrics.jsonl): sums that add up over micro-batches and ranks.

Diagnostics only: nothing here feeds the loss. Each step's line holds its reward (= success in the
world it was sampled in), how episodes ended, tokens and mean advantage per role, the update's
stats (loss, clip fractions, entropy and KL to the reference per role, gradient norm, padding),
rehearsal fidelity and collusion against a real replay, and its timings. Also the run's
evaluations in the real world (`real_world_eval`: eval.json) and the lines that report them.
"""
import json
import os

import torch

from worldmodel import honesty
from machinery.checkpoint import write_file
from machinery.distributed import add_up, all_gather, from_rank0, gathered
from envace import ACT, OBS, REHEARSE, ROLE_NAMES
from evaluate import evaluate, success_name, summary
from machinery import faults
from reward import cause_counts


def role_sums(roles, advantages):
    """Trained-target counts and advantage sums per role of a batch ([B, L] roles, [B, L-1] A)."""
    sums = {}
    for r in (ACT, REHEARSE, OBS):
        sel = roles[:, 1:] == r
        sums[f"tokens_{ROLE_NAMES[r]}"] = int(sel.sum())
        sums[f"adv_sum_{ROLE_NAMES[r]}"] = float(advantages[sel].sum())
    return sums


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


def episode_sums(episodes, rewards):
    """This rank's episode-level metric sums (they add up over ranks)."""
    return {"n_episodes": len(episodes), "reward_sum": sum(rewards),
            "calls_sum": sum(len(e["calls"]) for e in episodes),
            "n_tok": sum(len(r["ids"]) for e in episodes for r in [e] + e.get("rehearsals", [])),
            "rehearse_rows": sum(len(e.get("rehearsals", [])) for e in episodes),
            "causes": cause_counts(episodes)}


def metrics_record(step, s, status, counters, times):
    """One metrics.jsonl line from the summed-over-ranks metric sums."""
    n = s["n_episodes"]
    record = {"step": step, "status": status, "reward": s["reward_sum"] / n,
              "success": s["reward_sum"] / n, "mean_calls": s["calls_sum"] / n,
              "causes": s["causes"], "all_equal_groups": s["all_equal_groups"],
              "rehearse_rows": s.get("rehearse_rows", 0), **counters}
    for name in ("act", "rehearse", "obs"):
        record[f"tokens_{name}"] = s[f"tokens_{name}"]
        record[f"adv_{name}"] = s[f"adv_sum_{name}"] / max(s[f"tokens_{name}"], 1)
    for k in ("loss", "clip_frac", "dual_clip_frac", "approx_kl", "kl_ref", "grad_norm", "pad_frac"):
        if k in s:
            record[k] = s[k]
    for name in ("act", "rehearse"):      # over the rows that got a gradient
        if f"entropy_{name}" in s:
            record[f"entropy_{name}"] = s[f"entropy_{name}"] / max(s[f"entropy_count_{name}"], 1)
    if "rows_updated" in s:
        record["rows_updated"] = s["rows_updated"]
    if "fidelity" in s:
        record["fidelity"] = honesty.rates(s["fidelity"])
        record["fidelity_counts"] = s["fidelity"]
    if "collusion" in s:
        record["collusion"] = honesty.collusion_rate(s["collusion"])
    for name in ("act", "rehearse"):      # k3 KL to the reference per role, over trained targets
        if s.get(f"kl_count_{name}"):
            record[f"kl_ref_{name}"] = s[f"kl_sum_{name}"] / s[f"kl_count_{name}"]
    record.update(times)
    record["tok_per_s"] = s["n_tok"] / times["time_step"]
    return record


def start_metrics(out, first_step, rank):
    """out_dir/metrics.jsonl, keeping the lines of the steps a resumed checkpoint has."""
    path = os.path.join(out, "metrics.jsonl")
    def write():                                   # rank 0 alone; a refused write stops every rank
        kept = [line for line in open(path) if json.loads(line)["step"] < first_step] \
            if first_step > 1 and os.path.exists(path) else []
        write_file(path, "".join(kept))
    from_rank0(write)
    return path


def append_metrics(path, record):
    """A step's line at the end of metrics.jsonl (rank 0 writes it; a refused write stops every rank)."""
    from_rank0(lambda: write_file(path, json.dumps(record) + "\n", mode="a"))


def step_record(step, status, progress, sums, time_sample, time_step):
    """The step's metrics.jsonl line from this rank's sums (added up over ranks), and the run's
    counters of skipped and non-finite steps (three non-finite steps in a row stop the run)."""
    for key, hit in (("skipped_steps", status == "skipped"), ("nonfinite_steps", status == "nonfinite")):
        progress[key] += hit
    progress["nonfinite_in_a_row"] = (progress["nonfinite_in_a_row"] + 1) * (status == "nonfinite")
    times = {"time_sample": time_sample, "time_logprobs": sums.get("time_logprobs", 0.0),
             "time_update": sums.get("time_update", 0.0), "time_step": time_step}
    counters = {k: progress[k] for k in ("skipped_steps", "nonfinite_steps")}
    return metrics_record(step, add_up(all_gather(sums)), status, counters, times)


def eval_during_rl(result, record, progress, cfg, step):
    """An evaluation every eval_every steps: into the step's record (`eval_success`, or `val_success`
    and `val_task_rewards` on the validation split, n_val > 0) and the progress counters; its line."""
    validation = cfg.get("n_val", 0) > 0
    progress["real_success"] = record["val_success" if validation else "eval_success"] = result["success"]
    if validation:              # per validation task, in order: the paired interval against step 0's
        record["val_task_rewards"] = result["task_rewards"]       # (python -m scripts.compare --validation)
    record.update({"eval_extras": result["extras"]} if result.get("extras") else {})
    # what the clip did this step: with ppo_epochs 1 the ratio is 1 on every token and it never acts
    clipped = f", clip_frac {record['clip_frac']:.3f}" if "clip_frac" in record else ""
    name = f"validation ({result['n_tasks']} tasks): {success_name(result)}" if validation else success_name(result)
    return (f"step {step}: {name} {progress['real_success']:.3f} (reward in the "
            f"{cfg['env_mode']} world this step {record['reward']:.3f}{clipped})")


def evaluation_left(progress, rank0_eval, metrics_path, cfg, step, log):
    """--resume after a signal stopped the evaluation after RL step `step` (checkpoint.leave_evaluation):
    that evaluation and the step's metrics line (progress's "eval_left", taken out) come first.
    Returns whether the run stops there: the step was its third non-finite one in a row (its line)."""
    record = progress.pop("eval_left")
    faults.now(f"the evaluation after RL step {step}")
    log(eval_during_rl(rank0_eval(), record, progress, cfg, step))
    append_metrics(metrics_path, record)
    if progress["nonfinite_in_a_row"] >= 3:
        log(faults.rl_stop_line(cfg, step, True))
        return True
    return False


def rl_updates(progress, steps):
    """How the run's `steps` RL steps went (eval.json's "rl_updates", the final line): updated,
    skipped (no group with reward variance), non-finite, and the share that updated."""
    skipped, nonfinite = progress["skipped_steps"], progress["nonfinite_steps"]
    return {"steps": steps, "updated": steps - skipped - nonfinite, "skipped": skipped, "nonfinite": nonfinite,
            "updated_share": (steps - skipped - nonfinite) / steps if steps else None}


def final_report(progress, after, cfg, seconds):
    before, rl = progress["before"], rl_updates(progress, cfg["rl_steps"])
    share = f" ({rl['updated_share']:.0%})" if rl["steps"] else ""
    return (f"before RL: {summary(before)}\nafter RL:  {summary(after)}\n"
            f"{success_name(after)} {before['success']:.3f} -> {after['success']:.3f} ({cfg['env_mode']} "
            f"mode, {rl['steps']} steps: {rl['updated']} updated{share}, {rl['skipped']} skipped, "
            f"{rl['nonfinite']} non-finite, {seconds:.0f}s); saved to {cfg['out_dir']}/ckpt")


def warm_start_result(path, rank, **extra):
    """The final evaluation of a run with no RL step (rl_steps 0, a warm start only): the policy is
    the warm start, whose evaluation (extra["before"]) is the result; written to `path` with
    `extra` on rank 0 as real_world_eval writes it, not run again on the same weights."""
    if rank == 0:
        write_file(path, json.dumps({**extra["before"], **extra}, indent=1))
    return extra["before"]


def real_world_eval(model, tokenizer, tasks, cfg, fmt, setting, amp, path=None, stop=None, **extra):
    """evaluate.evaluate on rank 0 (FSDP: every rank gathers the weights first), written to
    `path` with `extra`; the result on every rank. A failure or a signal there stops every rank
    (faults.rank0_interruptible, with the run's `stop` outside the RL loop)."""
    def on_rank0():
        with amp:
            result = evaluate(model, tokenizer, tasks, cfg, fmt, setting, seed=cfg["seed"])
        if path:
            write_file(path, json.dumps({**result, **extra}, indent=1))    # a full disk: one line
        return result
    with gathered(model):
        return faults.rank0_interruptible(on_rank0, stop)
