"""Checkpoint faults: a save the file system refuses (out_dir a file, a folder without write
permission, a full disk) is one line naming the path, leaves no <path>.tmp or <path>.old and
keeps the last good checkpoint loadable; a damaged checkpoint (a truncated weights file, a corrupt
trainer_state.pt, a missing or broken config.json / config.yaml / tokenizer file) is one line
naming the damaged file, and find_checkpoint / --resume fall back to a whole <path>.old."""
from scripts import evaluate_cli
import errno
import os
import random
import shutil
import zipfile

import pytest
import torch
import yaml

from machinery import checkpoint
import train
from machinery.checkpoint import CheckpointError, find_checkpoint, load_policy, load_state, save_checkpoint, save_state
from machinery.config import ConfigError
from helpers import tiny_cfg, tiny_llama, toy_tokenizer

TOK = toy_tokenizer()
GOOD, NEW = tiny_llama(TOK, seed=0), tiny_llama(TOK, seed=1)
TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"   # torch.save's own


def save_good(path, cfg, model=GOOD, step=1):
    """A resumable checkpoint as save_state writes it: weights, tokenizer, config.yaml, trainer_state.pt."""
    save_checkpoint(model, TOK, path, {"config.yaml": yaml.safe_dump(cfg, sort_keys=False)},
                    {"step": step, "rngs": [{}]})


def weights_of(path):
    return load_policy(path)[0].state_dict()


def same(weights, model):
    return all(torch.equal(weights[k], v) for k, v in model.state_dict().items())


def assert_only_good_checkpoint(path, model=GOOD, step=1):
    """<path> is the one checkpoint in its folder, found, loadable, with `model`'s weights."""
    assert not os.path.exists(path + ".tmp") and not os.path.exists(path + ".old")
    assert find_checkpoint(path, state=True) == path
    assert same(weights_of(path), model)
    assert torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)["step"] == step


def write_config(tmp_path, cfg):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def error_lines(capsys):
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


# ----------------------------------------------------------------------------- 1. saves the file system refuses

def test_out_dir_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "run"
    out.write_text("my notes")
    path = str(out / "ckpt")
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(GOOD, TOK, path)
    assert str(e.value) == f"cannot save the checkpoint {path}: {out} is a file, not a folder"
    assert out.read_text() == "my notes"
    # what a user sees: train.py stops before any training, one line, exit 2
    cfg = tiny_cfg(tmp_path, out_dir=str(out))
    assert train.main(["--config", write_config(tmp_path, cfg)]) == 2
    assert error_lines(capsys) == [f"error: cannot write {out}/config.yaml: {out} is a file, not a folder"]
    assert out.read_text() == "my notes"


def test_a_checkpoint_path_that_is_a_file(tmp_path):
    path = tmp_path / "ckpt"
    path.write_text("not a checkpoint")
    with pytest.raises(CheckpointError, match=f"^cannot save the checkpoint {path}: {path} is a file, not a folder$"):
        save_checkpoint(GOOD, TOK, str(path))
    assert path.read_text() == "not a checkpoint" and sorted(os.listdir(tmp_path)) == ["ckpt"]


def test_a_folder_without_write_permission(tmp_path, monkeypatch):
    """Simulated (the tests may run as root, whom chmod does not stop): creating anything new in
    the folder is refused with EACCES, as os.makedirs / open would report it."""
    cfg = tiny_cfg(tmp_path)
    path = str(tmp_path / "ckpt")
    save_good(path, cfg)
    real_makedirs = os.makedirs

    def refused(name, *a, **k):
        if str(name).startswith(str(tmp_path)) and not os.path.exists(name):
            raise PermissionError(errno.EACCES, "Permission denied", str(name))
        return real_makedirs(name, *a, **k)
    monkeypatch.setattr(os, "makedirs", refused)
    with pytest.raises(CheckpointError) as e:
        save_good(path, cfg, NEW, step=2)
    assert isinstance(e.value, ConfigError) and isinstance(e.value, OSError)
    assert str(e.value) == (f"cannot save the checkpoint {path} (writing the model to {path}.tmp): "
                            f"Permission denied: {path}.tmp; the previous checkpoint in {path} is kept")
    monkeypatch.undo()
    assert_only_good_checkpoint(path)


def test_a_full_disk_while_the_weights_are_written(tmp_path, monkeypatch):
    """save_pretrained writes part of the weights file, then the disk is full (ENOSPC)."""
    cfg = tiny_cfg(tmp_path)
    path = str(tmp_path / "ckpt")
    save_good(path, cfg)
    real = type(NEW).save_pretrained

    def full_disk(self, folder, **k):
        real(self, folder, **k)
        weights = os.path.join(folder, "model.safetensors")
        os.truncate(weights, os.path.getsize(weights) // 2)
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(type(NEW), "save_pretrained", full_disk)
    with pytest.raises(CheckpointError) as e:
        save_good(path, cfg, NEW, step=2)
    message = str(e.value)
    assert message.startswith(f"cannot save the checkpoint {path} (writing the model to {path}.tmp): "
                              f"No space left on device (")
    assert message.endswith(f" MiB free on that disk); the previous checkpoint in {path} is kept")
    assert "\n" not in message
    monkeypatch.undo()
    assert_only_good_checkpoint(path)


def test_a_full_disk_while_the_trainer_state_is_written(tmp_path, monkeypatch):
    """torch.save on a full disk raises its zip writer's RuntimeError (no errno): save_state says
    which file and how much room is left."""
    cfg = tiny_cfg(tmp_path)
    out, path = cfg["out_dir"], os.path.join(cfg["out_dir"], "ckpt")
    save_good(path, cfg)

    def full_disk(obj, f, *a, **k):
        open(f, "wb").write(b"PK\x03\x04 half an archive")
        raise RuntimeError(TORCH_FULL_DISK)
    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    opt = torch.optim.AdamW(NEW.parameters(), lr=1e-3)
    with pytest.raises(CheckpointError) as e:
        save_state(out, NEW, TOK, opt, 2, yaml.safe_dump(cfg), {}, torch.Generator(), random.Random(0))
    message = str(e.value)
    assert message.startswith(f"cannot save the checkpoint {path} (writing {path}.tmp/trainer_state.pt): "
                              f"{TORCH_FULL_DISK} (")
    assert message.endswith(f" MiB free on that disk); the previous checkpoint in {path} is kept")
    monkeypatch.undo()
    assert_only_good_checkpoint(path)


def test_train_main_says_a_failed_save_in_one_line_and_exits_2(tmp_path, monkeypatch, capsys):
    """The run's first save_state (checkpoint 0, after the warm start) hits a full disk: one line
    `error: ...` on stderr, exit 2; the warm start saved before it is whole, and no ckpt.tmp."""
    cfg = tiny_cfg(tmp_path, sft_steps=1, n_test=2, rl_steps=1)

    def full_disk(*a, **k):
        raise RuntimeError(TORCH_FULL_DISK)
    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    assert train.main(["--config", write_config(tmp_path, cfg)]) == 2
    path = os.path.join(cfg["out_dir"], "ckpt")
    lines = error_lines(capsys)
    errors = [line for line in lines if "it/s" not in line and "s/it" not in line]          # the rest: the warm start's progress bar
    assert len(errors) == 1 and errors[0] == lines[-1] and errors[0].startswith(
        f"error: cannot save the checkpoint {path} (writing {path}.tmp/trainer_state.pt): {TORCH_FULL_DISK} (")
    assert errors[0].endswith("MiB free on that disk); nothing was saved")
    assert sorted(os.listdir(cfg["out_dir"])) == ["config.yaml", "warmstart"]
    assert find_checkpoint(os.path.join(cfg["out_dir"], "warmstart")) == os.path.join(cfg["out_dir"], "warmstart")


def test_the_first_rename_refused(tmp_path, monkeypatch):
    """<path> -> <path>.old refused (EACCES): <path> untouched, the written <path>.tmp removed."""
    cfg = tiny_cfg(tmp_path)
    path = str(tmp_path / "ckpt")
    save_good(path, cfg)
    real_replace = os.replace

    def refused(src, dst):
        if str(src) == path:
            raise PermissionError(errno.EACCES, "Permission denied", str(src))
        return real_replace(src, dst)
    monkeypatch.setattr(checkpoint.os, "replace", refused)
    with pytest.raises(CheckpointError, match=(
            f"^cannot save the checkpoint {path} \\(renaming it into place\\): Permission denied: {path}; "
            f"the previous checkpoint in {path} is kept$")):
        save_good(path, cfg, NEW, step=2)
    monkeypatch.undo()
    assert_only_good_checkpoint(path)


# ----------------------------------------------------------------------------- 2. damaged checkpoints

def truncate(name):
    def damage(path):
        f = os.path.join(path, name)
        os.truncate(f, os.path.getsize(f) // 2)
    return damage


def overwrite(name, data):
    def damage(path):
        with open(os.path.join(path, name), "wb") as f:
            f.write(data)
    return damage


def remove(name):
    return lambda path: os.remove(os.path.join(path, name))


def bad_pickle(path):
    """trainer_state.pt a whole zip archive whose pickle is garbage (bytes damaged inside it)."""
    with zipfile.ZipFile(os.path.join(path, "trainer_state.pt"), "w") as z:
        z.writestr("trainer_state/data.pkl", b"\x80\x02garbage")
        z.writestr("trainer_state/version", b"3\n")


# (damage, the file named, what is said of it, load_policy refuses it too)
DAMAGE = {
    "weights truncated": (truncate("model.safetensors"), "model.safetensors", "is truncated or corrupt (", True),
    "weights missing": (remove("model.safetensors"), "model.safetensors", "is missing (no weights file)", True),
    "weights empty": (overwrite("model.safetensors", b""), "model.safetensors", "is truncated or corrupt (", True),
    "state truncated": (truncate("trainer_state.pt"), "trainer_state.pt",
                        "is truncated or corrupt (not a whole torch.save archive)", False),
    "state garbage": (overwrite("trainer_state.pt", b"\x00" * 100), "trainer_state.pt",
                      "is truncated or corrupt (not a whole torch.save archive)", False),
    "state bad pickle": (bad_pickle, "trainer_state.pt", "is corrupt (", False),
    "state missing": (remove("trainer_state.pt"), "trainer_state.pt", "is missing", False),
    "config.json missing": (remove("config.json"), "config.json", "is missing", True),
    "config.json broken": (overwrite("config.json", b'{"model_type": "lla'), "config.json", "is not valid JSON (", True),
    "config.yaml broken": (overwrite("config.yaml", b"n_layer: [2\n"), "config.yaml", "is not valid YAML (", True),
    "config.yaml missing": (remove("config.yaml"), "config.yaml", "is missing", False),
    "tokenizer.json missing": (remove("tokenizer.json"), "tokenizer.json", "is missing (the tokenizer's vocabulary)", True),
    "tokenizer.json truncated": (truncate("tokenizer.json"), "tokenizer.json", "is not valid JSON (", True),
    "tokenizer_config.json missing": (remove("tokenizer_config.json"), "tokenizer_config.json",
                                      "is missing (no tokenizer saved)", True),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_checkpoint_names_the_file_and_falls_back_to_old(kind, tmp_path, capsys):
    damage, name, said, policy_refuses = DAMAGE[kind]
    cfg = tiny_cfg(tmp_path)
    path = os.path.join(cfg["out_dir"], "ckpt")
    save_good(path, cfg, GOOD, step=1)
    shutil.copytree(path, path + ".keep")
    save_good(path, cfg, NEW, step=2)
    os.replace(path + ".keep", path + ".old")      # both there, as a crash after both renames leaves them
    damage(path)
    damaged = os.path.join(path, name)
    capsys.readouterr()

    # <path>.old is whole: find_checkpoint and --resume use it, and say so in one line
    assert find_checkpoint(path, state=True) == path + ".old"
    model, tokenizer, state = load_state(cfg, "cpu", 1)
    assert same(model.state_dict(), GOOD) and state["step"] == 1 and len(tokenizer) == len(TOK)
    lines = error_lines(capsys)
    assert len(lines) == 2 and lines[0] == lines[1]            # once per call
    assert lines[0].startswith(f"warning: the checkpoint {path} is damaged ({damaged} {said}")
    assert lines[0].endswith(f"); using the previous one, {path}.old")

    # the policy loader, given the damaged folder itself, names the file
    if policy_refuses:
        with pytest.raises(ConfigError) as e:
            load_policy(path)
        assert str(e.value).startswith(f"cannot load the checkpoint in {path}: {damaged} {said}")
        assert "\n" not in str(e.value)

    # no whole <path>.old: one line naming the damaged file; what is left of it is not touched
    shutil.rmtree(path + ".old")
    before = {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)}
    with pytest.raises(ConfigError) as e:
        load_state(cfg, "cpu", 1)
    assert str(e.value).startswith(f"damaged checkpoint: {damaged} {said}") and "\n" not in str(e.value)
    assert {f: os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)} == before


def test_resume_and_evaluate_of_a_damaged_checkpoint_say_which_file(tmp_path, capsys):
    """What a user sees: train.py --resume and evaluate.py --ckpt print one `error:` line naming
    the damaged file and exit 2, before any training or evaluation."""
    cfg = tiny_cfg(tmp_path)
    path = os.path.join(cfg["out_dir"], "ckpt")
    save_good(path, cfg)
    truncate("trainer_state.pt")(path)
    capsys.readouterr()
    assert train.main(["--config", write_config(tmp_path, cfg), "--resume"]) == 2
    assert error_lines(capsys) == [f"error: damaged checkpoint: {path}/trainer_state.pt is truncated or corrupt "
                                   f"(not a whole torch.save archive)"]
    truncate("model.safetensors")(path)
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"]]) == 2
    lines = error_lines(capsys)
    assert len(lines) == 1 and lines[0].startswith(
        f"error: damaged checkpoint: {path}/model.safetensors is truncated or corrupt (")


def test_a_truncated_shard_of_a_sharded_checkpoint_is_named(tmp_path):
    """Big models are saved in shards listed in model.safetensors.index.json: each shard is checked."""
    path = str(tmp_path / "sharded")
    GOOD.save_pretrained(path, max_shard_size="40KB")
    TOK.save_pretrained(path)
    shards = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    assert len(shards) >= 2 and os.path.exists(os.path.join(path, "model.safetensors.index.json"))
    assert same(weights_of(path), GOOD)
    truncate(shards[-1])(path)
    with pytest.raises(ConfigError, match=f"^cannot load the checkpoint in {path}: {path}/{shards[-1]} is truncated"):
        load_policy(path)
    os.remove(os.path.join(path, shards[0]))
    with pytest.raises(ConfigError, match=f"^cannot load the checkpoint in {path}: {path}/{shards[0]} is missing$"):
        load_policy(path)


def test_a_full_disk_while_metrics_or_eval_json_are_written_is_one_line(tmp_path, monkeypatch, capsys):
    """The disk is full when metrics.jsonl is written (at the start of RL): one `error:` line naming
    metrics.jsonl, exit 2; checkpoint 0 (saved before) still loads. Then evaluate.py on that run,
    its eval.json refused: one line naming the file, exit 2, nothing else written."""
    import builtins
    cfg = tiny_cfg(tmp_path, sft_steps=1, n_test=2, rl_steps=2, eval_every=0)
    real_open = builtins.open

    def full_disk_for(name):
        def patched(file, mode="r", *a, **k):
            if str(file).endswith(name) and mode[0] in "wa":
                raise OSError(errno.ENOSPC, "No space left on device")
            return real_open(file, mode, *a, **k)
        return patched
    monkeypatch.setattr(builtins, "open", full_disk_for("metrics.jsonl"))
    # start_metrics writes metrics.jsonl first (mode "w"): that is where the full disk hits
    assert train.main(["--config", write_config(tmp_path, cfg)]) == 2
    errors = [line for line in error_lines(capsys) if "it/s" not in line and "s/it" not in line]
    metrics = os.path.join(cfg["out_dir"], "metrics.jsonl")
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot write {metrics}: ") and "No space" in errors[0]
    ckpt = os.path.join(cfg["out_dir"], "ckpt")
    assert find_checkpoint(ckpt) == ckpt and torch.load(os.path.join(ckpt, "trainer_state.pt"),
                                                        weights_only=False)["step"] == 0
    monkeypatch.setattr(builtins, "open", full_disk_for("eval.json"))
    before = sorted(os.listdir(cfg["out_dir"]))
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"], "--n_test=2"]) == 2
    errors = [line for line in error_lines(capsys) if "it/s" not in line and "s/it" not in line]
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot write {os.path.join(cfg['out_dir'], 'eval.json')}: ")
    assert sorted(os.listdir(cfg["out_dir"])) == before
