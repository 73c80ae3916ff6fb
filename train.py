"""Train a policy with world rehearsal (EnvACE): warm start, then RL with no environment.

    python train.py --config small.yaml                      # the CPU demo (minutes)
    python train.py --config small.yaml --env_mode=real      # same budget, real world in the loop
    python train.py --config small.yaml --rl_steps=20        # any config key as --key=value

One run, top to bottom:
  1. Warm start (`sft_*` keys): teacher-forced training on logged expert episodes run in the
     real world, plus logged single-tool traffic, with the same role masks as RL; act AND
     environment tokens are trained, so the policy starts with a world model.
  2. Evaluate in the real world and print rehearsal fidelity per tool kind: the gate. Rehearsed
     rewards are only as good as the rehearsals, so RL in rehearse/frozen mode stops here unless
     every kind reaches `min_fidelity`.
  3. RL: for each step, sample `tasks_per_step` tasks x `group_size` episodes (rollout.py), in
     `env_mode` rehearse (the policy plays the world), real or frozen; reward task success
     (reward.py); A = R - mean(group); one hand-written clipped policy-gradient update on ACT and
     REHEARSE tokens (`clipped_pg_loss`).
  4. Save the policy (save_pretrained) and evaluate it in the real world; print before/after.

What this simplifies against the paper / official code:
  - inline rehearsal: the response is written in the actor's own sequence, so one row holds
    both roles and a task's group is its (task, role) group too; no separate simulator prompt;
  - a toy world whose responses are memorisable, and exact-match task success, not a judge;
  - one optimizer step per batch by default (ratio = 1 at the first step, as in the official
    on-policy setting); `ppo_epochs` > 1 reuses the batch and makes the clip bite;
  - no dynamic sampling: steps where every group has equal rewards are skipped and counted.
"""
import copy
import difflib
import json
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

import rehearse
import world
from envace import (ACT, OBS, REHEARSE, build_model, build_tokenizer, collate, encode_episode,
                    loss_mask, save_checkpoint, token_advantages, token_logprobs)
from evaluate import evaluate, summary
from reward import cause_counts, group_advantages, task_reward
from rollout import sample_episodes

hf_logging.disable_progress_bar()     # transformers' save/load bars: keep the terminal for ours

# Every config key, its default, and therefore its type. A config file is flat YAML of these.
DEFAULTS = {
    "out_dir": "out/run", "seed": 1, "device": "auto",
    # model: "tiny" builds a small Llama from n_layer/n_embd/n_head; else a path or hub name
    "model": "tiny", "n_layer": 4, "n_embd": 128, "n_head": 4,
    # data: tasks from the toy world (world.py), generated from data_seed
    "data_seed": 0, "n_logged": 3000, "n_new_logged": 20, "n_rl_tasks": 4000, "n_test": 500,
    "snippet_repeats": 20, "coverage": 1.0,
    # warm start
    "sft_steps": 600, "sft_batch_size": 64, "sft_lr": 1e-3,
    # RL
    "env_mode": "rehearse", "rl_steps": 200, "tasks_per_step": 16, "group_size": 8,
    "lr": 1e-4, "weight_decay": 0.01, "grad_clip": 1.0, "ppo_epochs": 1, "micro_batch_size": 64,
    "eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0, "kl_coef": 0.0,
    "act_coef": 1.0, "rehearse_coef": 1.0, "scale_std": False,
    # sampling
    "temperature": 1.0, "top_p": 1.0, "max_turns": 6, "max_act_tokens": 8, "max_env_tokens": 6,
    "max_tokens": 96,
    # evaluation
    "eval_temperature": 0.0, "eval_every": 0, "min_fidelity": 0.95,
}
CHOICES = {"env_mode": ("rehearse", "real", "frozen"), "device": ("auto", "cpu", "cuda")}
POSITIVE = {"n_layer", "n_embd", "n_head", "n_logged", "n_rl_tasks", "n_test", "sft_batch_size",
            "tasks_per_step", "group_size", "ppo_epochs", "micro_batch_size", "max_turns",
            "max_act_tokens", "max_env_tokens", "max_tokens", "temperature", "lr", "sft_lr"}
NON_NEGATIVE = {"seed", "data_seed", "n_new_logged", "snippet_repeats", "sft_steps", "rl_steps",
                "weight_decay", "grad_clip", "eps_low", "eps_high", "kl_coef", "act_coef",
                "rehearse_coef", "eval_temperature", "eval_every", "min_fidelity"}
UNIT = {"coverage", "top_p", "min_fidelity"}              # in (0, 1] (min_fidelity: [0, 1])


class ConfigError(Exception):
    """A user mistake in a config, override or path: printed as one line, exit code 2."""


def check_value(key, value):
    """Type and range of one config value; returns it (ints are accepted for float keys)."""
    if key not in DEFAULTS:
        close = difflib.get_close_matches(str(key), DEFAULTS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown config key '{key}'{hint}; keys are: {', '.join(DEFAULTS)}")
    want = type(DEFAULTS[key])
    if want is float and type(value) is str:
        try:
            value = float(value)             # YAML 1.1 reads 1e-4 (no dot) as a string
        except ValueError:
            pass
    if want is float and type(value) is int:
        value = float(value)
    if want is float and type(value) is float and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
    if type(value) is not want:
        raise ConfigError(f"config key '{key}' must be {want.__name__}, got {value!r}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"config key '{key}' must be one of {CHOICES[key]}, got {value!r}")
    if key in POSITIVE and value <= 0 or key in NON_NEGATIVE and value < 0:
        raise ConfigError(f"config key '{key}' must be {'> 0' if key in POSITIVE else '>= 0'}, got {value!r}")
    if key in UNIT and not 0 <= value <= 1 or key in ("coverage", "top_p") and value == 0:
        raise ConfigError(f"config key '{key}' must be in (0, 1], got {value!r}")
    if key == "dual_clip" and value <= 1:
        raise ConfigError(f"config key 'dual_clip' must be > 1 (the official value is 3), got {value!r}")
    return value


def load_config(path, overrides=()):
    """DEFAULTS <- the YAML file <- `--key=value` overrides, every value checked."""
    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise ConfigError(f"invalid YAML in {path}{where}: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start})") from None
    loaded = {} if loaded is None else loaded      # an empty file is an empty config
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must be a flat mapping of key: value")
    cfg = dict(DEFAULTS)
    for key, value in loaded.items():
        cfg[key] = check_value(key, value)
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"cannot read argument '{arg}': overrides are --key=value")
        key, text = arg[2:].split("=", 1)
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        cfg[key] = check_value(key, value)
    if cfg["n_embd"] % cfg["n_head"]:
        raise ConfigError(f"n_embd ({cfg['n_embd']}) must be divisible by n_head ({cfg['n_head']})")
    return cfg


def load_policy(path, cfg):
    """A saved policy and its tokenizer, with clear errors for a missing or broken checkpoint."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"no model checkpoint in {path} (config.json missing)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the checkpoint in {path}: {str(e).splitlines()[0]}") from None
    return model.to(pick_device(cfg)), tokenizer


def pick_device(cfg):
    if cfg["device"] == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg["device"]


# ----------------------------------------------------------------------------- the loss

def clipped_pg_loss(new_logprobs, old_logprobs, advantages, loss_mask, n_tokens, ref_logprobs=None,
                    eps_low=0.2, eps_high=0.2, dual_clip=3.0, kl_coef=0.0):
    """PPO's clipped surrogate with dual clip and a k3 KL to a reference, per token, summed over
    the trained tokens and divided by `n_tokens`, the count of trained tokens in the WHOLE batch
    (all micro-batches), so that accumulating micro-batches gives the one-big-batch gradient.

    All inputs are [B, T] (targets); loss_mask is bool. Returns (loss, stats); every stat is also
    a sum over this micro-batch divided by n_tokens, so stats of micro-batches add up too.

    Worked example (eps 0.2, dual clip 3):  A = +1, ratio 1.5 -> loss -1.2 (clipped at 1+eps);
    A = -1, ratio 0.5 -> loss 0.8 (clipped at 1-eps); A = -1, ratio 5 -> loss 3 (dual clip)."""
    mask = loss_mask.float()
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)                                   # pi_new / pi_old, per token
    surr = -advantages * ratio                                     # policy-gradient surrogate (as a loss)
    surr_clipped = -advantages * ratio.clamp(1 - eps_low, 1 + eps_high)  # no credit beyond the trust region
    ppo = torch.maximum(surr, surr_clipped)                        # pessimistic bound: PPO's clip
    dual = torch.minimum(ppo, -advantages * dual_clip)             # A < 0: loss capped at c|A| if ratio >> 1
    per_token = torch.where(advantages < 0, dual, ppo)             # dual clip applies to negative A only
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        d = ref_logprobs - new_logprobs
        kl = torch.exp(d) - d - 1                                  # k3 estimator of KL(new || ref), >= 0
        per_token = per_token + kl_coef * kl
    loss = (per_token * mask).sum() / n_tokens
    with torch.no_grad():
        stats = {
            "clip_frac": ((surr_clipped > surr) * mask).sum().item() / n_tokens,
            "dual_clip_frac": (((advantages < 0) & (dual < ppo)) * mask).sum().item() / n_tokens,
            "approx_kl": ((-log_ratio) * mask).sum().item() / n_tokens,   # k1 estimate of KL(old || new)
            "kl_ref": (kl * mask).sum().item() / n_tokens,
        }
    return loss, stats


# ----------------------------------------------------------------------------- data

def build_data(cfg, tokenizer):
    """Tasks from the toy world, and the warm-start sequences (ids + roles) from logged traffic."""
    splits = world.make_splits(cfg["data_seed"], cfg["n_logged"], cfg["n_new_logged"],
                               cfg["n_rl_tasks"], cfg["n_test"], cfg["coverage"])
    sft = [encode_episode(tokenizer, t["prompt"], t["calls"], world.replay(t["calls"]), t["answer"])
           for t in splits["logged"]]
    # single-tool traffic: the calls are context (role PROMPT), only the responses are trained
    sft += [encode_episode(tokenizer, "", calls, world.replay(calls), act_role=0)
            for calls in world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"], cfg["coverage"])]
    return splits, sft


# ----------------------------------------------------------------------------- warm start

def warm_start(model, sft_data, cfg, device, pad_id):
    """Teacher-forced cross-entropy on ACT, REHEARSE and OBS tokens (token mean per batch), AdamW
    with cosine decay. Environment tokens are trained too: that is the initial world model."""
    if cfg["sft_steps"] == 0:
        return
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["sft_lr"], weight_decay=cfg["weight_decay"])
    rng = random.Random(cfg["seed"])
    model.train()
    bar = tqdm(range(cfg["sft_steps"]), desc="warm start", dynamic_ncols=True)
    for it in bar:
        lr = cfg["sft_lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / cfg["sft_steps"])))
        for group in opt.param_groups:
            group["lr"] = lr
        ids, roles = collate(rng.sample(sft_data, min(cfg["sft_batch_size"], len(sft_data))), pad_id)
        ids, roles = ids.to(device), roles.to(device)
        mask = loss_mask(roles, trained=(ACT, REHEARSE, OBS)).float()
        loss = -(token_logprobs(model, ids) * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"] or float("inf"))
        opt.step()
        if it % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{lr:.1e}")
    model.eval()


# ----------------------------------------------------------------------------- RL

def make_batch(episodes, rewards, group_ids, cfg, pad_id):
    """Episodes -> tensors for the update: ids [B, L], roles [B, L], and over targets [B, L-1]
    the loss mask (ACT/REHEARSE targets whose coefficient is > 0) and per-token advantages."""
    adv, all_equal = group_advantages(rewards, group_ids, cfg["scale_std"])
    ids, roles = collate(episodes, pad_id)
    trained = tuple(r for r, c in ((ACT, cfg["act_coef"]), (REHEARSE, cfg["rehearse_coef"])) if c > 0)
    batch = {"ids": ids, "roles": roles, "mask": loss_mask(roles, trained),  # coef 0: no loss at all
             "advantages": token_advantages(roles, adv, cfg["act_coef"], cfg["rehearse_coef"]),
             "all_equal_groups": all_equal, "n_groups": len(set(group_ids))}
    batch["n_tokens"] = max(int(batch["mask"].sum()), 1)   # the normaliser: trained tokens, whole batch
    return batch


@torch.no_grad()
def batch_logprobs(model, ids, micro_batch_size, temperature):
    """No-grad fp32 logprobs of every target, micro-batch by micro-batch: old or reference."""
    return torch.cat([token_logprobs(model, ids[i:i + micro_batch_size], temperature)
                      for i in range(0, len(ids), micro_batch_size)])


def accumulate_gradients(model, batch, old, ref, cfg):
    """Forward/backward every micro-batch; the loss of each is already divided by the batch's
    total trained tokens, so the accumulated .grad equals that of one forward over the whole
    batch, whatever micro_batch_size is. Returns the summed stats and per-role entropy."""
    mb, device = cfg["micro_batch_size"], old.device
    ids, mask, adv = batch["ids"].to(device), batch["mask"].to(device), batch["advantages"].to(device)
    target_roles = batch["roles"][:, 1:].to(device)
    totals = {"loss": 0.0, "entropy_act": 0.0, "entropy_rehearse": 0.0}
    for i in range(0, len(ids), mb):
        new, entropy = token_logprobs(model, ids[i:i + mb], cfg["temperature"], with_entropy=True)
        loss, stats = clipped_pg_loss(new, old[i:i + mb], adv[i:i + mb], mask[i:i + mb],
                                      batch["n_tokens"], None if ref is None else ref[i:i + mb],
                                      cfg["eps_low"], cfg["eps_high"], cfg["dual_clip"], cfg["kl_coef"])
        loss.backward()
        totals["loss"] += loss.item()
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v
        for r, name in ((ACT, "entropy_act"), (REHEARSE, "entropy_rehearse")):
            totals[name] += float((entropy.detach() * (target_roles[i:i + mb] == r)).sum())
    return totals


def rl_step(model, opt, episodes, rewards, group_ids, cfg, pad_id, reference=None):
    """One policy update from sampled episodes; returns a dict of metrics. A batch in which every
    group has equal rewards has zero advantage everywhere: the step is skipped (and counted)."""
    batch = make_batch(episodes, rewards, group_ids, cfg, pad_id)
    target_roles = batch["roles"][:, 1:]
    stats = {"all_equal_groups": batch["all_equal_groups"],
             "skipped": batch["all_equal_groups"] == batch["n_groups"]}
    for r, name in ((ACT, "act"), (REHEARSE, "rehearse"), (OBS, "obs")):
        sel = target_roles == r
        stats[f"tokens_{name}"] = int(sel.sum())
        stats[f"adv_{name}"] = float(batch["advantages"][sel].mean()) if sel.any() else 0.0
    if stats["skipped"]:
        return stats
    device = next(model.parameters()).device
    t0 = time.time()
    ids = batch["ids"].to(device)
    mb, temperature = cfg["micro_batch_size"], cfg["temperature"]
    old = batch_logprobs(model, ids, mb, temperature)
    ref = None if reference is None else batch_logprobs(reference, ids, mb, temperature)
    stats["time_logprobs"] = time.time() - t0
    t0 = time.time()
    model.train()
    for _ in range(cfg["ppo_epochs"]):
        opt.zero_grad(set_to_none=True)
        totals = accumulate_gradients(model, batch, old, ref, cfg)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"] or float("inf"))
        if torch.isfinite(grad_norm):
            opt.step()
    model.eval()
    stats.update(totals)
    stats["grad_norm"] = float(grad_norm)
    stats["entropy_act"] /= max(stats["tokens_act"], 1)
    stats["entropy_rehearse"] /= max(stats["tokens_rehearse"], 1)
    stats["time_update"] = time.time() - t0
    return stats


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if "--config" not in argv and not any(a.startswith("--config=") for a in argv):
        print("usage: python train.py --config small.yaml [--key=value ...]", file=sys.stderr)
        return 2
    args = list(argv)
    i = next(i for i, a in enumerate(args) if a.startswith("--config"))
    flag = args.pop(i)
    path = flag.split("=", 1)[1] if "=" in flag else (args.pop(i) if i < len(args) else "")
    try:
        if not path:
            raise ConfigError("--config needs a path, e.g. --config small.yaml")
        return run(load_config(path, args))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def run(cfg):
    """The whole run for a checked config dict. Returns 0, or 2 if the fidelity gate stops it."""
    seed_everything(cfg["seed"])
    device = pick_device(cfg)
    out = cfg["out_dir"]
    os.makedirs(out, exist_ok=True)
    config_text = yaml.safe_dump(cfg, sort_keys=False)
    with open(os.path.join(out, "config.yaml"), "w") as f:
        f.write(config_text)

    # 1. model, tokenizer, data, warm start
    tokenizer = build_tokenizer(world.WORDS)
    if cfg["model"] == "tiny":
        model = build_model(cfg, tokenizer)
    else:
        model, tokenizer = load_policy(cfg["model"], cfg)
    model.to(device)
    splits, sft_data = build_data(cfg, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, vocab {len(tokenizer)} | tasks: "
          f"{len(splits['logged'])} logged, {len(splits['rl'])} RL, {len(splits['test'])} test | "
          f"warm-start sequences: {len(sft_data)} | device {device}")
    t_start = time.time()
    warm_start(model, sft_data, cfg, device, tokenizer.pad_token_id)
    save_checkpoint(model, tokenizer, os.path.join(out, "warmstart"), {"config.yaml": config_text})

    # 2. real-world evaluation of the warm start, and the fidelity gate
    before = evaluate(model, tokenizer, splits["test"], cfg, seed=cfg["seed"])
    with open(os.path.join(out, "warmstart", "eval.json"), "w") as f:
        json.dump(before, f, indent=1)
    print(f"warm start ({time.time() - t_start:.0f}s): {summary(before)}")
    low = {k: v for k, v in before["fidelity"].items() if v < cfg["min_fidelity"]}
    if cfg["env_mode"] != "real" and cfg["min_fidelity"] > 0 and (low or not before["fidelity"]):
        print(f"fidelity gate FAILED: {low or 'no calls made'} below min_fidelity "
              f"{cfg['min_fidelity']}: rehearsed rewards would be noise for these tools. Raise "
              f"snippet_repeats/sft_steps/coverage, or set --min_fidelity=0 to run anyway.")
        return 2
    print(f"fidelity gate passed: every tool kind >= {cfg['min_fidelity']} ({cfg['env_mode']} mode)")

    # 3. RL
    reference = None
    if cfg["kl_coef"] > 0 or cfg["env_mode"] == "frozen":
        reference = copy.deepcopy(model).eval().requires_grad_(False)   # frozen warm start
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    generator = torch.Generator().manual_seed(cfg["seed"])
    task_rng = random.Random(cfg["seed"])
    metrics_path = os.path.join(out, "metrics.jsonl")
    open(metrics_path, "w").close()
    skipped, real_success = 0, before["success"]
    bar = tqdm(range(1, cfg["rl_steps"] + 1), desc=f"RL ({cfg['env_mode']})", dynamic_ncols=True)
    for step in bar:
        t0 = time.time()
        tasks = task_rng.sample(splits["rl"], cfg["tasks_per_step"])
        prompts = [t["prompt"] for t in tasks for _ in range(cfg["group_size"])]
        episodes = sample_episodes(
            model, tokenizer, prompts, cfg["env_mode"],
            env_model=reference if cfg["env_mode"] == "frozen" else None,
            temperature=cfg["temperature"], top_p=cfg["top_p"], max_turns=cfg["max_turns"],
            max_act_tokens=cfg["max_act_tokens"], max_env_tokens=cfg["max_env_tokens"],
            max_tokens=cfg["max_tokens"], generator=generator)
        time_sample = time.time() - t0
        group_ids = [i // cfg["group_size"] for i in range(len(episodes))]
        rewards = [task_reward(e, tasks[g]) for e, g in zip(episodes, group_ids)]
        stats = rl_step(model, opt, episodes, rewards, group_ids, cfg,
                        tokenizer.pad_token_id, reference if cfg["kl_coef"] > 0 else None)
        skipped += stats["skipped"]
        n_tok = sum(len(e["ids"]) for e in episodes)
        record = {"step": step, "reward": sum(rewards) / len(rewards),
                  "success": sum(rewards) / len(rewards), "skipped_steps": skipped,
                  "causes": cause_counts(episodes),
                  "mean_calls": sum(len(e["calls"]) for e in episodes) / len(episodes),
                  "time_sample": time_sample, "time_step": time.time() - t0,
                  "tok_per_s": n_tok / (time.time() - t0), **stats}
        if cfg["env_mode"] != "real":   # diagnostic only: never feeds the reward or the loss
            record["fidelity"] = rehearse.rates(rehearse.replay_fidelity(episodes))
        if cfg["eval_every"] and step % cfg["eval_every"] == 0 and step < cfg["rl_steps"]:
            real_success = evaluate(model, tokenizer, splits["test"], cfg, seed=cfg["seed"])["success"]
            record["eval_success"] = real_success
            tqdm.write(f"step {step}: real-world success {real_success:.3f} (reward in the "
                       f"{cfg['env_mode']} world this step {record['reward']:.3f})")
        with open(metrics_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        bar.set_postfix(reward=f"{record['reward']:.3f}", real=f"{real_success:.3f}", skip=skipped,
                        tok_s=f"{record['tok_per_s']:.0f}")

    # 4. save and evaluate in the real world
    save_checkpoint(model, tokenizer, out, {"config.yaml": config_text})
    after = evaluate(model, tokenizer, splits["test"], cfg, seed=cfg["seed"])
    with open(os.path.join(out, "eval.json"), "w") as f:
        json.dump({**after, "before": before}, f, indent=1)
    print(f"before RL: {summary(before)}")
    print(f"after RL:  {summary(after)}")
    print(f"real-world success {before['success']:.3f} -> {after['success']:.3f} "
          f"({cfg['env_mode']} mode, {cfg['rl_steps']} steps, {skipped} skipped, "
          f"{time.time() - t_start:.0f}s); saved to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
