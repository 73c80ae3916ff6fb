"""Models in and out: the demo's tiny model, loading a policy, atomic checkpoints, exact resume.

    python train.py --config small.yaml --resume     # continue out_dir/ckpt where it stopped

A checkpoint is written whole by `save_checkpoint` (machinery/savefiles.py: to <path>.tmp, then
swapped in by two renames; a refused write is a CheckpointError naming the path) and a damaged one
is named by `damaged_file`; `find_checkpoint` falls back to a whole <path>.old. `save_state` adds what `--resume` needs to continue
the same run exactly: the step, the optimizer, every rank's RNG states and the counters; a
finished warm start is resumed only under the keys that made it (`check_warm_start`). The RL
loop saves every save_every steps and at its last; Ctrl-C or SIGTERM ends a run at once, and
--resume continues from the last checkpoint, redoing the steps after it exactly.
"""
import copy
import os
import random
import shutil

import numpy as np
import torch
import yaml

from machinery.config import DEFAULTS, ConfigError
from machinery.realmodel import ModelFileError, local_folder
from machinery.savefiles import (CheckpointError, damaged_file, file_in_the_way, find_checkpoint, is_checkpoint,  # noqa: F401
                                 save_checkpoint, write_file)  # (the callers' names for them stay checkpoint.*)
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
    return in_fresh_storage(model.to(device)), tokenizer


def in_fresh_storage(model):
    """`model` with each weight copied into storage of its own, as a model built in memory holds
    it. A loaded weight can lie at any offset inside the file's buffer (safetensors: 56 bytes past a
    64-byte line for the tests' tiny Llama), and on some CPUs the kernels then round otherwise (an
    AMD EPYC, AVX-512: the KL reference a resumed run loads gave other logprobs in the last bits
    than the copy the uninterrupted run holds; copied, the same bits). A resumed run must run the
    same float operations as the run never stopped, so every loaded model starts in fresh storage."""
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone(memory_format=torch.contiguous_format)
        for b in model.buffers():
            b.data = b.data.clone(memory_format=torch.contiguous_format)
    return model


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
    rngs = all_gather(rng_states(generator))
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
    check_chat_template(cfg, tokenizer, path)
    try:
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
    except Exception as e:                 # checked by find_checkpoint; damaged since, or inside a tensor
        raise ConfigError(f"--resume: {os.path.join(path, 'trainer_state.pt')} is corrupt "
                          f"({type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]})") from None
    if len(state["rngs"]) != world_size:
        raise ConfigError(f"--resume: the checkpoint was saved by {len(state['rngs'])} processes, "
                          f"this run has {world_size}: RNG streams would not continue")
    return model, tokenizer, state


def rng_states(generator):
    """This process's RNG states and the sampler's generator's (restore_rngs sets them back)."""
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "generator": generator.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


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


def rl_state(model, tokenizer, cfg, state, before, rank, log):
    """(optimizer, the sampler's generator, the task RNG, progress counters, first step): new ones
    saved as checkpoint 0 after the warm start, or those of the checkpoint
    being resumed."""
    opt = adamw(model, cfg["lr"], cfg)
    generator = torch.Generator().manual_seed(cfg["seed"] * 1000 + rank)   # each rank its own stream
    task_rng = random.Random(cfg["seed"])                                   # the same on every rank
    progress = {"updated": 0, "skipped": 0, "nonfinite": 0, "nonfinite_in_a_row": 0}
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
        tokenizer.chat_template = read_chat_template(cfg["chat_template"])
    if warm is not None:
        check_shape(warm, cfg, "warm start")
        warm_model, warm_tokenizer = load_policy(warm, load_to)
        check_warm_start(warm, cfg, tokenizer, warm_tokenizer)        # the same data, steps, seed, vocab
        model.load_state_dict(warm_model.state_dict())
    return model, tokenizer, None, warm


def check_chat_template(cfg, tokenizer, path):
    """A chat checkpoint holds the chat template its run trained under (save_pretrained writes it to
    chat_template.jinja): without it the tokenizer has none, and the line would say the template
    cannot render, as if the config's template were at fault. The checkpoint is damaged: a
    ConfigError naming it and the missing file."""
    if cfg["format"] == "chat" and not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"cannot load the checkpoint in {path}: {os.path.join(path, 'chat_template.jinja')} "
                          "is missing (the chat template a format: chat run saves with its checkpoints)")


def read_chat_template(path):
    """The text of the Jinja file the config key chat_template names. A file that is not UTF-8
    text, or holds nothing but whitespace, is a ConfigError naming it (exit 2): unchecked, the one
    would stop the run with a bare decoding error and the other would be blamed on the template's
    hand-offs, not on the file."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except UnicodeDecodeError as e:
        raise ConfigError(f"chat_template: {path} is not UTF-8 text ({e.reason}); a Jinja chat template is a "
                          "UTF-8 text file, e.g. chat/chatml_tools.jinja") from None
    except OSError as e:
        raise ConfigError(f"chat_template: cannot read {path}: {e.strerror}") from None
    if not text.strip():
        raise ConfigError(f"chat_template: {path} is empty; give a Jinja chat template, e.g. chat/chatml_tools.jinja")
    return text


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


# ----------------------------------------------------------------------------- the RL loop's saves

def save_step(cfg, model, tokenizer, opt, generator, task_rng, step, progress):
    """RL step `step`'s checkpoint in out_dir/ckpt (save_state: weights, optimizer, `progress`, every RNG)."""
    save_state(cfg["out_dir"], model, tokenizer, opt, step, yaml.safe_dump(cfg, sort_keys=False), progress,
               generator, task_rng)
