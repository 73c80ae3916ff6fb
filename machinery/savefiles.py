"""Folders and files written whole, and checked whole when read: the save that swaps a finished
folder in by renames, the check that names a damaged file. Below checkpoint.py (a policy's
checkpoints) and realmodel.py (a converted model), which both write model folders with it.

`save_checkpoint` writes a whole folder (save_pretrained + extra files + trainer_state.pt) to
<path>.tmp and swaps it in by two renames, so a crash leaves a complete folder at <path> or
<path>.old (`find_checkpoint` looks at both). A write the file system refuses (a file in the way,
no permission, a full disk) is a CheckpointError, one line naming the path, and leaves the
previous folder where it was. `damaged_file` names a truncated weights file, a broken
config.json, a missing tokenizer...
"""
import errno
import glob
import json
import os
import shutil
import sys
import zipfile

import torch
import torch.distributed as dist
import yaml
from safetensors import SafetensorError, safe_open

from machinery.config import ConfigError


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
