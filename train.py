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
  1. Setup: processes (machinery/distributed.py), the tasks, the model, and the features chosen once
     (formats/features.py: the format and the rehearsal layout, as a module of plain functions and its setting).
  2. Warm start (`warm_start`) on logged expert episodes and logged tool traffic, with the RL
     role masks; act AND environment tokens are trained, so the policy starts with a world model.
  3. The gate (this repo's addition; the paper has none): real-world evaluation and rehearsal
     fidelity per tool kind. Rehearsed rewards are only as good as the rehearsals: rehearse/frozen
     RL stops unless every kind reaches `min_fidelity` (0 turns the gate off).
  4. RL: each step samples `tasks_per_step` tasks x `group_size` episodes (rollout.py) in
     `env_mode` rehearse (the policy plays the world: no real response enters an episode or the
     loss), real or frozen; as a diagnostic, a rehearsed step's calls are replayed in the real world
     for its fidelity figures (`replay_fidelity`, off: no environment is called during RL at all);
     rewards task success (reward.py), A = R - mean(group), and makes one hand-written clipped
     policy-gradient update on ACT and REHEARSE tokens (`rl_step`, envace.clipped_pg_loss).
     `max_sample_rounds` > 1 is DAPO's dynamic sampling (`sample_step`): more rounds of tasks until
     tasks_per_step groups with reward variance are found, the update on those only.
  5. Save (save_pretrained) and evaluate in the real world; print before/after.
Only rank 0 prints, evaluates and saves. Ctrl-C or SIGTERM during RL drops the step not yet applied
(at its next micro-batch or sampled token), saves the step before and exits 0 (`--resume` continues
exactly); every other fault is one line and an exit status
(machinery/faults.py; the table of faults tried: docs/faults.md). Each step's figures go to metrics.jsonl.

Simplified against the paper / official code: inline rehearsal by default (one row holds both
roles; `rehearsal_context: separate`, worldmodel/separate.py, gives each rehearsal its own row and prompt);
a toy world with exact-match success instead of a judge (`format: chat`, chat/format.py, runs a real
chat model on JSONL tool tasks); one optimizer step per batch (`ppo_epochs` > 1 makes the clip
bite); by default no dynamic sampling (steps whose groups all have equal rewards are skipped and counted).
"""
import functools
import math
import os
import random
import sys
import time

import numpy as np
import torch
import yaml
from tqdm import tqdm
from transformers.utils import logging as hf_logging

from formats import features
from machinery.checkpoint import (build_policy, check_out_dir, drop_step, leave_evaluation, reference_model, rl_state,
                                  rng_states, save_step, save_warm_start, stop_saved, write_file)
from machinery.config import check_lengths, check_splits, command_line, load_config
from machinery.distributed import (adamw, all_sum, autocast, from_rank0, gathered, memory_estimate,
                         memory_line, parallel_model, release_freed_memory, reuse_sampler_logprobs,
                         setup_distributed, world)
import envace
from envace import (ACT, OBS, PROMPT, REHEARSE, NonFiniteError, clipped_pg_loss, collate, first_target, loss_mask,
                    micro_batches, padded_fraction, token_advantages, token_kl_coefs)
from machinery.sharedprefix import batch_logprobs, lean_logprobs
from evaluate import summary
from machinery import faults
from machinery.faults import (Interrupted, StepAbandoned, StopRequest, WholeStepOrNone, all_ranks_stop_together,
                              check_finite, exit_status, interrupted_line, nonfinite, signalled, stop_if_signalled,
                              unless_signalled, until_signalled)
from worldmodel.honesty import fidelity_gate
from reporting.metrics import (add_micro_batch, append_metrics, episode_sums, eval_during_rl, evaluation_left,
                               final_report, real_world_eval, role_sums, rl_updates, start_metrics, step_record,
                               warm_start_result)
from reward import group_advantages, training_rows, varied_groups

hf_logging.disable_progress_bar()     # transformers' save/load bars: keep the terminal for ours

# The policy's logprobs in the warm start and the update: envace.token_logprobs, the definition;
# setup may bind the lean pass instead (`chosen_logprobs`: the same numbers in less memory).
token_logprobs = envace.token_logprobs


# ----------------------------------------------------------------------------- warm start

def warm_start(model, ddp_model, sequences, cfg, pad_id, roles=(ACT, REHEARSE, OBS)):
    """Paper, the warm start before RL: teacher-forced cross-entropy on the targets whose role is in
    `roles` (ACT, REHEARSE and the logged responses OBS: the initial world model; separate rows train
    ACT and REHEARSE), token mean over the global batch, AdamW, cosine decay from sft_lr to sft_lr / 10.
    Every rank draws the same global batch (same seed) and trains on its slice of it, in
    length-grouped micro-batches. A sequence may be a group of rows ({"rows": [...]}, separate
    context): drawn as one, so sft_batch_size counts logged episodes in both contexts.
    A step whose loss or gradient norm is not finite is skipped (weights and AdamW state untouched;
    its batch is still drawn, so later steps draw what they would have); three in a row raise
    NonFiniteError. A signal on any rank stops every rank before its next micro-batch
    (KeyboardInterrupt, nothing saved). Returns the number of skipped steps."""
    if cfg["sft_steps"] == 0 or not sequences:
        return 0
    rank, world_size = world()
    device = next(model.parameters()).device
    opt = adamw(model, cfg["sft_lr"], cfg)
    rng = random.Random(cfg["seed"])
    per_rank = cfg["sft_batch_size"] // world_size
    model.train()
    bar = tqdm(range(cfg["sft_steps"]), desc="warm start", dynamic_ncols=True, disable=rank != 0)
    skipped = in_a_row = 0
    try:
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
            for index, n, weight in until_signalled(micro_batches(lengths, cfg["micro_batch_tokens"], tools),
                                                    lengths, ddp_model):
                index = index.to(device)
                with autocast(cfg, device):     # no LM head on the prompt: its targets have no loss
                    logprobs = token_logprobs(ddp_model, ids[index, :n], start=first_target(mask[index, :n - 1] > 0))
                loss = -(logprobs * mask[index, :n - 1]).sum() / n_tokens * weight
                (loss * world_size).backward()  # DDP averages over ranks; x world_size makes it the sum
                release_freed_memory()
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
    finally:
        opt.zero_grad(set_to_none=True)     # the gradients (4 bytes a parameter) are not held into evaluation
        bar.close()
        model.eval()
    return skipped


# ----------------------------------------------------------------------------- RL update

def make_batch(episodes, rewards, group_ids, cfg, pad_id):
    """Episodes -> tensors for the update: ids [B, L], roles [B, L], and over targets [B, L-1]
    the loss mask (ACT/REHEARSE targets whose coefficient is > 0), per-token advantages and the
    sampler's logprobs. n_tokens counts this process's trained tokens, 0 if none (rl_step sums them)."""
    adv, all_equal = group_advantages(rewards, group_ids, cfg["scale_std"])
    ids, roles = collate(episodes, pad_id)
    sampled = torch.zeros(ids.shape[0], ids.shape[1] - 1)
    for i, e in enumerate(episodes):           # logprob of token t sits at target position t - 1
        if "logprobs" in e:                    # (hand-made episodes in tests have none)
            sampled[i, :len(e["ids"]) - 1] = torch.tensor(e["logprobs"][1:])
    trained = tuple(r for r, c in ((ACT, cfg["act_coef"]), (REHEARSE, cfg["rehearse_coef"])) if c > 0)
    batch = {"ids": ids, "roles": roles, "mask": loss_mask(roles, trained),  # coef 0: no loss at all
             "advantages": token_advantages(roles, adv, cfg["act_coef"], cfg["rehearse_coef"]),
             "sampled_logprobs": sampled, "lengths": [len(e["ids"]) for e in episodes],
             "tools": [e.get("tool", "") for e in episodes],      # micro-batches by tool (micro_batches)
             "all_equal_groups": all_equal, "n_groups": len(set(group_ids))}
    batch["kl_coefs"] = token_kl_coefs(roles, cfg["kl_coef"], cfg["kl_rehearse_coef"])
    batch["n_tokens"] = int(batch["mask"].sum())     # no clamp here: a rank with none adds 0 to the sum
    return batch


def uses_kl(cfg):
    """Whether the update needs the reference's logprobs (either role's KL coefficient > 0)."""
    return cfg["kl_coef"] > 0 or cfg["kl_rehearse_coef"] > 0


def accumulate_gradients(model, batch, old, ref, cfg):
    """Forward/backward every length-grouped micro-batch. Each loss is already divided by the
    batch's total trained tokens (all micro-batches, all ranks), so the accumulated .grad equals
    that of one forward over the whole global batch, whatever the micro-batching and the number
    of ranks. `model` may be DDP-wrapped. A signal on any rank raises StepAbandoned before the next
    micro-batch. Returns this rank's stats (sums that add over ranks)."""
    device, world_size = old.device, world()[1]
    ids, mask, adv = batch["ids"].to(device), batch["mask"].to(device), batch["advantages"].to(device)
    target_roles = batch["roles"][:, 1:].to(device)
    lengths = batch["lengths"]
    # a row whose advantages are all 0 (an all-equal group) and whose trained tokens carry no KL
    # adds exactly 0 to the gradient: leave it out of the forward (its tokens stay in n_tokens)
    kl_coefs = batch["kl_coefs"].to(device) * mask
    keep = [i for i in range(len(lengths))
            if (ref is not None and kl_coefs[i].any()) or batch["advantages"][i].any()]
    kept_lengths = [lengths[i] for i in keep]
    batches = [[keep[j] for j in b]
               for b in micro_batches(kept_lengths, cfg["micro_batch_tokens"], [batch["tools"][i] for i in keep])]
    totals = {"loss": 0.0, "rows_updated": len(keep),
              "pad_frac": padded_fraction(lengths, batches) / world_size if keep else 0.0}
    for index, n, weight in until_signalled(batches, lengths, model):
        index = index.to(device)
        # no LM head on the prompt: from the first target that is trained or has an entropy stat
        start = first_target(mask[index, :n - 1] | (target_roles[index, :n - 1] == ACT)
                             | (target_roles[index, :n - 1] == REHEARSE))
        with autocast(cfg, device):
            new, entropy = token_logprobs(model, ids[index, :n], cfg["temperature"], with_entropy=True, start=start)
        loss, stats = clipped_pg_loss(new, old[index, :n - 1], adv[index, :n - 1],
                                      mask[index, :n - 1], batch["n_tokens"],
                                      None if ref is None else ref[index, :n - 1],
                                      cfg["eps_low"], cfg["eps_high"], cfg["dual_clip"],
                                      kl_coefs[index, :n - 1])
        (loss * weight * world_size).backward()   # DDP averages ranks; x world_size makes it the sum
        release_freed_memory()
        totals["loss"] += loss.item() * weight
        add_micro_batch(totals, stats, entropy.detach(), new.detach(), None if ref is None else ref[index, :n - 1],
                        target_roles[index, :n - 1], mask[index, :n - 1], weight)
    return totals


def rl_step(model, ddp_model, opt, episodes, rewards, group_ids, cfg, pad_id, reference=None):
    """Paper, the joint update of both roles: one policy update from this rank's episodes.
    The batch (`make_batch`: role masks, advantages), the old (and reference) logprobs, then per
    PPO epoch: gradients of the clipped loss (`accumulate_gradients`), clipped, one AdamW step.
    Returns (sums, status): metric sums that add up over ranks, and "updated", "skipped" (no group
    on any rank had reward variance: zero advantage, zero signal) or "nonfinite" (loss or gradient
    not finite). Around the epochs, faults.WholeStepOrNone applies all or none of them: a non-finite
    epoch, or a signal on any rank before the last epoch's last micro-batch (StepAbandoned, which
    goes on to the loop), leaves weights and optimizer as the step found them. Every rank takes
    the same branch, so collectives stay in step."""
    world_size = world()[1]
    batch = make_batch(episodes, rewards, group_ids, cfg, pad_id)
    n_tokens, groups_with_signal = all_sum([batch["n_tokens"], batch["n_groups"] - batch["all_equal_groups"]])
    batch["n_tokens"] = max(int(n_tokens), 1)             # the global normaliser (1 if no rank trains a token)
    sums = {"all_equal_groups": batch["all_equal_groups"], **role_sums(batch["roles"], batch["advantages"])}
    if groups_with_signal == 0:
        return sums, "skipped"
    device = next(model.parameters()).device
    t0 = time.time()
    ids = batch["ids"].to(device)
    with autocast(cfg, device):
        if reuse_sampler_logprobs(cfg, device):
            old = batch["sampled_logprobs"].to(device)
        else:               # the sampling policy's logprobs recomputed: same weights, fp32 softmax (no-grad,
                            # always the lean pass, whatever lean_logprobs: the same numbers, tested)
            with gathered(model):
                old = batch_logprobs(model, ids, batch["lengths"], batch["mask"].to(device), cfg["temperature"],
                                     cfg["micro_batch_tokens"], share_prefix=cfg["share_prefix"], tools=batch["tools"])
            stop_if_signalled()             # a signal during it: StepAbandoned on every rank
        with gathered(reference):
            ref = None if reference is None else batch_logprobs(
                reference, ids, batch["lengths"], batch["mask"].to(device), cfg["temperature"],
                cfg["micro_batch_tokens"], share_prefix=cfg["share_prefix"], tools=batch["tools"])
    sums["time_logprobs"] = time.time() - t0
    t0 = time.time()
    model.train()
    with WholeStepOrNone(model, opt, cfg["ppo_epochs"]) as step:     # a non-finite epoch or a signal: undone
        for _ in range(cfg["ppo_epochs"]):
            opt.zero_grad(set_to_none=True)
            totals = accumulate_gradients(ddp_model, batch, old, ref, cfg)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"] or float("inf"))
            check_finite(grad_norm, totals["loss"])         # every rank alike: NonFiniteStep
            opt.step()
    status = "nonfinite" if step.nonfinite else "updated"
    sums.update(totals)
    sums["grad_norm"] = float(grad_norm) / world_size    # the same on every rank: sums to it once
    sums["time_update"] = time.time() - t0
    return sums, status


# ----------------------------------------------------------------------------- a step's episodes

def sample_round(fmt, setting, model, tokenizer, tasks, cfg, simulator, generator, amp):
    """This rank's `tasks` x group_size episodes (fmt.rl_sample: env_mode's world) and their rewards:
    (episodes, rewards, each episode's task). A signal during the sampling (the sampler's
    StepAbandoned on this rank) is agreed on by every rank just after: StepAbandoned."""
    episode_tasks = [t for t in tasks for _ in range(cfg["group_size"])]
    prompts, worlds, tags = fmt.inputs(setting, tasks, cfg["group_size"])      # one per episode
    with all_ranks_stop_together(), amp, gathered(model), gathered(simulator):
        episodes = fmt.rl_sample(setting, model, tokenizer, prompts, worlds, tags, simulator, generator)
    rewards = [fmt.reward(setting, e, t) for e, t in zip(episodes, episode_tasks, strict=True)]
    return episodes, rewards, episode_tasks


def first_needed(varied, need, rank=0, world_size=1):
    """Of this rank's groups with reward variance in a round (`varied`, in task order), those among
    the round's first `need` over all ranks, rank 0's first (the order of the global task draw,
    which each rank slices): (this rank's kept groups, how many the round kept over all ranks)."""
    counts = all_sum([len(varied) if r == rank else 0 for r in range(world_size)])   # [len(varied)] alone
    before = int(sum(counts[:rank]))
    return varied[:max(0, min(len(varied), need - before))], min(int(sum(counts)), need)


def sample_step(fmt, setting, model, tokenizer, rl_tasks, task_rng, cfg, simulator, generator, amp):
    """A step's episodes, in rounds: a round draws tasks_per_step tasks from task_rng (every rank the
    same draw, then its slice) and samples group_size episodes of each (a group). Paper: one round,
    every group in the update. max_sample_rounds > 1 (DAPO's dynamic sampling): a group whose rewards
    are all equal has no signal; rounds are drawn until tasks_per_step groups with reward variance
    are kept (the first ones drawn) or max_sample_rounds rounds are. Every rank draws as many rounds
    (first_needed's count is over ranks). Returns (sampled, kept, counts): `sampled`, this rank's
    (episodes, rewards, episode_tasks, task ids) of every round, a task id per group drawn; `kept`,
    the task ids the update uses (one round: all); `counts`, the step's over all ranks."""
    G, want = cfg["group_size"], cfg["tasks_per_step"]
    rank, world_size = world()
    per_rank = want // world_size
    episodes, rewards, episode_tasks, task_ids, kept, n_kept = [], [], [], [], [], 0
    for rounds in range(1, cfg["max_sample_rounds"] + 1):
        tasks = task_rng.sample(rl_tasks, want)[rank * per_rank:(rank + 1) * per_rank]
        got, got_rewards, got_tasks = sample_round(fmt, setting, model, tokenizer, tasks, cfg, simulator, generator,
                                                   amp)
        ids = [len(episodes) // G + i // G for i in range(len(got))]      # a task's G samples
        episodes, rewards, episode_tasks, task_ids = (episodes + got, rewards + got_rewards,
                                                      episode_tasks + got_tasks, task_ids + ids)
        mine, n_round = first_needed(sorted(varied_groups(got_rewards, ids)), want - n_kept, rank, world_size)
        kept, n_kept = kept + mine, n_kept + n_round
        if n_kept == want:
            break
    if cfg["max_sample_rounds"] == 1:     # the paper's step: all-equal groups in the update too (A = 0)
        kept = sorted(set(task_ids))
    counts = {"sample_rounds": rounds, "groups_sampled": rounds * want, "episodes_sampled": rounds * want * G,
              "groups_kept": n_kept}
    return (episodes, rewards, episode_tasks, task_ids), kept, counts


def update_rows(sampled, kept, groups_kept, cfg, pad_id):
    """(rows, row rewards, row group ids) of the update (reward.training_rows) from sample_step's
    `sampled` and `kept`. One round: every row. Dynamic sampling: the rows of the kept tasks whose
    row group varies (a kept task's actor rows always do; under task_role its rehearse rows may
    not: reward.py); no group kept on any rank (`groups_kept` 0): every row, and the step is
    skipped as a one-round step is; none kept here but some on another rank: one idle row (two
    prompt tokens, nothing trained) that keeps this rank's update passes in step with theirs."""
    episodes, rewards, _, task_ids = sampled
    if cfg["max_sample_rounds"] == 1 or groups_kept == 0:
        return training_rows(episodes, rewards, task_ids, cfg["advantage_groups"])
    kept = set(kept)
    chosen = [i for i, t in enumerate(task_ids) if t in kept]
    rows, row_rewards, groups = training_rows([episodes[i] for i in chosen], [rewards[i] for i in chosen],
                                              [task_ids[i] for i in chosen], cfg["advantage_groups"])
    varied = varied_groups(row_rewards, groups)
    keep = [i for i, g in enumerate(groups) if g in varied]
    if not keep:
        return [{"ids": [pad_id, pad_id], "roles": [PROMPT, PROMPT]}], [0.0], [-1]
    return [rows[i] for i in keep], [row_rewards[i] for i in keep], [groups[i] for i in keep]


def all_equal_row_groups(sampled, cfg):
    """How many row groups (group ids of training_rows) of all the step's sampled episodes have no
    reward variance (with one round: the update's all-equal groups)."""
    episodes, rewards, _, task_ids = sampled
    _, row_rewards, groups = training_rows(episodes, rewards, task_ids, cfg["advantage_groups"])
    return len(set(groups)) - len(varied_groups(row_rewards, groups))


def world_extras(fmt, setting, model, sampled, amp):
    """The world's own figures of a step's episodes for its metrics line (fmt.step_extras; a probe
    there may sample, and a signal during it is agreed on by every rank just after: StepAbandoned)."""
    episodes, _, episode_tasks, _ = sampled
    with all_ranks_stop_together(), amp, gathered(model):
        extras = fmt.step_extras(setting, model, episodes, episode_tasks)
    return extras


def step_sums(fmt, setting, sampled, cfg):
    """This rank's metric sums of a step's sampled episodes, every round's (they add up over ranks):
    the row groups with no reward variance, episodes, rewards, calls and tokens (episode_sums), and
    the world's diagnostics when the policy (or the frozen warm start) played it: fidelity, collusion,
    from a replay of its calls in the real world (replay_fidelity; only figures, never the loss)."""
    episodes, rewards, episode_tasks, _ = sampled
    replayed = setting.rehearsed and cfg["replay_fidelity"]        # a diagnostic: nothing of it is trained
    diagnostics = fmt.diagnostics(setting, episodes, episode_tasks) if replayed else {}
    return {"all_equal_groups": all_equal_row_groups(sampled, cfg), **episode_sums(episodes, rewards), **diagnostics}


# ----------------------------------------------------------------------------- the run

def main(argv=None):
    """The command line. Exit status (faults.exit_status): 0 done (or interrupted during RL:
    saved), 1 a failure, 2 a bad config or input or the fidelity gate, 130 interrupted."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        print("usage: python train.py --config small.yaml [--key=value ...] [--resume | --overwrite] [--debug]",
              file=sys.stderr)
        return 2

    def body():
        path, overrides, flags = command_line(argv)
        return run(load_config(path, overrides), flags["--resume"], flags["--overwrite"])
    return exit_status(body, "--debug" in argv)


def run(cfg, resume=False, overwrite=False):
    """The whole run for a checked config dict. Returns 0 when done or interrupted cleanly during
    RL (saved), 1 if non-finite RL steps stopped it, 2 if the fidelity gate stopped it. An out_dir
    that already holds a checkpoint is a ConfigError unless `resume` (continue it: out_dir/ckpt,
    or a finished out_dir/warmstart when no RL checkpoint was saved yet) or `overwrite` (start
    over). NonFiniteError if the warm start cannot give finite weights or the policy's logits are
    not finite while sampling. Ctrl-C or SIGTERM outside the RL loop raises faults.Interrupted,
    whose message says what is saved. The run's position (faults.start_run) starts over here."""
    faults.start_run(resume)
    with StopRequest(immediate=True) as stop:       # outside the RL loop a signal interrupts at once
        try:
            return run_phases(cfg, resume, overwrite, stop)
        except KeyboardInterrupt:
            raise Interrupted(interrupted_line(cfg)) from None


def run_phases(cfg, resume, overwrite, stop):
    """run's body, phase by phase (`stop`: the run's StopRequest; faults.now and faults.saved keep
    the run's position, which the fault lines read, up to date)."""
    # 1. setup: processes, tasks, model, the features chosen once; what cannot run stops here
    rank, world_size, device = setup_distributed(cfg)
    log = print if rank == 0 else (lambda *a, **k: None)
    model, ddp_model, tokenizer, splits, fmt, setting, state, warm = setup(cfg, resume, overwrite, device,
                                                                           world_size, log)
    out, t_start, amp, pad_id = cfg["out_dir"], time.time(), autocast(cfg, device), tokenizer.pad_token_id

    # 2-3. warm start, evaluation in the real world (rank0_eval(path, **extra): eval.json), the fidelity gate
    rank0_eval = functools.partial(real_world_eval, model, tokenizer, splits["test"], cfg, fmt, setting, amp, stop=stop)
    # the evaluations during RL (eval_every) run on the validation split where there is one (n_val > 0)
    eval_in_rl = functools.partial(real_world_eval, model, tokenizer, splits["val"] or splits["test"], cfg, fmt, setting,
                                   amp, stop=stop)
    before = None               # resumed from an RL checkpoint: its progress holds the warm start's evaluation
    if state is None:
        before = warm_start_and_evaluate(model, ddp_model, tokenizer, fmt, setting, cfg, rank0_eval, log, stop, warm)
        if not fidelity_gate(before, cfg, log):
            return 2
        if cfg["n_val"]:            # the validation curve's step 0: warmstart/eval_val.json, eval.json's `before`
            before["val_success"] = eval_in_rl(os.path.join(out, "warmstart", "eval_val.json"))["success"]
            log(f"warm start on the validation split ({len(splits['val'])} tasks): success {before['val_success']:.3f}")
        faults.now("the step-0 checkpoint")
    reference = reference_model(model, cfg, device, world_size, os.path.join(out, "warmstart"), state is None,
                                uses_kl(cfg) or cfg["env_mode"] == "frozen")     # the frozen warm start
    simulator, kl_reference = (reference if cfg["env_mode"] == "frozen" else None), (reference if uses_kl(cfg) else None)
    opt, generator, task_rng, progress, first_step = rl_state(model, tokenizer, cfg, state, before, rank, log)
    save = functools.partial(save_step, cfg, model, tokenizer, opt, generator, task_rng)    # save(step, progress)
    metrics_path = start_metrics(out, first_step, rank)

    # 4. RL: no environment in the loop unless env_mode is real
    if "eval_left" in progress and evaluation_left(progress, eval_in_rl, metrics_path, cfg, first_step - 1, log):
        return 1
    bar = tqdm(range(first_step, cfg["rl_steps"] + 1), desc=f"RL ({cfg['env_mode']})",
               dynamic_ncols=True, disable=rank != 0)
    with StopRequest(exception=StepAbandoned) as rl_stop:     # a signal drops the step (rank0_eval's `stop`: the run's)
        for step in bar:
            faults.now(f"RL step {step}")
            t0, start = time.time(), (rng_states(generator), task_rng.getstate())   # what a dropped step goes back to
            try:
                # sample: groups of episodes in env_mode's world (rollout.py), each with its task reward (reward.py)
                sampled, kept, counts = sample_step(fmt, setting, model, tokenizer, splits["rl"], task_rng, cfg,
                                                    simulator, generator, amp)
                extras = world_extras(fmt, setting, model, sampled, amp)
                time_sample = time.time() - t0
                # update: the rows and their groups, A = R - mean(group), the clipped loss on ACT and REHEARSE
                rows, row_rewards, row_groups = update_rows(sampled, kept, counts["groups_kept"], cfg, pad_id)
                sums, status = rl_step(model, ddp_model, opt, rows, row_rewards, row_groups, cfg, pad_id,
                                       kl_reference)
            except StepAbandoned:       # a signal before the update was applied: the step is dropped
                return drop_step(save, step, start, generator, task_rng, progress, cfg, log)
            # log: the step's line in metrics.jsonl, every eval_every steps a real-world evaluation
            sums.update(step_sums(fmt, setting, sampled, cfg))
            record = {**step_record(step, status, progress, sums, time_sample, time.time() - t0), **counts, **extras}
            # (the last step's too on a validation split; without one the final evaluation is this one)
            if cfg["eval_every"] and step % cfg["eval_every"] == 0 and (step < cfg["rl_steps"] or cfg["n_val"]):
                result = unless_signalled(eval_in_rl, rl_stop)
                if result is None:      # a signal: the step is saved, its evaluation and metrics line left to --resume
                    return leave_evaluation(save, step, record, progress, cfg, log)
                bar.write(eval_during_rl(result, record, progress, cfg, step))
            append_metrics(metrics_path, record)       # refused: all stop
            bar.set_postfix(reward=f"{record['reward']:.3f}", eval=f"{progress['real_success']:.3f}",
                            skip=progress["skipped_steps"], tok_s=f"{record['tok_per_s']:.0f}")
            # save: every save_every steps and the last; a signal or 3 non-finite steps in a row stop here, saved
            stopping, failing = signalled(rl_stop), progress["nonfinite_in_a_row"] >= 3   # any rank: all stop
            if stopping or failing:
                return stop_saved(save, step, progress, failing, cfg, log)
            if step == cfg["rl_steps"] or (cfg["save_every"] and step % cfg["save_every"] == 0):
                save(step, progress)

    # 5. evaluate the final policy in the real world (rl_steps 0: it is the warm start, evaluated above);
    # AdamW's moments (8 bytes a parameter) and a reference copy are saved or no longer needed: freed first
    del opt, save, reference, simulator, kl_reference
    faults.now("final evaluation")
    record = {"before": progress["before"], "rl_updates": rl_updates(progress, cfg["rl_steps"])}
    after = (rank0_eval(os.path.join(out, "eval.json"), **record) if cfg["rl_steps"]
             else warm_start_result(os.path.join(out, "eval.json"), rank, **record))
    log(final_report(progress, after, cfg, time.time() - t_start))
    return 0


def setup(cfg, resume, overwrite, device, world_size, log):
    """Step 1: the tasks, the model (new, or the checkpoint to resume), the format chosen once (features.setup:
    its module, format_plain in the demo, and its setting), the parallel wrapper; config.yaml written. What
    cannot run stops here with one line (a bad data file, a prompt too long, a template that does not fit).
    What the model was loaded from is noted as saved (faults.saved)."""
    if not resume and not overwrite:
        check_out_dir(cfg["out_dir"])                 # finished work is never overwritten silently
    splits = features.build_tasks(cfg)                # bad data files stop the run here
    check_splits(cfg, splits)
    random.seed(cfg["seed"])
    np.random.seed(cfg["seed"])
    torch.manual_seed(cfg["seed"])
    model, tokenizer, state, warm = build_policy(cfg, resume, device, world_size, features.tiny_words)
    if state is not None:
        faults.saved("ckpt", state["step"])
    elif warm is not None:
        faults.saved("warmstart")
    check_lengths(cfg, tokenizer, model.config, splits["rl"] + splits["test"])
    fmt, setting = features.setup(cfg, tokenizer, splits, device)
    global token_logprobs
    token_logprobs = chosen_logprobs(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if cfg["model"] != "tiny":                # the demo's 1M-parameter model needs no estimate
        log(memory_line(memory_estimate(n_params, cfg, model.config, world_size), cfg, world_size))
    ddp_model = parallel_model(model, cfg, device, world_size)
    config_text = yaml.safe_dump(cfg, sort_keys=False)
    from_rank0(lambda: write_file(os.path.join(cfg["out_dir"], "config.yaml"), config_text))  # unwritable: one line
    validation = f", {len(splits['val'])} validation" if splits["val"] else ""
    log(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)} | tasks: {len(splits['logged'])} "
        f"logged, {len(splits['rl'])} RL, {len(splits['test'])} test{validation} | device {device} x {world_size} "
        f"process(es)")
    return model, ddp_model, tokenizer, splits, fmt, setting, state, warm


def chosen_logprobs(cfg):
    """The warm start's and the update's logprobs, chosen once at setup: envace.token_logprobs, the
    definition (small.yaml: at the demo's size the lean pass saves no time, docs/speed.md), or with
    `lean_logprobs` sharedprefix.lean_logprobs, the same numbers (tests/test_shared_prefix.py) in less
    memory: the prefix every row of a micro-batch shares runs once (`share_prefix`), the LM head in chunks."""
    if cfg["lean_logprobs"]:
        return functools.partial(lean_logprobs, share_prefix=cfg["share_prefix"])
    return envace.token_logprobs


def warm_start_and_evaluate(model, ddp_model, tokenizer, fmt, setting, cfg, rank0_eval, log, stop, warm=None):
    """Step 2 and the evaluation that step 3's gate reads: the warm start, saved as out_dir/warmstart,
    and its real-world evaluation, returned. `stop` (the run's StopRequest): a signal during the warm
    start stops it before its next micro-batch, one during the evaluation at once. `warm`: a finished
    warm start already loaded (--resume): not redone, only evaluated."""
    t0, skipped = time.time(), 0
    if warm is None:
        faults.now("warm start")
        stop.immediate = False        # every rank stops at one micro-batch
        skipped = warm_start(model, ddp_model, fmt.warm_start_sequences(setting), cfg, tokenizer.pad_token_id,
                             fmt.warm_start_roles(setting))
        save_warm_start(model, tokenizer, cfg)
        faults.saved("warmstart")
        stop.immediate = True
        if signalled(stop):                # signalled during the last step or the save
            raise KeyboardInterrupt
    else:
        log(f"resumed from {warm}: the finished warm start (not redone), its evaluation, the gate, RL from step 1")
    faults.now("evaluation")
    before = rank0_eval(os.path.join(cfg["out_dir"], "warmstart", "eval.json"))
    log(f"warm start ({time.time() - t0:.0f}s{f', {skipped} non-finite steps skipped' if skipped else ''}): "
        f"{summary(before)}")
    return before


if __name__ == "__main__":
    sys.exit(main())
