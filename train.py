"""Train a policy with world rehearsal (EnvACE): warm start, then RL with no environment.

    python train.py --config small.yaml                      # the CPU demo (minutes)
    python train.py --config small.yaml --env_mode=real      # same budget, real world in the loop
    python train.py --config small.yaml --rl_steps=20        # any config key as --key=value
    python train.py --config small.yaml --resume             # continue out_dir's latest checkpoint
    python train.py --config small.yaml --overwrite          # start over in an out_dir that holds a run
    python train.py --config small.yaml --debug              # a failure's full traceback too
    python train.py --config configs/chat_tiny.yaml --model=PATH  # a chat model on chat JSONL tasks
    torchrun --nproc_per_node=2 train.py --config small.yaml # several processes (GPUs or CPU)

One run, top to bottom (`run`):
  1. Setup (`setup`): processes (machinery/distributed.py), the tasks, the model, and what is chosen
     once: the sampler and the reward (`sampler_and_reward`: rollout.sample_episodes and
     reward.task_reward in the demo), the logprob pass (`chosen_logprobs`).
  2. Warm start (`warm_start`) on logged expert episodes and logged tool traffic, with the RL
     role masks; act AND environment tokens are trained, so the policy starts with a world model.
  3. The gate (this repo's addition; the paper has none): real-world evaluation and rehearsal
     fidelity per tool kind. Rehearsed rewards are only as good as the rehearsals: rehearse/frozen
     RL stops unless every kind reaches `min_fidelity` (0 turns the gate off).
  4. RL, the loop: sample tasks_per_step tasks x group_size episodes in `env_mode`'s world
     (rehearse: the policy plays the world, no real response enters an episode or the loss),
     reward task success, A = R - mean(group) on ACT and REHEARSE tokens (`make_batch`), one
     hand-written clipped policy-gradient update (`rl_step`), log (metrics.jsonl), evaluate every
     eval_every steps, save every save_every steps.
  5. Evaluate the final policy in the real world; print before/after.
Only rank 0 prints, evaluates and saves. Ctrl-C or SIGTERM ends the run at once with one line (what
is saved and the --resume command) and exit status 130; checkpoints are written whole, and
--resume continues exactly from the last one (machinery/faults.py, docs/faults.md).

Simplified against the paper / official code: inline rehearsal by default (one row holds both
roles; `rehearsal_context: separate`, worldmodel/separate.py, gives each rehearsal its own row and prompt);
a toy world with exact-match success instead of a judge (`format: chat`, chat/format.py, runs a real
chat model on JSONL tool tasks); one optimizer step per batch (`ppo_epochs` > 1 makes the clip
bite); by default no dynamic sampling (steps whose groups all have equal rewards are skipped and counted).
"""
import math
import os
from functools import partial
import random
import sys
import time

import numpy as np
import torch
import yaml
from tqdm import tqdm
from transformers.utils import logging as hf_logging

import envace
from envace import (ACT, OBS, REHEARSE, NonFiniteError, clipped_pg_loss, collate, first_target, loss_mask,
                    micro_batches, token_advantages, token_kl_coefs)
from evaluate import summary
from formats import features
from machinery import checkpoint
from machinery import config
from machinery import distributed
from machinery.distributed import all_sum, autocast, in_step, world
from machinery.faults import exit_status, nonfinite
from reporting import metrics
from reward import group_advantages, training_rows
from worldmodel.honesty import fidelity_gate

hf_logging.disable_progress_bar()     # transformers' save/load bars: keep the terminal for ours


# ----------------------------------------------------------------------------- warm start

def warm_start(model, ddp_model, sequences, cfg, pad_id, roles=(ACT, REHEARSE, OBS), logprobs=envace.token_logprobs):
    """Paper, the warm start before RL: teacher-forced cross-entropy on the targets whose role is in
    `roles` (ACT, REHEARSE and the logged responses OBS: the initial world model; separate rows train
    ACT and REHEARSE), token mean over the global batch, AdamW, cosine decay from sft_lr to sft_lr / 10.
    Every rank draws the same global batch (same seed) and trains on its slice of it, in
    length-grouped micro-batches. A sequence may be a group of rows ({"rows": [...]}, separate
    context): drawn as one, so sft_batch_size counts logged episodes in both contexts.
    A step whose loss or gradient norm is not finite is skipped (weights and AdamW state untouched;
    its batch is still drawn, so later steps draw what they would have); three in a row raise
    NonFiniteError. Returns the number of skipped steps."""
    if cfg["sft_steps"] == 0 or not sequences:
        return 0
    rank, world_size = world()
    device = next(model.parameters()).device
    opt = distributed.adamw(model, cfg["sft_lr"], cfg)
    rng = random.Random(cfg["seed"])
    per_rank = cfg["sft_batch_size"] // world_size
    model.train()
    bar = tqdm(range(cfg["sft_steps"]), desc="warm start", dynamic_ncols=True, disable=rank != 0)
    skipped = in_a_row = 0
    for it in bar:
        lr = cfg["sft_lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / cfg["sft_steps"])))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = rng.sample(sequences, min(cfg["sft_batch_size"], len(sequences)))
        batch = [row for s in batch[rank * per_rank:(rank + 1) * per_rank] for row in s.get("rows", [s])]
        ids, batch_roles = collate(batch, pad_id)
        ids, batch_roles = ids.to(device), batch_roles.to(device)
        mask = loss_mask(batch_roles, trained=roles).float()
        n_tokens = all_sum([mask.sum().item()])[0]
        lengths = [len(s["ids"]) for s in batch]
        tools = [s.get("tool", "") for s in batch]          # one tool's rehearse rows share its system turn
        total = 0.0
        opt.zero_grad(set_to_none=True)
        for index, n, weight in in_step(micro_batches(lengths, cfg["micro_batch_tokens"], tools), lengths, ddp_model):
            index = index.to(device)
            with autocast(cfg, device):     # no LM head on the prompt: its targets have no loss
                logp = logprobs(ddp_model, ids[index, :n], start=first_target(mask[index, :n - 1] > 0))
            loss = -(logp * mask[index, :n - 1]).sum() / n_tokens * weight
            (loss * world_size).backward()  # DDP averages over ranks; x world_size makes it the sum
            total += loss.item()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"] or float("inf"))
        if nonfinite(grad_norm, total):     # every rank skips alike
            opt.zero_grad(set_to_none=True)
            skipped, in_a_row = skipped + 1, in_a_row + 1
            if in_a_row >= 3:
                raise NonFiniteError(f"3 non-finite warm-start steps in a row (up to step {it + 1} of "
                                     f"{cfg['sft_steps']}): nothing saved; lower sft_lr or check the data")
            continue
        in_a_row = 0
        opt.step()
        if it % 10 == 0:
            bar.set_postfix(loss=f"{all_sum([total])[0]:.3f}", lr=f"{lr:.1e}")
    opt.zero_grad(set_to_none=True)     # the gradients (4 bytes a parameter) are not held into evaluation
    bar.close()
    model.eval()
    return skipped


# ----------------------------------------------------------------------------- the RL update

def make_batch(episodes, rewards, cfg, pad_id):
    """Episodes (group_size consecutive ones per task) -> tensors for the update: ids [B, L],
    roles [B, L], and over targets [B, L-1] the loss mask (ACT/REHEARSE targets whose coefficient
    is > 0), per-token advantages A = R - mean(group) and the sampler's logprobs. A separate
    layout's rehearse rows come in as rows of their own (reward.training_rows); n_tokens counts
    this process's trained tokens, 0 if none (rl_step sums them over ranks)."""
    tasks = [i // cfg["group_size"] for i in range(len(episodes))]
    rows, row_rewards, groups = training_rows(episodes, rewards, tasks, cfg["advantage_groups"])
    adv, all_equal = group_advantages(row_rewards, groups, cfg["scale_std"])
    ids, roles = collate(rows, pad_id)
    sampled = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i, e in enumerate(rows):               # logprob of token t sits at target position t - 1
        if "logprobs" in e:                    # (hand-made episodes in tests have none)
            sampled[i, :len(e["ids"]) - 1] = torch.tensor(e["logprobs"][1:])
    trained = tuple(r for r, c in ((ACT, cfg["act_coef"]), (REHEARSE, cfg["rehearse_coef"])) if c > 0)
    mask = loss_mask(roles, trained)             # coef 0: no loss at all
    return {"ids": ids, "roles": roles, "mask": mask, "n_tokens": int(mask.sum()),
            "advantages": token_advantages(roles, adv, cfg["act_coef"], cfg["rehearse_coef"]),
            "kl_coefs": token_kl_coefs(roles, cfg["kl_coef"], cfg["kl_rehearse_coef"]) * mask,
            "sampled_logprobs": sampled, "lengths": [len(e["ids"]) for e in rows],
            "tools": [e.get("tool", "") for e in rows],      # micro-batches by tool (micro_batches)
            "all_equal_groups": all_equal, "n_groups": len(set(groups))}


def rl_step(model, ddp_model, opt, batch, cfg, amp, logprobs=envace.token_logprobs, reference=None):
    """Paper, the joint update of both roles: the old (and reference) logprobs, then per PPO epoch
    the clipped loss of every micro-batch, its backward, and one AdamW step. The loss is divided by
    the batch's trained tokens over all micro-batches and ranks, so the accumulated gradient is that
    of one forward over the whole global batch. Returns this rank's stats (sums that add over ranks)
    with "status": "updated", "skipped" (no group on any rank had reward variance: zero advantage,
    zero signal) or "nonfinite" (a loss or gradient not finite: that optimizer step is skipped; an
    earlier epoch's stays applied). Every rank takes the same branch, so collectives stay in step."""
    world_size, device = world()[1], next(model.parameters()).device
    n_tokens, groups_with_signal = all_sum([batch["n_tokens"], batch["n_groups"] - batch["all_equal_groups"]])
    if groups_with_signal == 0:
        return {"status": "skipped"}
    ids, mask, adv, kl_coefs = (batch[k].to(device) for k in ("ids", "mask", "advantages", "kl_coefs"))
    target_roles, lengths = batch["roles"][:, 1:].to(device), batch["lengths"]
    # PPO's old logprobs: the sampler recorded them in fp32 at the sampling temperature from these same
    # weights (a forward's numbers: tests/test_train.py); under bf16 autocast setup has them recomputed
    old = batch["sampled_logprobs"].to(device) if cfg["reuse_sampler_logprobs"] else \
        reference_logprobs(model, batch, cfg, amp)
    ref = None if reference is None else reference_logprobs(reference, batch, cfg, amp)
    # speed: a row with A = 0 and no KL adds exactly 0 to the gradient, so it is left out of the forward
    # (tests/test_train.py::test_rows_with_no_signal_change_nothing holds the update equal with them in)
    rows = [i for i in range(len(lengths)) if adv[i].any() or (ref is not None and kl_coefs[i].any())]
    parts = [[rows[j] for j in b] for b in micro_batches([lengths[i] for i in rows], cfg["micro_batch_tokens"],
                                                          [batch["tools"][i] for i in rows])]
    model.train()
    for _ in range(cfg["ppo_epochs"]):
        opt.zero_grad(set_to_none=True)
        stats = {"status": "updated", "loss": 0.0, "rows_updated": len(rows)}
        for index, n, weight in in_step(parts, lengths, ddp_model):      # DDP: as many on every rank
            index, t = index.to(device), slice(0, n - 1)
            measured = mask[index, t] | (target_roles[index, t] == ACT) | (target_roles[index, t] == REHEARSE)
            with amp:                       # no LM head before the first target trained or measured (entropy)
                new, entropy = logprobs(ddp_model, ids[index, :n], cfg["temperature"], with_entropy=True,
                                        start=first_target(measured))
            # n_tokens: the step's trained tokens over every micro-batch and rank (1 if none), so the
            # accumulated gradient is the token mean over the whole batch, however it is cut
            loss, loss_stats = clipped_pg_loss(new, old[index, t], adv[index, t], mask[index, t], max(n_tokens, 1),
                                               None if ref is None else ref[index, t], cfg["eps_low"],
                                               cfg["eps_high"], cfg["dual_clip"], kl_coefs[index, t])
            (loss * weight * world_size).backward()     # DDP averages ranks; x world_size makes it the sum
            stats["loss"] += loss.item() * weight
            metrics.add_micro_batch(stats, loss_stats, entropy.detach(), new.detach(),
                                    None if ref is None else ref[index, t], target_roles[index, t], mask[index, t],
                                    weight)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"] or float("inf"))
        if nonfinite(grad_norm, stats["loss"]):         # this optimizer step is skipped, on every rank
            stats["status"] = "nonfinite"
            break
        opt.step()
    opt.zero_grad(set_to_none=True)
    model.eval()
    stats["grad_norm"] = float(grad_norm) / world_size    # the same on every rank: sums to it once
    return stats


def reference_logprobs(model, batch, cfg, amp):
    """No-grad fp32 logprobs of the batch's trained targets under `model` (the KL reference, or the
    policy before its update), in micro-batches (sharedprefix.batch_logprobs: the lean pass)."""
    from machinery.sharedprefix import batch_logprobs
    device = next(model.parameters()).device
    with amp, distributed.gathered(model):
        return batch_logprobs(model, batch["ids"].to(device), batch["lengths"], batch["mask"].to(device),
                              cfg["temperature"], cfg["micro_batch_tokens"], share_prefix=cfg["share_prefix"],
                              tools=batch["tools"])


# ----------------------------------------------------------------------------- the run

def main(argv=None):
    """The command line. Exit status (faults.exit_status): 0 done, 1 a failure, 2 a bad config or
    input or the fidelity gate, 130 Ctrl-C or SIGTERM."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        print("usage: python train.py --config small.yaml [--key=value ...] [--resume | --overwrite] [--debug]",
              file=sys.stderr)
        return 2
    return exit_status(lambda: config.load_config(*config.command_line(argv)[:2]),    # (path, --key=value overrides)
                       lambda cfg: run(cfg, "--resume" in argv, "--overwrite" in argv), "--debug" in argv)


def run(cfg, resume=False, overwrite=False):
    """The whole run for a checked config dict: 0 when done, 2 if the fidelity gate stopped it. An
    out_dir that already holds a checkpoint is a ConfigError unless `resume` (continue it: out_dir/ckpt,
    or a finished out_dir/warmstart when no RL checkpoint was saved yet) or `overwrite` (start
    over). NonFiniteError if training cannot give finite weights (three non-finite steps in a row)."""
    # 1. setup: processes, tasks, model, the sampler and reward chosen once; what cannot run stops here
    rank, world_size, device = distributed.setup_distributed(cfg)
    log = print if rank == 0 else (lambda *a, **k: None)
    s = setup(cfg, resume, overwrite, device, world_size, log)
    model, tokenizer, splits, out, t_start = s["model"], s["tokenizer"], s["splits"], cfg["out_dir"], time.time()
    test_eval = partial(metrics.real_world_eval, model, tokenizer, splits["test"], cfg, s["fmt"], s["setting"],
                        s["amp"])
    # the evaluations during RL (eval_every) run on the validation split where there is one (n_val > 0)
    rl_eval = partial(metrics.real_world_eval, model, tokenizer, splits["val"] or splits["test"], cfg, s["fmt"],
                      s["setting"], s["amp"])

    # 2-3. warm start, its evaluation in the real world, the fidelity gate
    before = None           # resumed from an RL checkpoint: its progress holds the warm start's evaluation
    if s["state"] is None:
        before = warm_start_and_evaluate(s, cfg, test_eval, log)
        if not fidelity_gate(before, cfg, log):
            return 2
        if cfg["n_val"]:            # the validation curve's step 0: warmstart/eval_val.json, eval.json's `before`
            before["val_success"] = rl_eval(os.path.join(out, "warmstart", "eval_val.json"))["success"]
            log(f"warm start on the validation split ({len(splits['val'])} tasks): success {before['val_success']:.3f}")
    opt, generator, task_rng, progress, first_step = checkpoint.rl_state(model, tokenizer, cfg, s["state"], before,
                                                                         rank, log)
    kl = cfg["kl_coef"] > 0 or cfg["kl_rehearse_coef"] > 0
    # the frozen warm start: the KL reference, and in frozen mode the world's simulator
    reference = checkpoint.reference_model(model, cfg, device, world_size, os.path.join(out, "warmstart"),
                                           s["state"] is None, kl or cfg["env_mode"] == "frozen")
    sample, reward = s["sampler_and_reward"](task_rng, reference if cfg["env_mode"] == "frozen" else None)
    kl_reference = reference if kl else None
    per_rank = cfg["tasks_per_step"] // world_size
    metrics.start_metrics(out, first_step)

    # 4. RL: no environment in the loop unless env_mode is real
    bar = tqdm(range(first_step, cfg["rl_steps"] + 1), desc=f"RL ({cfg['env_mode']})", dynamic_ncols=True,
               disable=rank != 0)
    for step in bar:
        t0 = time.time()
        # sample: group_size episodes of each of this rank's tasks in env_mode's world (rollout.py)
        tasks = task_rng.sample(splits["rl"], cfg["tasks_per_step"])[rank * per_rank:(rank + 1) * per_rank]
        group = [t for t in tasks for _ in range(cfg["group_size"])]
        episodes = sample(model, prompts=group, generator=generator)
        # reward: task success (reward.py); advantages A = R - mean(group) on ACT and REHEARSE tokens
        rewards = [reward(e, t) for e, t in zip(episodes, group)]
        batch = make_batch(episodes, rewards, cfg, tokenizer.pad_token_id)
        # update: the clipped policy-gradient loss, backward, one optimizer step per PPO epoch
        stats = rl_step(model, s["ddp_model"], opt, batch, cfg, s["amp"], s["logprobs"], kl_reference)
        # log: the step's counters (run state, kept here), every eval_every steps a real-world evaluation
        # (the last step's too on a validation split; without one the final evaluation is this one)
        progress[stats["status"]] += 1
        progress["nonfinite_in_a_row"] = progress["nonfinite_in_a_row"] + 1 if stats["status"] == "nonfinite" else 0
        evaluation = None
        if cfg["eval_every"] and step % cfg["eval_every"] == 0 and (step < cfg["rl_steps"] or cfg["n_val"]):
            evaluation = rl_eval()
            progress["real_success"] = evaluation["success"]
        metrics.log_step(bar, out, step, episodes, rewards, batch, stats, progress, evaluation, time.time() - t0, cfg,
                         s["diagnose"](model, episodes, group) if s["diagnose"] else {})
        if progress["nonfinite_in_a_row"] == 3:
            raise NonFiniteError(f"3 non-finite RL steps in a row (up to step {step}), their optimizer steps skipped: "
                                 f"lower lr or check the data")
        # save: every save_every steps and the last
        if step == cfg["rl_steps"] or (cfg["save_every"] and step % cfg["save_every"] == 0):
            checkpoint.save_step(cfg, model, tokenizer, opt, generator, task_rng, step, progress)

    # 5. evaluate the final policy in the real world (rl_steps 0: it is the warm start, evaluated above);
    # AdamW's moments (8 bytes a parameter) and a reference copy are saved or no longer needed: freed first
    del opt, reference, kl_reference, sample
    record = {"before": progress["before"], "rl_updates": metrics.rl_updates(progress, cfg["rl_steps"])}
    after = (test_eval(os.path.join(out, "eval.json"), **record) if cfg["rl_steps"]
             else metrics.warm_start_result(os.path.join(out, "eval.json"), rank, **record))
    log(metrics.final_report(progress, after, cfg, time.time() - t_start))
    if rank == 0:                   # success, reward and clip_frac over the steps, beside metrics.jsonl
        metrics.draw_curves([out], os.path.join(out, "curve.png"), [cfg["env_mode"]])
    return 0


def setup(cfg, resume, overwrite, device, world_size, log):
    """Step 1, a dict: the tasks ("splits"), the model (new, or the checkpoint to resume: its trainer
    "state"), the format chosen once (features.setup: "fmt", format_plain in the demo, and its
    "setting"), the parallel wrapper ("ddp_model"), the logprob pass, the autocast context, the
    sampler and reward (`sampler_and_reward`, given the task RNG: dynamic sampling draws with it) and
    the step's diagnostics (`diagnose`); config.yaml written. What cannot run stops here with one
    line (a bad data file, a prompt too long, a template that does not fit)."""
    if not resume and not overwrite:
        checkpoint.check_out_dir(cfg["out_dir"])      # finished work is never overwritten silently
    if cfg["threads"]:
        torch.set_num_threads(cfg["threads"])
    splits = features.build_tasks(cfg)                # bad data files stop the run here
    config.check_splits(cfg, splits)
    random.seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    model, tokenizer, state, warm = checkpoint.build_policy(cfg, resume, device, world_size, features.tiny_words)
    features.check_prompt_lengths(cfg, tokenizer, model.config, splits["rl"] + splits["test"])
    fmt, setting = features.setup(cfg, tokenizer, splits, device)
    n_params = sum(p.numel() for p in model.parameters())
    if cfg["model"] != "tiny":                # the demo's 1M-parameter model needs no estimate
        estimate = distributed.memory_estimate(n_params, cfg, model.config, world_size, device=device)
        log(distributed.memory_line(estimate, cfg, world_size, device,
                                    distributed.eval_memory_estimate(estimate, cfg, model.config, device)))
    ddp_model = distributed.parallel_model(model, cfg, device, world_size)
    amp = autocast(cfg, device)
    if isinstance(amp, torch.autocast):       # a cached bf16 decode and a full forward round otherwise
        cfg["reuse_sampler_logprobs"] = False
    config_text = yaml.safe_dump(cfg, sort_keys=False)
    distributed.from_rank0(lambda: checkpoint.write_file(os.path.join(cfg["out_dir"], "config.yaml"), config_text))
    validation = f", {len(splits['val'])} validation" if splits["val"] else ""
    log(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)} | tasks: {len(splits['logged'])} "
        f"logged, {len(splits['rl'])} RL, {len(splits['test'])} test{validation} | device {device} x {world_size} "
        f"process(es), {torch.get_num_threads()} thread(s) each")
    return {"model": model, "ddp_model": ddp_model, "tokenizer": tokenizer, "splits": splits, "fmt": fmt,
            "setting": setting, "state": state, "warm": warm, "amp": amp, "logprobs": chosen_logprobs(cfg),
            "sampler_and_reward": partial(features.sampler_and_reward, fmt, setting, cfg, splits["rl"], amp),
            "diagnose": features.step_diagnostics(fmt, setting, cfg, amp)}


def chosen_logprobs(cfg):
    """The warm start's and the update's logprobs, chosen once at setup: envace.token_logprobs, the
    definition (small.yaml: at the demo's size the lean pass saves no time, docs/speed.md), or with
    `lean_logprobs` sharedprefix.lean_logprobs, the same numbers (tests/test_shared_prefix.py) in less
    memory: the prefix every row of a micro-batch shares runs once (`share_prefix`), the LM head in chunks."""
    if cfg["lean_logprobs"]:
        from machinery.sharedprefix import lean_logprobs
        return partial(lean_logprobs, share_prefix=cfg["share_prefix"])
    return envace.token_logprobs


def warm_start_and_evaluate(s, cfg, test_eval, log):
    """Step 2 and the evaluation that step 3's gate reads: the warm start, saved as out_dir/warmstart,
    and its real-world evaluation, returned. A finished warm start already loaded (--resume, s["warm"])
    is not redone, only evaluated. With no sequences to train on (a chat run with no logged_file
    and no task examples) the warm start is skipped, and its line says so."""
    t0, skipped, fmt, setting, what = time.time(), 0, s["fmt"], s["setting"], "warm start"
    if s["warm"] is None:
        sequences = fmt.warm_start_sequences(setting)
        if cfg["sft_steps"] and not sequences:
            what = ("warm start skipped, nothing to train on: no logged_file and no task has examples "
                    "(give logged_file=FILE, or sft_steps: 0); the model as loaded")
        skipped = warm_start(s["model"], s["ddp_model"], sequences, cfg, s["tokenizer"].pad_token_id,
                             fmt.warm_start_roles(setting), s["logprobs"])
        checkpoint.save_warm_start(s["model"], s["tokenizer"], cfg)
    else:
        log(f"resumed from {s['warm']}: the finished warm start (not redone), its evaluation, the gate, RL from step 1")
    before = test_eval(os.path.join(cfg["out_dir"], "warmstart", "eval.json"))
    log(f"{what} ({time.time() - t0:.0f}s{f', {skipped} non-finite steps skipped' if skipped else ''}): "
        f"{summary(before)}")
    return before


if __name__ == "__main__":
    sys.exit(main())
