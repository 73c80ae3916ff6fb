"""Models in and out: the demo's tiny model, loading a policy, atomic checkpoints, exact resume.

    python train.py --config small.yaml --resume     # continue out_dir/ckpt where it stopped

`save_checkpoint` writes a whole folder (save_pretrained + config.yaml + trainer_state.pt) to
<path>.tmp and swaps it in by two renames, so a crash leaves a complete checkpoint at <path> or
<path>.old (`find_checkpoint` looks at both). A write the file system refuses (a file in the way,
no permission, a full disk) is a CheckpointError, one line naming the path, and leaves the previous
checkpoint where it was. A damaged checkpoint (a truncated weights file, a broken config.json, a
missing tokenizer...) is found by `damaged_file`, which names the file; `find_checkpoint` then
falls back to a whole <path>.old. `save_state` adds what `--resume` needs to continue
the same run exactly: the step, the optimizer, every rank's RNG states and the counters; a
finished warm start is resumed only under the keys that made it (`check_warm_start`). Ctrl-C
or SIGTERM (faults.StopRequest) lets the RL loop finish its step, save and exit 0.
"""
import copy
import errno
import glob
import json
import os
import random
import shutil
import sys
import zipfile

import numpy as np
import torch
import torch.distributed as dist
import yaml
from safetensors import SafetensorError, safe_open

from machinery.config import DEFAULTS, ConfigError
from machinery.realmodel import ModelFileError, local_folder
from machinery.distributed import (adamw, all_gather, all_sum, autocast, from_rank0, full_state_dict, load_device,
                         load_optimizer_state, optimizer_state, shard)
from envace import TAGS, NonFiniteError


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
    """The demo's `model: tiny`: a small Llama from the config's n_layer/n_embd/n_head (random
    init, seeded). Any other model is loaded by `load_policy`."""
    from transformers import LlamaConfig, LlamaForCausalLM
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=cfg["n_embd"],
                         intermediate_size=4 * cfg["n_embd"], num_hidden_layers=cfg["n_layer"],
                         num_attention_heads=cfg["n_head"], num_key_value_heads=cfg["n_head"],
                         max_position_embeddings=256, tie_word_embeddings=True,
                         bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.convert_tokens_to_ids(TAGS["act_end"]))
    torch.manual_seed(cfg["seed"])
    return LlamaForCausalLM(config)


class CheckpointError(ConfigError, OSError):
    """A checkpoint the file system would not let us write: one line naming the path and the OS's
    reason (a ConfigError, so train.py prints `error: ...` and exits 2; an OSError too)."""


# what a refused write raises: OSError (folders, the tokenizer), RuntimeError (torch.save's zip
# writer on a full disk), SafetensorError (save_pretrained's weights)
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)


def why(e, folder=None):
    """The OS's reason for `e` in a few words, with the disk's free space when it may be full."""
    if isinstance(e, OSError) and e.strerror:
        reason = e.strerror + (f": {e.filename}" if e.filename else "")
    else:
        reason = (str(e).splitlines() or [type(e).__name__])[0]
    full = not isinstance(e, OSError) or e.errno in (errno.ENOSPC, errno.EDQUOT)
    if full and folder is not None:
        try:
            reason += f" ({shutil.disk_usage(folder).free / 2 ** 20:.0f} MiB free on that disk)"
        except OSError:
            pass
    return reason


def file_in_the_way(folder):
    """The first of `folder` and the folders above it that exists but is not a folder, or None."""
    p = os.path.normpath(folder)
    while p and p != os.path.dirname(p):
        if os.path.lexists(p) and not os.path.isdir(p):
            return p
        p = os.path.dirname(p)
    return None


def write_file(path, text, mode="w"):
    """Write `text` to `path`, its folder made first: mode "w" whole, through a temporary file in
    the same folder renamed over `path`, so that a signal or a full disk never leaves it
    half-written and its earlier version stays until the new one is complete; mode "a" appends.
    CheckpointError naming the path if refused (a file in the way, no permission, a full disk)."""
    folder = os.path.dirname(path) or "."
    blocker = file_in_the_way(folder)
    if blocker:
        raise CheckpointError(f"cannot write {path}: {blocker} is a file, not a folder")
    target = path if mode == "a" else os.path.join(folder, ".tmp." + os.path.basename(path))
    try:
        os.makedirs(folder, exist_ok=True)
        try:
            with open(target, mode) as f:
                f.write(text)
            if target != path:
                os.replace(target, path)
        except BaseException:             # refused or interrupted: no temporary file left
            if target != path:
                _remove(target)
            raise
    except OSError as e:
        raise CheckpointError(f"cannot write {path}: {why(e, folder)}") from None


def _remove(path):
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        try:
            os.remove(path)
        except OSError:
            pass


def save_checkpoint(model, tokenizer, path, extra_files=None, state=None, state_dict=None):
    """save_pretrained for model and tokenizer, plus `extra_files` ({name: text}) and an optional
    trainer `state` (torch.save), written whole to <path>.tmp and then swapped in by two renames
    (<path> -> <path>.old, <path>.tmp -> <path>). A crash at any moment leaves a complete
    checkpoint at <path> or at <path>.old (find_checkpoint looks at both), never a half-written one.
    `state_dict`: the weights to write instead of the model's own (a sharded model's, gathered).
    A refused write (a file in the way, no permission, a full disk) is a CheckpointError naming
    the path; <path>.tmp is removed and the previous checkpoint is left where it was."""
    tmp, old = path + ".tmp", path + ".old"
    parent = os.path.dirname(path) or "."

    def refused(e, doing):
        _remove(tmp)
        kept = next((p for p in (path, old) if os.path.isdir(p)), None)
        return CheckpointError(f"cannot save the checkpoint {path} ({doing}): {why(e, parent)}; "
                               + (f"the previous checkpoint in {kept} is kept" if kept else "nothing was saved"))

    blocker = file_in_the_way(path)
    if blocker:
        raise CheckpointError(f"cannot save the checkpoint {path}: {blocker} is a file, not a folder")
    _remove(tmp)
    writing = f"the model to {tmp}"
    try:
        os.makedirs(parent, exist_ok=True)
        model.save_pretrained(tmp, state_dict=state_dict)
        writing = f"the tokenizer to {tmp}"
        tokenizer.save_pretrained(tmp)
        for name, text in (extra_files or {}).items():
            writing = os.path.join(tmp, name)
            with open(writing, "w") as f:
                f.write(text)
        if state is not None:
            writing = os.path.join(tmp, "trainer_state.pt")
            torch.save(state, writing)
    except WRITE_ERRORS as e:
        raise refused(e, f"writing {writing}") from None
    try:
        if os.path.isdir(path):
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
        os.replace(tmp, path)
    except OSError as e:        # as after a crash here: the previous checkpoint is at <path> or <path>.old
        raise refused(e, "renaming it into place") from None
    shutil.rmtree(old, ignore_errors=True)


# A checkpoint folder: save_pretrained's files (the weights one file, or shards listed in an index).
WEIGHTS = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json", "pytorch_model.bin")
JSON_FILES = ("config.json", "generation_config.json", "tokenizer_config.json", "tokenizer.json",
              "special_tokens_map.json", "added_tokens.json", "model.safetensors.index.json",
              "pytorch_model.bin.index.json")


def is_checkpoint(path):
    """Whether `path` is a folder meant as a checkpoint (damaged or not): one of its files is there."""
    return os.path.isdir(path) and any(os.path.exists(os.path.join(path, name))
                                       for name in ("config.json", "trainer_state.pt") + WEIGHTS)


def damaged_file(path, weights=True, state=False):
    """The first missing or damaged file of the checkpoint folder `path`, as "<file> is ...", or
    None when it is whole: every JSON file parses (config.json must be there), the tokenizer is
    there, the weights file (or each shard) reads (`weights`), config.yaml parses, and
    trainer_state.pt (`state`: required, with config.yaml) loads. Headers and archives are read,
    not every tensor: a truncated file is found, flipped bits inside a tensor are not."""
    def file(name):
        return os.path.join(path, name)

    for name in JSON_FILES:
        if not os.path.exists(file(name)):
            if name == "config.json":
                return f"{file(name)} is missing"
            continue
        try:
            with open(file(name), "rb") as f:
                json.loads(f.read())
        except ValueError as e:            # JSONDecodeError and UnicodeDecodeError alike
            return f"{file(name)} is not valid JSON ({str(e).splitlines()[0]})"
    if not os.path.exists(file("tokenizer_config.json")):
        return f"{file('tokenizer_config.json')} is missing (no tokenizer saved)"
    if not (os.path.exists(file("tokenizer.json")) or glob.glob(os.path.join(glob.escape(path), "*.model"))
            or glob.glob(os.path.join(glob.escape(path), "vocab.*"))):
        return f"{file('tokenizer.json')} is missing (the tokenizer's vocabulary)"
    if weights:
        name = next((n for n in WEIGHTS if os.path.exists(file(n))), None)
        if name is None:
            return f"{file('model.safetensors')} is missing (no weights file)"
        if name.endswith(".index.json"):
            with open(file(name)) as f:
                shards = sorted(set(json.load(f).get("weight_map", {}).values()))
        else:
            shards = [name]
        for shard_file in shards:
            problem = unreadable_weights(file(shard_file))
            if problem:
                return problem
    if state or os.path.exists(file("config.yaml")):
        try:
            with open(file("config.yaml")) as f:
                if not isinstance(yaml.safe_load(f), dict):
                    return f"{file('config.yaml')} is not a config (not a YAML mapping)"
        except FileNotFoundError:
            return f"{file('config.yaml')} is missing"
        except (yaml.YAMLError, ValueError) as e:
            return f"{file('config.yaml')} is not valid YAML ({str(e).splitlines()[0]})"
    if state:
        if not os.path.exists(file("trainer_state.pt")):
            return f"{file('trainer_state.pt')} is missing"
        problem = unreadable_torch_file(file("trainer_state.pt"), weights_only=False)
        if problem:
            return problem
    return None


def unreadable_weights(path):
    """Why the weights file `path` cannot be read, or None: a safetensors header that does not cover
    the file (truncated) or a torch archive that does not open."""
    if not os.path.exists(path):
        return f"{path} is missing"
    if not path.endswith(".safetensors"):
        return unreadable_torch_file(path, weights_only=True)
    try:
        with safe_open(path, "pt") as f:
            f.keys()
    except (SafetensorError, OSError) as e:
        return f"{path} is truncated or corrupt ({str(e).splitlines()[0]})"
    return None


def unreadable_torch_file(path, weights_only):
    """Why torch.load cannot read `path`, or None (the archive is opened, its tensors mapped, not read)."""
    if not zipfile.is_zipfile(path):
        return f"{path} is truncated or corrupt (not a whole torch.save archive)"
    try:
        torch.load(path, mmap=True, weights_only=weights_only)
    except Exception as e:                 # unpickling damaged bytes can raise almost anything
        return f"{path} is corrupt ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})"
    return None


def find_checkpoint(path, state=False):
    """`path`, or `path`.old if a crash struck between save_checkpoint's two renames or `path` is
    damaged (said in one line on stderr); None if neither is there; a ConfigError naming the
    damaged file if no whole one is. `state`: trainer_state.pt must load too (--resume)."""
    problems = []
    for candidate in (path, path + ".old"):
        if not is_checkpoint(candidate):
            continue
        problem = damaged_file(candidate, state=state)
        if problem is None:
            if problems and (not dist.is_initialized() or dist.get_rank() == 0):
                print(f"warning: the checkpoint {path} is damaged ({problems[0]}); using the previous "
                      f"one, {candidate}", file=sys.stderr)
            return candidate
        problems.append(problem)
    if problems:
        raise ConfigError(f"damaged checkpoint: {'; and '.join(problems)}")
    return None


def load_policy(path, device="cpu", init="pretrained"):
    """A saved policy (a folder, or a hub name) and its tokenizer, with clear errors for a missing
    or broken checkpoint. init "random": the same architecture, random weights, none loaded."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    try:
        path = local_folder(path)        # gguf:PACKAGE/FILE.gguf: converted once (machinery/realmodel.py)
    except ModelFileError as e:
        raise ConfigError(str(e)) from None
    hub_name = not os.path.exists(path) and len(path.split("/")) == 2 and not path.startswith(".")
    if not hub_name and not is_checkpoint(path):
        raise ConfigError(f"no model checkpoint in {path} (config.json missing)")
    problem = None if hub_name else damaged_file(path, weights=init != "random")
    if problem:
        raise ConfigError(f"cannot load the checkpoint in {path}: {problem}")
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
# what decides the warm start itself (its data, its rows, its steps, the seed of its init and its
# draws): a finished warm start resumed under other values is not the one this config makes, and
# the resumed run would not be the run never stopped. Keys read only by RL and evaluation (rl_steps,
# lr, group_size, tasks_per_step, env_mode, ...) may change: no RL state is saved with a warm start.
WARM_START_KEYS = ("format", "world", "seed", "data_seed", "n_logged", "n_new_logged", "snippet_repeats",
                   "coverage", "logged_file", "uncertain_items", "stale_rate", "choice_items", "choice_kind", "memory_max",
                   "memory_noise", "rehearsal_context", "think", "chat_template",
                   "sft_steps", "sft_batch_size", "sft_lr")


def save_state(out, model, tokenizer, opt, step, config_text, progress, generator, task_rng):
    """The resumable checkpoint <out>/ckpt: model + tokenizer (save_pretrained), config.yaml and
    trainer_state.pt (step, optimizer, every rank's RNG states, counters). Collective: every rank
    calls it (to hand in its RNG states); rank 0 writes, atomically (save_checkpoint); a
    write refused there raises on every rank (from_rank0), so none waits at the next collective."""
    rngs = all_gather({"python": random.getstate(), "numpy": np.random.get_state(),
                       "torch": torch.get_rng_state(), "generator": generator.get_state(),
                       "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []})
    weights, optimizer = full_state_dict(model), optimizer_state(model, opt)     # FSDP: collectives
    state = {"step": step, "optimizer": optimizer, "rngs": rngs, "task_rng": task_rng.getstate(),
             "progress": progress}
    from_rank0(lambda: save_checkpoint(model, tokenizer, os.path.join(out, "ckpt"), {"config.yaml": config_text},
                                       state, weights))


def check_shape(path, cfg, what):
    """The saved config.yaml of `path` (a checkpoint or a warm start to resume), whose model shape
    must be the config's: else one line."""
    with open(os.path.join(path, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    for key in MODEL_SHAPE_KEYS:
        if saved.get(key) != cfg[key]:
            raise ConfigError(f"--resume: the {what} in {path} has {key}={saved.get(key)!r} but "
                              f"the config says {key}={cfg[key]!r}: another model shape")
    return saved


def check_warm_start(path, cfg, tokenizer, saved_tokenizer):
    """A finished warm start to resume (`path`, its tokenizer loaded) must be the one this config
    makes: each of WARM_START_KEYS as saved (a key its config.yaml lacks had its default), and the
    config's tokenizer (built anew, e.g. from the toy world's words) the saved one; else one line."""
    with open(os.path.join(path, "config.yaml")) as f:
        saved = yaml.safe_load(f)
    for key in WARM_START_KEYS:
        if saved.get(key, DEFAULTS[key]) != cfg[key]:
            raise ConfigError(f"--resume: the warm start in {path} was made with {key}={saved.get(key, DEFAULTS[key])!r} "
                              f"but the config says {key}={cfg[key]!r}: another warm start; resume with "
                              f"--{key}={saved.get(key, DEFAULTS[key])}, or start over with --overwrite")
    if saved_tokenizer.get_vocab() != tokenizer.get_vocab():
        ours, theirs = tokenizer.get_vocab(), saved_tokenizer.get_vocab()
        token = next(t for t in sorted(set(ours) | set(theirs)) if ours.get(t) != theirs.get(t))
        raise ConfigError(f"--resume: the warm start in {path} was saved with another tokenizer (token {token!r}: "
                          f"id {theirs.get(token)} there, {ours.get(token)} here); start over with --overwrite")


def load_state(cfg, device, world_size):
    """(model, tokenizer, trainer state) of <out_dir>/ckpt for --resume, with clear errors."""
    path = find_checkpoint(os.path.join(cfg["out_dir"], "ckpt"), state=True)
    if path is None:
        raise ConfigError(f"--resume: no checkpoint in {cfg['out_dir']}/ckpt to resume; "
                          f"run without --resume to start, or set --out_dir")
    saved = check_shape(path, cfg, "checkpoint")
    if world_size > 1 and saved.get("fsdp", False) != cfg["fsdp"]:
        raise ConfigError(f"--resume: the checkpoint in {path} was saved with fsdp={saved.get('fsdp', False)}, "
                          f"the config says fsdp={cfg['fsdp']}: the optimizer state would not load")
    model, tokenizer = load_policy(path, device)
    try:
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    except Exception as e:                 # checked by find_checkpoint; damaged since, or inside a tensor
        raise ConfigError(f"--resume: {os.path.join(path, 'trainer_state.pt')} is corrupt "
                          f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})") from None
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


def rl_state(model, tokenizer, cfg, state, before, rank, log, phase):
    """(optimizer, the sampler's generator, the task RNG, progress counters, first step): new ones
    saved as checkpoint 0 after the warm start (`phase`, train.run's dict, then says so), or those
    of the checkpoint being resumed."""
    opt = adamw(model, cfg["lr"], cfg)
    generator = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)   # each rank its own stream
    task_rng = random.Random(cfg["seed"])                                   # the same on every rank
    progress = {"skipped_steps": 0, "nonfinite_steps": 0, "nonfinite_in_a_row": 0}
    if state is None:
        progress.update(before=before, real_success=before["success"])
        save_state(cfg["out_dir"], model, tokenizer, opt, 0, yaml.safe_dump(cfg, sort_keys=False), progress,
                   generator, task_rng)
        phase.update(saved="ckpt", step=0)
        return opt, generator, task_rng, progress, 1
    load_optimizer_state(model, opt, state["optimizer"])
    progress.update(state["progress"])
    task_rng.setstate(state["task_rng"])
    restore_rngs(state["rngs"][rank], generator)
    log(f"resumed from {cfg['out_dir']}/ckpt at step {state['step']}")
    return opt, generator, task_rng, progress, state["step"] + 1


def check_out_dir(out_dir):
    """train.py into an out_dir that already holds a checkpoint (ckpt/ or warmstart/) would
    overwrite finished work: refused unless the run resumes it (--resume) or starts over
    (--overwrite); train.run calls this before anything is built or written."""
    def held(path):                 # a damaged checkpoint is still finished work: not overwritten
        try:
            return find_checkpoint(path)
        except ConfigError:
            return path
    ckpt = held(os.path.join(out_dir, "ckpt"))
    if ckpt is not None and os.path.isfile(os.path.join(ckpt, "trainer_state.pt")):
        raise ConfigError(f"{out_dir} already holds a checkpoint ({ckpt}): resume it with --resume, choose "
                          f"another --out_dir, or pass --overwrite to start over")
    found = ckpt or held(os.path.join(out_dir, "warmstart"))
    if found is not None:
        raise ConfigError(f"{out_dir} already holds a checkpoint ({found}) of an earlier run: choose another "
                          f"--out_dir, or pass --overwrite to start over")


def warm_start_to_resume(cfg):
    """The finished warm start that --resume continues when no RL checkpoint was saved yet (a run
    interrupted during the warm start's evaluation or the step-0 checkpoint): a whole
    out_dir/warmstart (or its .old), or None: out_dir/ckpt is resumed (load_state)."""
    ckpt = os.path.join(cfg["out_dir"], "ckpt")
    if is_checkpoint(ckpt) or is_checkpoint(ckpt + ".old"):
        return None
    return find_checkpoint(os.path.join(cfg["out_dir"], "warmstart"))    # damaged: one line (ConfigError)


def finite_weights(model_or_weights):
    """Whether every floating-point weight is finite: a model's own (each rank checks its
    parameters) or a state dict (FSDP: rank 0 holds the gathered one, the others {}). The same
    answer on every rank (a collective)."""
    tensors = model_or_weights.parameters() if isinstance(model_or_weights, torch.nn.Module) \
        else model_or_weights.values()
    bad = any(not bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())
    return all_sum([bad])[0] == 0


def build_policy(cfg, resume, device, world_size, tiny_words):
    """(model, tokenizer, trainer state or None, warm start path or None): the checkpoint to
    resume, the demo's tiny model (its tokenizer from `tiny_words(cfg)`, the world's words) or a
    saved / hub model. --resume with only a finished warm start (warm_start_to_resume): the model
    is built exactly as for a new run (the same global RNG draws, so what follows draws the same),
    then the warm start's weights are loaded into it; its path is returned."""
    load_to = load_device(cfg, device, world_size)      # FSDP moves each rank's shard only
    warm = warm_start_to_resume(cfg) if resume else None
    if resume and warm is None:
        return (*load_state(cfg, load_to, world_size), None)
    if cfg["model"] == "tiny":
        tokenizer = build_tokenizer(tiny_words(cfg))
        model = build_model(cfg, tokenizer).to(load_to)
    else:
        model, tokenizer = load_policy(cfg["model"], load_to, cfg["model_init"])
    if cfg["chat_template"]:          # kept by save_pretrained: every checkpoint of the run has it
        with open(cfg["chat_template"], encoding="utf-8") as f:
            tokenizer.chat_template = f.read()
    if warm is not None:
        check_shape(warm, cfg, "warm start")
        warm_model, warm_tokenizer = load_policy(warm, load_to)
        check_warm_start(warm, cfg, tokenizer, warm_tokenizer)        # the same data, steps, seed, vocab
        model.load_state_dict(warm_model.state_dict())
    return model, tokenizer, None, warm


def save_warm_start(model, tokenizer, cfg):
    """The finished warm start as out_dir/warmstart (rank 0 writes it; a refused write stops every
    rank). Non-finite weights are never saved (NonFiniteError). An earlier run's ckpt/ in out_dir
    (--overwrite) is removed, so that --resume continues this run."""
    out = cfg["out_dir"]
    weights = full_state_dict(model)                 # FSDP: gathered to rank 0 (a collective)
    if not finite_weights(model if weights is None else weights):
        raise NonFiniteError(f"the warm-started weights are not finite (NaN or inf): not saved as "
                             f"{out}/warmstart; check the model's initial weights, lower sft_lr or check the data")

    def save():
        save_checkpoint(model, tokenizer, os.path.join(out, "warmstart"),
                        {"config.yaml": yaml.safe_dump(cfg, sort_keys=False)}, state_dict=weights)
        for stale in ("ckpt", "ckpt.old"):
            shutil.rmtree(os.path.join(out, stale), ignore_errors=True)
    from_rank0(save)
