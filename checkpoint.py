"""Models in and out: the demo's tiny model, loading a policy, atomic checkpoints, exact resume.

    python train.py --config small.yaml --resume     # continue out_dir/ckpt where it stopped

`save_checkpoint` writes a whole folder (save_pretrained + config.yaml + trainer_state.pt) to
<path>.tmp and swaps it in by two renames, so a crash leaves a complete checkpoint at <path> or
<path>.old (`find_checkpoint` looks at both). `save_state` adds what `--resume` needs to continue
the same run exactly: the step, the optimizer, every rank's RNG states and the counters. Ctrl-C
or SIGTERM (`StopRequest`) lets the RL loop finish its step, save and exit 0.
"""
import copy
import os
import random
import shutil
import signal

import numpy as np
import torch
import torch.distributed as dist
import yaml

from config import ConfigError
from distributed import (all_gather, autocast, full_state_dict, load_device, load_optimizer_state, optimizer_state,
                         shard)
from envace import TAGS


def build_tokenizer(words):
    """A word-level tokenizer (digits split one per token) wrapped as a transformers tokenizer, so
    that save_pretrained / from_pretrained work exactly as for a real model's tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(list(TAGS.values()) + list(words))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=TAGS["unk"]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)   # joins tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=TAGS["bos"],
                                   pad_token=TAGS["pad"], unk_token=TAGS["unk"])



def build_model(cfg, tokenizer):
    """`model: tiny` builds a small Llama from the config's n_layer/n_embd/n_head (random init,
    seeded); any other value is a local path or hub name loaded with from_pretrained."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    if cfg["model"] != "tiny":
        return AutoModelForCausalLM.from_pretrained(cfg["model"], dtype=torch.float32)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=cfg["n_embd"],
                         intermediate_size=4 * cfg["n_embd"], num_hidden_layers=cfg["n_layer"],
                         num_attention_heads=cfg["n_head"], num_key_value_heads=cfg["n_head"],
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids(TAGS["act_end"]))
    torch.manual_seed(cfg["seed"])
    return LlamaForCausalLM(config)



def save_checkpoint(model, tokenizer, path, extra_files=None, state=None, state_dict=None):
    """save_pretrained for model and tokenizer, plus `extra_files` ({name: text}) and an optional
    trainer `state` (torch.save), written whole to <path>.tmp and then swapped in by two renames
    (<path> -> <path>.old, <path>.tmp -> <path>). A crash at any moment leaves a complete
    checkpoint at <path> or at <path>.old (find_checkpoint looks at both), never a half-written one.
    `state_dict`: the weights to write instead of the model's own (a sharded model's, gathered)."""
    tmp, old = path + ".tmp", path + ".old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, state_dict=state_dict)
    tokenizer.save_pretrained(tmp)
    for name, text in (extra_files or {}).items():
        with open(os.path.join(tmp, name), "w") as f:
            f.write(text)
    if state is not None:
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
    if os.path.isdir(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)



def find_checkpoint(path):
    """`path`, or `path`.old if a crash struck between save_checkpoint's two renames; else None."""
    for candidate in (path, path + ".old"):
        if os.path.isfile(os.path.join(candidate, "config.json")):
            return candidate
    return None


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


def reference_model(model, cfg, device, world_size, warmstart_path, fresh, needed):
    """The frozen warm start (KL reference, frozen simulator) or None if not `needed`: a copy of
    `model` right after its warm start (`fresh`), else loaded from `warmstart_path` (a resumed
    run, or FSDP, whose shards cannot be deep-copied); sharded like the policy under FSDP."""
    if not needed:
        return None
    sharded = cfg["fsdp"] and world_size > 1
    reference = copy.deepcopy(model) if fresh and not cfg["fsdp"] else \
        load_policy(warmstart_path, load_device(cfg, device, world_size))[0]
    reference.eval().requires_grad_(False)
    if sharded:
        shard(reference, device, world_size, isinstance(autocast(cfg, device), torch.autocast))
    return reference


def rl_state(model, tokenizer, cfg, state, before, rank, log):
    """(optimizer, the sampler's generator, the task RNG, progress counters, first step): new ones
    saved as checkpoint 0 after the warm start, or those of the checkpoint being resumed."""
    opt = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    generator = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)   # each rank its own stream
    task_rng = random.Random(cfg["seed"])                                   # the same on every rank
    progress = {"skipped_steps": 0, "nonfinite_steps": 0, "nonfinite_in_a_row": 0}
    if state is None:
        progress.update(before=before, real_success=before["success"])
        save_state(cfg["out_dir"], model, tokenizer, opt, 0, yaml.safe_dump(cfg, sort_keys=False), progress,
                   generator, task_rng)
        return opt, generator, task_rng, progress, 1
    load_optimizer_state(model, opt, state["optimizer"])
    progress.update(state["progress"])
    task_rng.setstate(state["task_rng"])
    restore_rngs(state["rngs"][rank], generator)
    log(f"resumed from {cfg['out_dir']}/ckpt at step {state['step']}")
    return opt, generator, task_rng, progress, state["step"] + 1
