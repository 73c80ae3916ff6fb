"""Train a policy with world rehearsal (EnvACE): warm start, then RL with no environment.

    python train.py --config small.yaml                      # the CPU demo (minutes)
    python train.py --config small.yaml --env_mode=real      # same budget, real world in the loop
    python train.py --config small.yaml --rl_steps=20        # any config key as --key=value
    python train.py --config small.yaml --resume             # continue out_dir's latest checkpoint
    python train.py --config configs/chat_tiny.yaml --model=PATH  # a chat model on chat JSONL tasks
    torchrun --nproc_per_node=2 train.py --config small.yaml # several processes (GPUs or CPU)
    torchrun --nproc_per_node=8 train.py --config configs/qwen3-8b.yaml   # FSDP2 (fsdp: true)

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
     REHEARSE tokens (`clipped_pg_loss`). Every step logs the rehearsals' fidelity per tool
     kind and the collusion rate (rehearse.collusion_counts) against a real replay. Two guards
     against the world drifting toward what pays (off by default): `kl_rehearse_coef`, a k3 KL
     to the frozen warm start on REHEARSE tokens (`kl_coef` is the one on ACT tokens), and
     `rehearse_check`, which ends an episode with reward 0 when a rehearsed response has the
     wrong form for its call (rehearse.check_rehearsal).
  4. Save the policy (save_pretrained) and evaluate it in the real world; print before/after.

Under torchrun every rank samples its slice of each step's tasks (a task's whole group on one
rank), DDP averages the gradients, and the loss is divided by the GLOBAL count of trained
tokens, so N ranks x B/N rows make the same update as 1 rank x B rows. Only rank 0 prints,
evaluates, writes files and saves. Ctrl-C or SIGTERM finishes the current RL step, saves a
checkpoint (model, optimizer, RNG states) and exits 0; `--resume` continues it exactly.
With `fsdp` the model is sharded (FSDP2) instead of replicated: sampling, the no-grad logprob
passes and evaluation run on weights gathered once per phase (`gathered`), and saves gather a
full state dict to rank 0. A memory estimate per GPU (`memory_estimate`) is printed at start.

What this simplifies against the paper / official code:
  - inline rehearsal by default: the response is written in the actor's own sequence, so one
    row holds both roles and a task's group is its (task, role) group too; `rehearsal_context:
    separate` gives each rehearsal a row and prompt of its own, as the official code does;
  - a toy world whose responses are memorisable, and exact-match task success, not a judge;
  - `format: chat` (chat.py) runs a real chat model on JSONL tool tasks instead of the toy's
    tags, with answer / gold-call rewards and an optional local judge;
  - one optimizer step per batch by default (ratio = 1 at the first step, as in the official
    on-policy setting); `ppo_epochs` > 1 reuses the batch and makes the clip bite;
  - no dynamic sampling: steps where every group has equal rewards are skipped and counted.
"""
import contextlib
import copy
import functools
from collections import Counter
import json
import math
import os
import random
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm
from transformers.utils import logging as hf_logging

import chat
import rehearse
import world
from envace import (ACT, OBS, PROMPT, REHEARSE, build_model, build_tokenizer, collate, encode_episode,
                    find_checkpoint, loss_mask, micro_batches, padded_fraction, save_checkpoint,
                    token_advantages, token_logprobs)
from config import DEFAULTS, ConfigError, load_config
from evaluate import evaluate, load_judge, summary
from reward import cause_counts, chat_reward, group_advantages, task_reward, training_rows
from rollout import sample_episodes, sample_separate

hf_logging.disable_progress_bar()     # transformers' save/load bars: keep the terminal for ours


def load_policy(path, device="cpu", init="pretrained"):
    """A saved policy (a folder, or a hub name) and its tokenizer, with clear errors for a missing
    or broken checkpoint. init "random": the same architecture, random weights, none loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    hub_name = not os.path.exists(path) and len(path.split("/")) == 2 and not path.startswith(".")
    if not hub_name and not os.path.isfile(os.path.join(path, "config.json")):
        raise ConfigError(f"no model checkpoint in {path} (config.json missing)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        if init == "random":
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError, RuntimeError) as e:
        raise ConfigError(f"cannot load the checkpoint in {path}: {str(e).splitlines()[0]}") from None
    return model.to(device), tokenizer


def check_separate_vocabulary(cfg, tokenizer):
    """The separate rehearse prompt's words must be in the vocabulary (a toy model warm-started
    inline has none of them): else one clear line."""
    if cfg["rehearsal_context"] == "separate" and cfg["format"] == "plain" and tokenizer.unk_token_id in tokenizer.encode(
            " ".join(world.SEPARATE_WORDS), add_special_tokens=False):
        raise ConfigError(f"rehearsal_context separate: the tokenizer of {cfg['model']} lacks the "
                          f"rehearse prompt's words {world.SEPARATE_WORDS}; start from model: tiny "
                          f"(or a model warm-started with rehearsal_context separate)")


def pick_device(cfg):
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for, but torch sees no CUDA device")
    if cfg["device"] == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg["device"]


def autocast(cfg, device):
    """bf16 autocast on CUDA (weights stay fp32; logprobs are taken in fp32), nothing on CPU."""
    if str(device).startswith("cuda") and cfg["bf16"]:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ----------------------------------------------------------------------------- distributed

def setup_distributed(cfg):
    """(rank, world_size, device). torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; NCCL on CUDA,
    gloo on CPU, picked from the device. A plain `python train.py` is rank 0 of 1."""
    device = pick_device(cfg)
    if "RANK" not in os.environ:
        return 0, 1, device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def all_sum(values):
    """Sum a list of numbers over ranks (identity in one process)."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return t.tolist()


def all_max(value):
    """The largest of a number over ranks (itself in one process)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_gather(obj):
    """A list with every rank's `obj` (a one-element list in one process)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def from_rank0(fn):
    """Run fn() on rank 0 only (an evaluation, say) and give its result to every rank."""
    box = [fn() if not dist.is_initialized() or dist.get_rank() == 0 else None]
    if dist.is_initialized():
        dist.broadcast_object_list(box, src=0)
    return box[0]


def add_up(dicts):
    """Merge per-rank metric sums: numbers add, nested dicts merge, lists add elementwise."""
    out = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, dict):
                out[k] = add_up([out.get(k, {}), v])
            elif isinstance(v, list):
                out[k] = [a + b for a, b in zip(out.get(k, [0] * len(v)), v)]
            else:
                out[k] = out.get(k, 0) + v
    return out


# ----------------------------------------------------------------------------- GPU: memory, sharding

ACTIVATION_BYTES = 34  # per token x layer x hidden unit kept for backward in bf16, no checkpointing
                       # (Korthikanti et al. 2022, 34sbh per layer; flash attention drops the s^2 term)
LOGIT_BYTES = 20       # per token x vocab entry in token_logprobs: bf16 logits + 4 fp32 copies
                       # (.float(), / temperature, log_softmax, exp for the entropy)


def memory_estimate(n_params, cfg, model_config, world_size=1):
    """A rough per-GPU memory budget in GiB (an estimate: allocator slack, CUDA context and
    temporaries are not counted). Training holds fp32 weights, fp32 gradients and AdamW's two fp32
    moments (16 bytes per parameter; / world size under FSDP), activations of the largest
    micro-batch (micro_batch_tokens x layers x hidden x ACTIVATION_BYTES; with gradient
    checkpointing each layer keeps its input only, and one layer at a time is recomputed), and the
    logits of that micro-batch. Sampling holds the KV cache of this rank's rows at max_tokens and,
    under FSDP, the gathered (bf16) weights. `train` and `sample` are the two phases' totals."""
    gib = 2 ** 30
    shard = world_size if cfg["fsdp"] and world_size > 1 else 1
    half = 2 if cfg["bf16"] else 4                   # bytes of one activation / gathered weight
    tokens, layers, hidden = cfg["micro_batch_tokens"], model_config.num_hidden_layers, model_config.hidden_size
    heads = model_config.num_attention_heads
    head_dim = getattr(model_config, "head_dim", None) or hidden // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    embed = model_config.vocab_size * hidden * (1 if getattr(model_config, "tie_word_embeddings", False) else 2)
    per_layer = (n_params - embed) / layers
    e = {"params": 4 * n_params / shard, "grads": 4 * n_params / shard, "adam": 8 * n_params / shard,
         "reference": 4 * n_params / shard if cfg["kl_coef"] > 0 or cfg["env_mode"] == "frozen" else 0,
         "activations_full": tokens * layers * hidden * ACTIVATION_BYTES * half / 2,
         "activations_checkpointed": tokens * hidden * (layers * half + ACTIVATION_BYTES * half / 2),
         "logits": tokens * model_config.vocab_size * LOGIT_BYTES,
         # FSDP2 keeps the root (embeddings, lm_head) gathered from forward to backward, plus
         # the layer computing and the one prefetched
         "fsdp_unsharded": (embed + 2 * per_layer) * half if shard > 1 else 0,
         "kv_cache": (cfg["tasks_per_step"] // world_size * cfg["group_size"] * cfg["max_tokens"]
                      * layers * 2 * kv_heads * head_dim * half),
         "gathered_weights": n_params * half if shard > 1 else 0}
    e = {k: v / gib for k, v in e.items()}
    resident = e["params"] + e["grads"] + e["adam"] + e["reference"]
    act = e["activations_checkpointed" if cfg["gradient_checkpointing"] else "activations_full"]
    e["train"] = resident + act + e["logits"] + e["fsdp_unsharded"]
    e["sample"] = resident + e["kv_cache"] + e["gathered_weights"]
    return e


def memory_line(e, cfg, world_size):
    """memory_estimate as the one line printed at start."""
    ckpt = cfg["gradient_checkpointing"]
    how = f"FSDP over {world_size}" if cfg["fsdp"] and world_size > 1 else "unsharded"
    return (f"memory estimate per GPU ({how}, GiB, rough): weights {e['params']:.1f} + grads "
            f"{e['grads']:.1f} + AdamW {e['adam']:.1f} + reference {e['reference']:.1f} + activations "
            f"{e['activations_checkpointed' if ckpt else 'activations_full']:.1f} (gradient checkpointing "
            f"{'on' if ckpt else 'off'}; {e['activations_full' if ckpt else 'activations_checkpointed']:.1f} "
            f"{'off' if ckpt else 'on'}) + logits {e['logits']:.1f} + FSDP gathered "
            f"{e['fsdp_unsharded']:.1f} = train {e['train']:.1f}; sampling: KV cache {e['kv_cache']:.1f} "
            f"+ gathered weights {e['gathered_weights']:.1f} = {e['sample']:.1f}")


def parallel_model(model, cfg, device, world_size):
    """The module the training forwards go through: the model itself (one process), DDP, or,
    with `fsdp`, the model sharded in place by FSDP2 (`shard`). With gradient_checkpointing the
    decoder layers recompute their activations in backward; transformers does it only in training
    mode with grad enabled, so the no-grad KV-cached sampler runs exactly as without it."""
    if cfg["gradient_checkpointing"]:
        model.activation_checkpointing_enable()     # transformers 5.x name of gradient_checkpointing_enable
    if world_size == 1:
        return model
    if cfg["fsdp"]:
        return shard(model, device, world_size, isinstance(autocast(cfg, device), torch.autocast))
    return DDP(model, device_ids=[device] if device.startswith("cuda") else None)


def shard(model, device, world_size, bf16=False):
    """FSDP2 in place: every decoder layer its own unit, then the root (embeddings, norm, lm_head).
    Weights, gradients and AdamW states are split over the ranks; each layer is gathered for its
    forward and backward. Gradients are reduce-scattered (averaged, as DDP does) after every
    backward. With bf16 (on CUDA) layers are gathered in bf16 and gradients reduced in fp32."""
    mesh = init_device_mesh("cuda" if str(device).startswith("cuda") else "cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for layer in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@contextlib.contextmanager
def gathered(model):
    """Under FSDP: all ranks gather the full weights once (a collective), and keep them until the
    block ends, so that forwards inside make no collective at all: the lock-step sampler, the
    no-grad logprob passes and rank 0's evaluation may then run a different number of forwards
    on each rank. Anything else (a plain or DDP model, None): nothing to do."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)] if model is not None else []
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            if unit is not model:       # FSDP2 never reshards the root after forward: leave it so
                unit.set_reshard_after_forward(True, recurse=False)


def full_state_dict(model):
    """Under FSDP the whole model's weights, gathered to rank 0 on the CPU (a collective: every
    rank calls it; the others get {}), for save_pretrained. None for an unsharded model."""
    if not isinstance(model, FSDPModule):
        return None
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def optimizer_state(model, opt):
    """opt.state_dict(); under FSDP the full one, gathered to rank 0 and keyed by parameter name
    (a collective). Before the first step it stays opt.state_dict(): torch's gather would make up
    the missing state by taking an AdamW step with lr 0, which counts in Adam's bias correction."""
    if not isinstance(model, FSDPModule) or not opt.state:
        return opt.state_dict()
    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, opt, saved):
    """The inverse of optimizer_state: each FSDP rank takes its shard of the full state."""
    if isinstance(model, FSDPModule) and saved["state"]:
        set_optimizer_state_dict(model, opt, saved, options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(saved)


# ----------------------------------------------------------------------------- the loss

def clipped_pg_loss(new_logprobs, old_logprobs, advantages, loss_mask, n_tokens, ref_logprobs=None,
                    eps_low=0.2, eps_high=0.2, dual_clip=3.0, kl_coef=0.0):
    """PPO's clipped surrogate with dual clip and a k3 KL to a reference, per token, summed over
    the trained tokens and divided by `n_tokens`, the count of trained tokens in the WHOLE batch
    (all micro-batches), so that accumulating micro-batches gives the one-big-batch gradient.

    All inputs are [B, T] (targets); loss_mask is bool. Returns (loss, stats); every stat is also
    a sum over this micro-batch divided by n_tokens, so stats of micro-batches add up too.

    Worked example (eps 0.2, dual clip 3):  A = +1, ratio 1.5 -> loss -1.2 (clipped at 1+eps);
    A = -1, ratio 0.5 -> loss 0.8 (clipped at 1-eps); A = -1, ratio 5 -> loss 3 (dual clip).
    kl_coef: a number, or [B, T] per target (train.py gives each token its role's coefficient:
    `token_kl_coefs`)."""
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

def build_tasks(cfg):
    """The splits: generated from the toy world (data_seed), or read from JSONL files where the
    config names them. Every file line is checked here, before anything is built or trained."""
    if cfg["format"] == "chat":
        return chat_tasks(cfg)
    splits = world.make_splits(cfg["data_seed"], cfg["n_logged"], cfg["n_new_logged"],
                               cfg["n_rl_tasks"], cfg["n_test"], cfg["coverage"])
    try:
        for key, split, kind in (("tasks_file", "rl", "tasks"), ("test_file", "test", "tasks"),
                                 ("logged_file", "logged", "trajectories")):
            if cfg[key]:
                splits[split] = world.read_jsonl(cfg[key], kind)
    except world.DataError as e:
        raise ConfigError(str(e)) from None
    for t in splits["rl"] + splits["test"]:
        t.setdefault("family", "file")
    return splits


def chat_tasks(cfg):
    """Chat JSONL splits (chat.read_chat_jsonl): tasks_file for RL, test_file (default: the same
    file) for evaluation, logged_file (optional) for the warm start."""
    try:
        rl = chat.read_chat_jsonl(cfg["tasks_file"], "tasks")
        test = chat.read_chat_jsonl(cfg["test_file"], "tasks") if cfg["test_file"] else rl
        logged = chat.read_chat_jsonl(cfg["logged_file"], "trajectories") if cfg["logged_file"] else []
    except world.DataError as e:
        raise ConfigError(str(e)) from None
    if cfg["env_mode"] == "real" and not all(t.get("env") == "toy" for t in rl):
        raise ConfigError(f"env_mode: real needs tasks a real environment executes ('env': 'toy'); "
                          f"{cfg['tasks_file']} has tasks without one")
    return {"rl": rl, "test": test, "logged": logged}


def chat_tags(tokenizer):
    """The hand-offs derived from the tokenizer's chat template (chat.chat_format), checked."""
    try:
        return chat.chat_format(tokenizer)
    except chat.TemplateError as e:
        raise ConfigError(str(e)) from None


def check_chat_prompts(cfg, tokenizer, tasks):
    """The template fits (chat_tags) and every task's rendered prompt leaves room for an episode."""
    prompts, _ = chat.episode_inputs(tokenizer, chat_tags(tokenizer), tasks)
    longest = max(range(len(tasks)), key=lambda i: len(prompts[i]))
    if len(prompts[longest]) >= cfg["max_tokens"]:
        raise ConfigError(f"max_tokens ({cfg['max_tokens']}) leaves no room for an episode: a task's "
                          f"prompt (messages + tools) is {len(prompts[longest])} tokens "
                          f"({tasks[longest]['messages'][-1]['content'][:40]!r})")


def rollout_inputs(cfg, tokenizer, tasks):
    """(prompts, world, tags) for sample_episodes, each task repeated group_size times: the toy's
    prompt texts and world module, or chat prompt ids with one world per row."""
    G = cfg["group_size"]
    if cfg["format"] == "plain":
        return [t["prompt"] for t in tasks for _ in range(G)], world, None
    tags = chat_tags(tokenizer)
    prompts, worlds = chat.episode_inputs(tokenizer, tags, tasks)
    return ([p for p in prompts for _ in range(G)], [w for w in worlds for _ in range(G)], tags)


def warm_start_sequences(cfg, tokenizer, splits, examples=None):
    """Logged expert episodes (responses from the real world: OBS) and logged single-tool traffic
    (calls as context, role PROMPT; only the responses are trained) as ids + roles. Chat format:
    the logged chat trajectories and the tasks' reference examples (chat.warm_start_sequences).
    rehearsal_context separate: `separate_warm_start_sequences` instead."""
    if cfg["format"] == "chat" and cfg["rehearsal_context"] == "separate":
        return chat.separate_warm_start_sequences(tokenizer, chat_tags(tokenizer), splits["logged"], splits["rl"],
                                                  cfg["grounding_examples"])
    if cfg["format"] == "chat":
        return chat.warm_start_sequences(tokenizer, chat_tags(tokenizer), splits["logged"], splits["rl"])
    if cfg["rehearsal_context"] == "separate":
        return separate_warm_start_sequences(cfg, tokenizer, splits, examples)
    seqs = [encode_episode(tokenizer, t["prompt"], t["calls"], t.get("responses") or world.replay(t["calls"]),
                           t["answer"]) for t in splits["logged"]]
    seqs += [encode_episode(tokenizer, s["prompt"], s["calls"], world.replay(s["calls"]), act_role=PROMPT)
             for s in world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"], cfg["coverage"])]
    return seqs


def separate_warm_start_sequences(cfg, tokenizer, splits, examples=None):
    """rehearsal_context separate: the rows RL trains, from the same logged data, one group of
    rows ({"rows": [...]}) per logged episode or tool snippet, so that a warm-start step trains
    the same calls and responses as inline. An expert episode: its actor row (responses OBS:
    context here) and a rehearse row per call (rehearse.rehearsal_rows: dialogue so far + call ->
    response, REHEARSE, with the grounding `examples`), the prompt format RL rehearses in. A
    tool snippet: a rehearse row per call."""
    seqs = []
    for t in splits["logged"]:
        responses = t.get("responses") or world.replay(t["calls"])
        episode = {**encode_episode(tokenizer, t["prompt"], t["calls"], responses, t["answer"]),
                   "calls": t["calls"], "responses": responses}
        seqs.append({"rows": [episode] + rehearse.rehearsal_rows(tokenizer, episode, examples)})
    for s in world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"], cfg["coverage"]):
        responses = world.replay(s["calls"])
        episode = {**encode_episode(tokenizer, s["prompt"], s["calls"], responses, act_role=PROMPT),
                   "calls": s["calls"], "responses": responses}
        seqs.append({"rows": rehearse.rehearsal_rows(tokenizer, episode, examples)})
    return seqs


def separate_prompt(cfg, tokenizer):
    """The chat rehearse prompt builder for sample_separate (with grounding_examples of the task's
    examples); None for the toy's plain format (rehearse.rehearse_prompt with `examples`)."""
    return functools.partial(chat.separate_prompt, tokenizer, cfg["grounding_examples"]) \
        if cfg["format"] == "chat" else None


def logged_examples(cfg, splits):
    """examples(call) -> `grounding_examples` logged (call, response) pairs of the called tool, for
    the separate rehearse prompt (rehearse.grounding), from the warm-start data: the logged
    trajectories, then the tool traffic. No pairs when grounding_examples is 0. None for chat (its
    examples are the tasks' own: chat.task_examples)."""
    if cfg["format"] != "plain":
        return None
    trajectories = [(t["calls"], t.get("responses") or world.replay(t["calls"])) for t in splits["logged"]]
    trajectories += [(s["calls"], world.replay(s["calls"])) for s in
                     world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"], cfg["coverage"])]
    return rehearse.grounding(trajectories, cfg["grounding_examples"])


def warm_start_call_counts(cfg, splits):
    """How often each exact call appears in the warm-start data (for fidelity by coverage)."""
    calls = [c for t in splits["logged"] for c in t["calls"]]
    if cfg["format"] == "chat":
        return Counter(calls + [json.dumps(c, ensure_ascii=False) for t in splits["rl"]
                                for c, _ in t.get("examples", [])])
    calls += [c for s in world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"], cfg["coverage"])
              for c in s["calls"]]
    return Counter(calls)


# ----------------------------------------------------------------------------- micro-batches

def rows(tensor, index, length):
    """tensor[index, :length]: one micro-batch, cut to its longest row."""
    return tensor[index, :length]


# ----------------------------------------------------------------------------- warm start

def warm_start(model, ddp_model, sequences, cfg, pad_id, rank=0, world_size=1):
    """Teacher-forced cross-entropy on ACT, REHEARSE and OBS tokens, token mean over the global
    batch, AdamW with cosine decay. Environment tokens are trained too: the initial world model.
    (Separate context: see warm_start_roles.)
    Every rank draws the same global batch (same seed) and trains on its slice of it, in
    length-grouped micro-batches. A sequence may be a group of rows ({"rows": [...]}, separate
    context): drawn as one, so sft_batch_size counts logged episodes in both contexts."""
    if cfg["sft_steps"] == 0 or not sequences:
        return
    device = next(model.parameters()).device
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["sft_lr"], weight_decay=cfg["weight_decay"])
    rng = random.Random(cfg["seed"])
    per_rank = cfg["sft_batch_size"] // world_size
    model.train()
    bar = tqdm(range(cfg["sft_steps"]), desc="warm start", dynamic_ncols=True, disable=rank != 0)
    for it in bar:
        lr = cfg["sft_lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * it / cfg["sft_steps"])))
        for group in opt.param_groups:
            group["lr"] = lr
        batch = rng.sample(sequences, min(cfg["sft_batch_size"], len(sequences)))
        batch = [row for s in batch[rank * per_rank:(rank + 1) * per_rank] for row in s.get("rows", [s])]
        ids, roles = collate(batch, pad_id)
        ids, roles = ids.to(device), roles.to(device)
        mask = loss_mask(roles, trained=warm_start_roles(cfg)).float()
        n_tokens = all_sum([mask.sum().item()])[0]
        lengths = [len(s["ids"]) for s in batch]
        total = 0.0
        opt.zero_grad(set_to_none=True)
        batches = micro_batches(lengths, cfg["micro_batch_tokens"])
        for index, n, weight in in_step(batches, lengths, ddp_model):
            index = index.to(device)
            with autocast(cfg, device):
                logprobs = token_logprobs(ddp_model, rows(ids, index, n))
            loss = -(logprobs * rows(mask, index, n - 1)).sum() / n_tokens * weight
            (loss * world_size).backward()  # DDP averages over ranks; x world_size makes it the sum
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"] or float("inf"))
        opt.step()
        if it % 10 == 0:
            bar.set_postfix(loss=f"{all_sum([total])[0]:.3f}", lr=f"{lr:.1e}")
    model.eval()


def warm_start_roles(cfg):
    """The roles the warm start trains. Inline: ACT, REHEARSE and the logged responses (OBS), the
    initial world model. Separate: ACT and REHEARSE, as in RL: the world model is trained in the
    rehearse rows, and the responses in actor rows are context only."""
    return (ACT, REHEARSE) if cfg["rehearsal_context"] == "separate" else (ACT, REHEARSE, OBS)


def in_step(batches, lengths, ddp_model):
    """Yield (row index, longest length, weight) per micro-batch, the same number of times on
    every rank, as DDP needs: a rank with fewer micro-batches than another (or none) repeats
    its first one (or row 0) with weight 0, a forward/backward that adds nothing. Under DDP the
    gradient all-reduce fires on the last micro-batch only (nanoGPT's flag: no_sync() would
    split this loop in two). Under FSDP every backward reduce-scatters, the same number of times
    on every rank: set_requires_gradient_sync(False) would keep whole unsharded gradients, the
    memory that FSDP is there to save."""
    batches = [b for b in batches if b]          # micro_batches([]) is [[]]: a rank with no kept rows
    n = int(all_max(len(batches)))
    for j in range(n):
        if isinstance(ddp_model, DDP):
            ddp_model.require_backward_grad_sync = j == n - 1
        index = batches[j] if j < len(batches) else (batches + [[0]])[0]
        yield torch.tensor(index), max(lengths[i] for i in index), float(j < len(batches))


# ----------------------------------------------------------------------------- RL

def make_batch(episodes, rewards, group_ids, cfg, pad_id):
    """Episodes -> tensors for the update: ids [B, L], roles [B, L], and over targets [B, L-1]
    the loss mask (ACT/REHEARSE targets whose coefficient is > 0), per-token advantages and the
    sampler's logprobs. n_tokens counts this process's trained tokens (rl_step makes it global)."""
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
             "all_equal_groups": all_equal, "n_groups": len(set(group_ids))}
    batch["kl_coefs"] = token_kl_coefs(roles, cfg["kl_coef"], cfg["kl_rehearse_coef"])
    batch["n_tokens"] = max(int(batch["mask"].sum()), 1)
    return batch


def token_kl_coefs(roles, kl_coef, kl_rehearse_coef):
    """[B, L] roles -> [B, L-1] coefficient of the KL to the reference per target: `kl_coef` on
    ACT targets, `kl_rehearse_coef` on REHEARSE targets, 0 elsewhere. The KL is added only where
    the loss mask is, so a role whose coefficient (act_coef/rehearse_coef) is 0 gets none."""
    # token_advantages with A = 1 per row puts each role's coefficient on its targets, with the
    # same shift by one as the advantages (target t+1 is predicted at position t)
    return token_advantages(roles, torch.ones(roles.shape[0]), kl_coef, kl_rehearse_coef)


def uses_kl(cfg):
    """Whether the update needs the reference's logprobs (either role's KL coefficient > 0)."""
    return cfg["kl_coef"] > 0 or cfg["kl_rehearse_coef"] > 0


@torch.no_grad()
def batch_logprobs(model, ids, lengths, cfg):
    """No-grad fp32 logprobs of every target [B, L-1], in length-grouped micro-batches."""
    out = torch.zeros(ids.shape[0], ids.shape[1] - 1, device=ids.device)
    for index in micro_batches(lengths, cfg["micro_batch_tokens"]):
        n = max(lengths[i] for i in index)
        index = torch.tensor(index, device=ids.device)
        out[index, :n - 1] = token_logprobs(model, rows(ids, index, n), cfg["temperature"])
    return out


def reuse_sampler_logprobs(cfg, device):
    """The sampler recorded every sampled token's fp32 logprob at the sampling temperature from
    the same weights: the old-logprob forward would recompute the same numbers (within 1e-5,
    tested), so it is skipped. Not under bf16 autocast, where a cached one-token decode and a
    full forward round differently: there the forward is redone."""
    return cfg["reuse_sampler_logprobs"] and not isinstance(autocast(cfg, device), torch.autocast)


def accumulate_gradients(model, batch, old, ref, cfg, world_size=1):
    """Forward/backward every length-grouped micro-batch. Each loss is already divided by the
    batch's total trained tokens (all micro-batches, all ranks), so the accumulated .grad equals
    that of one forward over the whole global batch, whatever the micro-batching and the number
    of ranks. `model` may be DDP-wrapped. Returns this rank's stats (sums that add over ranks)."""
    device = old.device
    ids, mask, adv = batch["ids"].to(device), batch["mask"].to(device), batch["advantages"].to(device)
    target_roles = batch["roles"][:, 1:].to(device)
    lengths = batch["lengths"]
    # a row whose advantages are all 0 (an all-equal group) and whose trained tokens carry no KL
    # adds exactly 0 to the gradient: leave it out of the forward (its tokens stay in n_tokens)
    kl_coefs = batch["kl_coefs"].to(device) * mask
    keep = [i for i in range(len(lengths))
            if (ref is not None and kl_coefs[i].any()) or batch["advantages"][i].any()]
    kept_lengths = [lengths[i] for i in keep]
    batches = [[keep[j] for j in b] for b in micro_batches(kept_lengths, cfg["micro_batch_tokens"])]
    totals = {"loss": 0.0, "entropy_act": 0.0, "entropy_rehearse": 0.0, "entropy_count_act": 0,
              "entropy_count_rehearse": 0, "rows_updated": len(keep),
              "pad_frac": padded_fraction(lengths, batches) / world_size if keep else 0.0}
    for index, n, weight in in_step(batches, lengths, model):
        index = index.to(device)
        with autocast(cfg, device):
            new, entropy = token_logprobs(model, rows(ids, index, n), cfg["temperature"], with_entropy=True)
        loss, stats = clipped_pg_loss(new, rows(old, index, n - 1), rows(adv, index, n - 1),
                                      rows(mask, index, n - 1), batch["n_tokens"],
                                      None if ref is None else rows(ref, index, n - 1),
                                      cfg["eps_low"], cfg["eps_high"], cfg["dual_clip"],
                                      rows(kl_coefs, index, n - 1))
        (loss * weight * world_size).backward()   # DDP averages ranks; x world_size makes it the sum
        totals["loss"] += loss.item() * weight
        for k, v in stats.items():
            totals[k] = totals.get(k, 0.0) + v * weight
        roles_mb = rows(target_roles, index, n - 1)
        for r, name in ((ACT, "act"), (REHEARSE, "rehearse")):
            totals[f"entropy_{name}"] += float((entropy.detach() * (roles_mb == r)).sum()) * weight
            totals[f"entropy_count_{name}"] += int((roles_mb == r).sum()) * weight
        if ref is not None:
            add_role_kl(totals, new.detach(), rows(ref, index, n - 1),
                        roles_mb * rows(mask, index, n - 1), weight)
    return totals


def add_role_kl(totals, new, ref, trained_roles, weight):
    """Sum and count of the k3 KL to the reference per role over trained targets (trained_roles:
    the target's role where trained, 0 = PROMPT elsewhere), for the per-role KL in metrics."""
    d = ref - new
    kl = torch.exp(d) - d - 1
    for r, name in ((ACT, "act"), (REHEARSE, "rehearse")):
        sel = trained_roles == r
        totals[f"kl_sum_{name}"] = totals.get(f"kl_sum_{name}", 0.0) + float((kl * sel).sum()) * weight
        totals[f"kl_count_{name}"] = totals.get(f"kl_count_{name}", 0) + int(sel.sum()) * weight


def rl_step(model, ddp_model, opt, episodes, rewards, group_ids, cfg, pad_id, reference=None,
            world_size=1):
    """One policy update from this rank's episodes. Returns (sums, status): metric sums that add
    up over ranks, and "updated", "skipped" (no group on any rank had reward variance: zero
    advantage, zero signal) or "nonfinite" (loss or gradient not finite: weights and optimizer
    left untouched). Every rank takes the same branch, so collectives stay in step."""
    batch = make_batch(episodes, rewards, group_ids, cfg, pad_id)
    n_tokens, groups_with_signal = all_sum([batch["n_tokens"], batch["n_groups"] - batch["all_equal_groups"]])
    batch["n_tokens"] = int(n_tokens)                     # the global normaliser
    target_roles = batch["roles"][:, 1:]
    sums = {"all_equal_groups": batch["all_equal_groups"]}
    for r, name in ((ACT, "act"), (REHEARSE, "rehearse"), (OBS, "obs")):
        sel = target_roles == r
        sums[f"tokens_{name}"] = int(sel.sum())
        sums[f"adv_sum_{name}"] = float(batch["advantages"][sel].sum())
    if groups_with_signal == 0:
        return sums, "skipped"
    device = next(model.parameters()).device
    t0 = time.time()
    ids = batch["ids"].to(device)
    with autocast(cfg, device):
        if reuse_sampler_logprobs(cfg, device):
            old = batch["sampled_logprobs"].to(device)
        else:               # the sampling policy's logprobs recomputed: same weights, fp32 softmax
            with gathered(model):
                old = batch_logprobs(model, ids, batch["lengths"], cfg)
        with gathered(reference):
            ref = None if reference is None else batch_logprobs(reference, ids, batch["lengths"], cfg)
    sums["time_logprobs"] = time.time() - t0
    t0 = time.time()
    model.train()
    status = "updated"
    for _ in range(cfg["ppo_epochs"]):
        opt.zero_grad(set_to_none=True)
        totals = accumulate_gradients(ddp_model, batch, old, ref, cfg, world_size)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg["grad_clip"] or float("inf"))
        # the gradients are synchronised, so grad_norm is the same on every rank; the loss is not
        if not math.isfinite(grad_norm) or all_sum([not math.isfinite(totals["loss"])])[0]:
            opt.zero_grad(set_to_none=True)
            status = "nonfinite"
            break
        opt.step()
    model.eval()
    sums.update(totals)
    sums["grad_norm"] = float(grad_norm) / world_size    # the same on every rank: sums to it once
    sums["time_update"] = time.time() - t0
    return sums, status


def episode_sums(episodes, rewards, env_mode, tasks=None, fidelity_world=world):
    """This rank's episode-level metric sums (they add up over ranks). tasks: one per episode, for
    the collusion counts (toy tasks only); fidelity_world: the world that replays the calls for
    rehearsal fidelity (None: no real world exists for these tasks)."""
    sums = {"n_episodes": len(episodes), "reward_sum": sum(rewards),
            "calls_sum": sum(len(e["calls"]) for e in episodes),
            "n_tok": sum(len(r["ids"]) for e in episodes for r in [e] + e.get("rehearsals", [])),
            "rehearse_rows": sum(len(e.get("rehearsals", [])) for e in episodes),
            "causes": cause_counts(episodes)}
    if env_mode in ("rehearse", "frozen") and fidelity_world is not None:   # diagnostic only
        sums["fidelity"] = rehearse.replay_fidelity(episodes, fidelity_world)
        if tasks is not None:
            sums["collusion"] = rehearse.collusion_counts(episodes, tasks)
    return sums


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
        record["fidelity"] = rehearse.rates(s["fidelity"])
        record["fidelity_counts"] = s["fidelity"]
    if "collusion" in s:
        record["collusion"] = rehearse.collusion_rate(s["collusion"])
    for name in ("act", "rehearse"):      # k3 KL to the reference per role, over trained targets
        if s.get(f"kl_count_{name}"):
            record[f"kl_ref_{name}"] = s[f"kl_sum_{name}"] / s[f"kl_count_{name}"]
    record.update(times)
    record["tok_per_s"] = s["n_tok"] / times["time_step"]
    return record


# ----------------------------------------------------------------------------- checkpoints

MODEL_SHAPE_KEYS = ("model", "n_layer", "n_embd", "n_head")


def save_state(out, model, tokenizer, opt, step, config_text, progress, generator, task_rng):
    """The resumable checkpoint <out>/ckpt: model + tokenizer (save_pretrained), config.yaml and
    trainer_state.pt (step, optimizer, every rank's RNG states, counters). Collective: every rank
    calls it (to hand in its RNG states); rank 0 writes, atomically (envace.save_checkpoint)."""
    rngs = all_gather({"python": random.getstate(), "numpy": np.random.get_state(),
                       "torch": torch.get_rng_state(), "generator": generator.get_state(),
                       "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []})
    weights, optimizer = full_state_dict(model), optimizer_state(model, opt)     # FSDP: collectives
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    state = {"step": step, "optimizer": optimizer, "rngs": rngs, "task_rng": task_rng.getstate(),
             "progress": progress}
    save_checkpoint(model, tokenizer, os.path.join(out, "ckpt"), {"config.yaml": config_text}, state, weights)


def load_state(cfg, device, world_size):
    """(model, tokenizer, trainer state) of <out_dir>/ckpt for --resume, with clear errors."""
    path = find_checkpoint(os.path.join(cfg["out_dir"], "ckpt"))
    if path is None or not os.path.isfile(os.path.join(path, "trainer_state.pt")):
        raise ConfigError(f"--resume: no checkpoint in {cfg['out_dir']}/ckpt to resume; "
                          f"run without --resume to start, or set --out_dir")
    with open(os.path.join(path, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    for key in MODEL_SHAPE_KEYS:
        if saved.get(key) != cfg[key]:
            raise ConfigError(f"--resume: the checkpoint in {path} has {key}={saved.get(key)!r} but "
                              f"the config says {key}={cfg[key]!r}: another model shape")
    if world_size > 1 and saved.get("fsdp", False) != cfg["fsdp"]:
        raise ConfigError(f"--resume: the checkpoint in {path} was saved with fsdp={saved.get('fsdp', False)}, "
                          f"the config says fsdp={cfg['fsdp']}: the optimizer state would not load")
    model, tokenizer = load_policy(path, device)
    state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    if len(state["rngs"]) != world_size:
        raise ConfigError(f"--resume: the checkpoint was saved by {len(state['rngs'])} processes, "
                          f"this run has {world_size}: RNG streams would not continue")
    return model, tokenizer, state


def restore_rngs(rngs, generator):
    random.setstate(rngs["python"])
    np.random.set_state(rngs["numpy"])
    torch.set_rng_state(rngs["torch"])
    generator.set_state(rngs["generator"])
    if rngs["cuda"]:
        torch.cuda.set_rng_state_all(rngs["cuda"])


class StopRequest:
    """SIGINT/SIGTERM set a flag; the RL loop finishes its step, saves and exits cleanly."""

    def __init__(self):
        self.signal = None

    def __enter__(self):
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def handle(self, signum, frame):
        self.signal = signum

    def __exit__(self, *exc):
        for s, handler in self.previous.items():
            signal.signal(s, handler)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ----------------------------------------------------------------------------- main

def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    resume = "--resume" in argv
    argv = [a for a in argv if a != "--resume"]
    if not any(a == "--config" or a.startswith("--config=") for a in argv):
        print("usage: python train.py --config small.yaml [--key=value ...] [--resume]", file=sys.stderr)
        return 2
    i = next(i for i, a in enumerate(argv) if a.startswith("--config"))
    flag = argv.pop(i)
    path = flag.split("=", 1)[1] if "=" in flag else (argv.pop(i) if i < len(argv) else "")
    try:
        if not path:
            raise ConfigError("--config needs a path, e.g. --config small.yaml")
        return run(load_config(path, argv), resume)
    except ConfigError as e:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run(cfg, resume=False):
    """The whole run for a checked config dict. Returns 0 when done or interrupted cleanly, 1 if
    non-finite steps stopped it, 2 if the fidelity gate stopped it."""
    rank, world_size, device = setup_distributed(cfg)
    main_process = rank == 0
    log = print if main_process else (lambda *a, **k: None)
    for key in ("tasks_per_step", "sft_batch_size"):
        if cfg[key] % world_size:
            raise ConfigError(f"{key} ({cfg[key]}) must be divisible by the number of processes "
                              f"({world_size})")
    out = cfg["out_dir"]
    config_text = yaml.safe_dump(cfg, sort_keys=False)
    splits = build_tasks(cfg)                       # bad data files stop the run here
    counts = warm_start_call_counts(cfg, splits)
    seed_everything(cfg["seed"])

    # 1. model, tokenizer, warm start (or the checkpoint to resume)
    state = None
    load_to = "cpu" if cfg["fsdp"] and world_size > 1 else device     # FSDP moves each rank's shard only
    if resume:
        model, tokenizer, state = load_state(cfg, load_to, world_size)
    elif cfg["model"] == "tiny":
        separate_words = world.SEPARATE_WORDS if cfg["rehearsal_context"] == "separate" else []
        tokenizer = build_tokenizer(world.WORDS + separate_words)
        model = build_model(cfg, tokenizer).to(load_to)
    else:
        model, tokenizer = load_policy(cfg["model"], load_to, cfg["model_init"])
    if cfg["format"] == "chat":              # a template that does not fit stops the run here
        check_chat_prompts(cfg, tokenizer, splits["rl"] + splits["test"])
    score = task_reward if cfg["format"] == "plain" else functools.partial(
        chat_reward, judge=load_judge(cfg, device))
    check_separate_vocabulary(cfg, tokenizer)
    examples = logged_examples(cfg, splits)
    n_params = sum(p.numel() for p in model.parameters())
    if cfg["model"] != "tiny":                # the demo's 1M-parameter model needs no estimate
        log(memory_line(memory_estimate(n_params, cfg, model.config, world_size), cfg, world_size))
    ddp_model = parallel_model(model, cfg, device, world_size)
    if main_process:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "config.yaml"), "w") as f:
            f.write(config_text)
    log(f"model: {n_params / 1e6:.2f}M parameters, vocab "
        f"{len(tokenizer)} | tasks: {len(splits['logged'])} logged, {len(splits['rl'])} RL, "
        f"{len(splits['test'])} test | device {device} x {world_size} process(es)")
    t_start = time.time()
    amp = autocast(cfg, device)

    def real_world_eval(path=None, **extra):
        """The held-out test tasks in the real world (rank 0 calls it), written to `path`."""
        with amp:
            result = evaluate(model, tokenizer, splits["test"], cfg, seed=cfg["seed"],
                              warm_start_counts=counts, examples=examples)
        if path:
            with open(path, "w") as f:
                json.dump({**result, **extra}, f, indent=1)
        return result

    def rank0_eval(path=None, **extra):
        """real_world_eval on rank 0, its result on every rank (FSDP: all ranks gather first)."""
        with gathered(model):
            return from_rank0(lambda: real_world_eval(path, **extra))

    if state is None:
        warm_start(model, ddp_model, warm_start_sequences(cfg, tokenizer, splits, examples), cfg,
                   tokenizer.pad_token_id, rank, world_size)
        weights = full_state_dict(model)                 # FSDP: gathered to rank 0 (a collective)
        if main_process:
            save_checkpoint(model, tokenizer, os.path.join(out, "warmstart"), {"config.yaml": config_text},
                            state_dict=weights)

        # 2. real-world evaluation of the warm start, and the fidelity gate
        before = rank0_eval(os.path.join(out, "warmstart", "eval.json"))
        log(f"warm start ({time.time() - t_start:.0f}s): {summary(before)}")
        low = {k: v for k, v in before["fidelity"].items() if v < cfg["min_fidelity"]}
        rehearsed = cfg["env_mode"] in ("rehearse", "frozen")     # the modes whose rewards it feeds
        if not before.get("fidelity_measured", True):
            log("fidelity gate skipped: these tasks have no real environment to compare rehearsals with")
        elif rehearsed and cfg["min_fidelity"] > 0 and (low or not before["fidelity"]):
            log(f"fidelity gate FAILED: {low or 'no calls made'} below min_fidelity "
                f"{cfg['min_fidelity']}: rehearsed rewards would be noise for these tools. Raise "
                f"snippet_repeats/sft_steps/coverage, or set --min_fidelity=0 to run anyway.")
            return 2
        else:
            log(f"fidelity gate passed: every tool kind >= {cfg['min_fidelity']} ({cfg['env_mode']} mode)")

    # 3. RL
    reference = None
    if uses_kl(cfg) or cfg["env_mode"] == "frozen":      # the frozen warm start
        reference = (copy.deepcopy(model) if state is None and not cfg["fsdp"] else   # no deepcopy of shards
                     load_policy(os.path.join(out, "warmstart"), load_to)[0]).eval().requires_grad_(False)
        if cfg["fsdp"] and world_size > 1:
            shard(reference, device, world_size, isinstance(amp, torch.autocast))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    generator = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)   # each rank its own stream
    task_rng = random.Random(cfg["seed"])                                   # the same on every rank
    progress = {"before": None if state is None else state["progress"]["before"], "skipped_steps": 0,
                "nonfinite_steps": 0, "nonfinite_in_a_row": 0, "real_success": None}
    first_step = 1
    if state is None:
        progress["before"] = before
        progress["real_success"] = before["success"]
        save_state(out, model, tokenizer, opt, 0, config_text, progress, generator, task_rng)
    else:
        load_optimizer_state(model, opt, state["optimizer"])
        progress.update(state["progress"])
        task_rng.setstate(state["task_rng"])
        restore_rngs(state["rngs"][rank], generator)
        first_step = state["step"] + 1
        log(f"resumed from {out}/ckpt at step {state['step']}")
    before = progress["before"]
    metrics_path = os.path.join(out, "metrics.jsonl")
    if main_process:        # keep the lines of the steps the checkpoint has; a resume rewrites the rest
        kept = [] if state is None or not os.path.exists(metrics_path) else [
            line for line in open(metrics_path) if json.loads(line)["step"] < first_step]
        with open(metrics_path, "w") as f:
            f.writelines(kept)
    per_rank = cfg["tasks_per_step"] // world_size
    sampler = sample_episodes          # separate context: each rehearsal in a row of its own
    if cfg["rehearsal_context"] == "separate" and cfg["env_mode"] in ("rehearse", "frozen"):
        sampler = functools.partial(sample_separate, examples=examples,
                                    rehearse_prompt=separate_prompt(cfg, tokenizer))
    bar = tqdm(range(first_step, cfg["rl_steps"] + 1), desc=f"RL ({cfg['env_mode']})",
               dynamic_ncols=True, disable=not main_process)
    with StopRequest() as stop:
        for step in bar:
            t0 = time.time()
            tasks = task_rng.sample(splits["rl"], cfg["tasks_per_step"])        # the same on every rank
            tasks = tasks[rank * per_rank:(rank + 1) * per_rank]
            prompts, task_worlds, tags = rollout_inputs(cfg, tokenizer, tasks)
            with amp, gathered(model), gathered(reference if cfg["env_mode"] == "frozen" else None):
                episodes = sampler(
                    model, tokenizer, prompts, cfg["env_mode"], world=task_worlds, tags=tags,
                    env_model=reference if cfg["env_mode"] == "frozen" else None,
                    temperature=cfg["temperature"], top_p=cfg["top_p"], max_turns=cfg["max_turns"],
                    max_act_tokens=cfg["max_act_tokens"], max_env_tokens=cfg["max_env_tokens"],
                    max_tokens=cfg["max_tokens"], generator=generator, rehearse_check=cfg["rehearse_check"])
            time_sample = time.time() - t0
            group_ids = [i // cfg["group_size"] for i in range(len(episodes))]
            rewards = [score(e, tasks[g]) for e, g in zip(episodes, group_ids)]
            update_rows, row_rewards, row_groups = training_rows(episodes, rewards, group_ids,
                                                                 cfg["advantage_groups"])
            sums, status = rl_step(model, ddp_model, opt, update_rows, row_rewards, row_groups, cfg,
                                   tokenizer.pad_token_id, reference if uses_kl(cfg) else None,
                                   world_size)
            progress["skipped_steps"] += status == "skipped"
            progress["nonfinite_steps"] += status == "nonfinite"
            progress["nonfinite_in_a_row"] = (progress["nonfinite_in_a_row"] + 1) * (status == "nonfinite")
            fidelity_world = world if cfg["format"] == "plain" else (
                task_worlds[0] if all(t.get("env") == "toy" for t in tasks) else None)
            step_tasks = [tasks[g] for g in group_ids] if cfg["format"] == "plain" else None
            total = add_up(all_gather({**sums, **episode_sums(episodes, rewards, cfg["env_mode"],
                                                              step_tasks, fidelity_world)}))
            times = {"time_sample": time_sample, "time_logprobs": sums.get("time_logprobs", 0.0),
                     "time_update": sums.get("time_update", 0.0), "time_step": time.time() - t0}
            counters = {k: progress[k] for k in ("skipped_steps", "nonfinite_steps")}
            record = metrics_record(step, total, status, counters, times)
            if cfg["eval_every"] and step % cfg["eval_every"] == 0 and step < cfg["rl_steps"]:
                progress["real_success"] = rank0_eval()["success"]
                record["eval_success"] = progress["real_success"]
                bar.write(f"step {step}: real-world success {progress['real_success']:.3f} (reward "
                          f"in the {cfg['env_mode']} world this step {record['reward']:.3f})")
            if main_process:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(record) + "\n")
            bar.set_postfix(reward=f"{record['reward']:.3f}", real=f"{progress['real_success']:.3f}",
                            skip=progress["skipped_steps"], tok_s=f"{record['tok_per_s']:.0f}")
            stopping = all_sum([stop.signal is not None])[0] > 0      # any rank signalled: all stop
            if progress["nonfinite_in_a_row"] >= 3:
                save_state(out, model, tokenizer, opt, step, config_text, progress, generator, task_rng)
                log(f"\nstopping: 3 non-finite steps in a row (up to step {step}); the last good "
                    f"weights are saved in {out}/ckpt. Lower lr or check the data.")
                return 1
            if stopping or (cfg["save_every"] and step % cfg["save_every"] == 0) or step == cfg["rl_steps"]:
                save_state(out, model, tokenizer, opt, step, config_text, progress, generator, task_rng)
            if stopping:
                log(f"\ninterrupted: checkpoint of step {step} saved in {out}/ckpt. Resume with:\n"
                    f"  python train.py --config {os.path.join(out, 'config.yaml')} --resume")
                return 0

    # 4. evaluate the final policy in the real world
    after = rank0_eval(os.path.join(out, "eval.json"), before=before)
    log(f"before RL: {summary(before)}")
    log(f"after RL:  {summary(after)}")
    log(f"real-world success {before['success']:.3f} -> {after['success']:.3f} ({cfg['env_mode']} "
        f"mode, {cfg['rl_steps']} steps, {progress['skipped_steps']} skipped, "
        f"{progress['nonfinite_steps']} non-finite, {time.time() - t_start:.0f}s); saved to {out}/ckpt")
    return 0


if __name__ == "__main__":
    sys.exit(main())
