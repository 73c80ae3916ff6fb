"""Checkpoints: a stopped-and-resumed run writes the same metrics, weights and RNG states as one
never stopped (one process or two ranks); bad --resume requests get one clear line; a crash
mid-save never breaks the latest checkpoint; Ctrl-C or SIGTERM at any moment of RL exits 130 and
--resume continues exactly from the last checkpoint (tests/test_interrupts.py: at chosen points)."""
from formats import format_plain
from machinery import config
from machinery import checkpoint
import json
import os
import signal
import time

import pytest
import torch
import yaml

import train
from machinery.checkpoint import find_checkpoint, save_checkpoint
from helpers import (fork_process, read_log, run_ranks, stderr_tail, tiny_cfg, tiny_llama, toy_tokenizer, wait_process,
                     without_seconds)
from rank_faults import run_train
from test_interrupts import lines, process_settings  # noqa: F401 (autouse: handlers, threads set back)

TIMING = ("time_sample", "time_logprobs", "time_update", "time_step", "tok_per_s")


def parity_reward(monkeypatch):
    # a 5-step warm start answers nothing right: reward episode-length parity instead, so that
    # groups have variance and steps really update (optimizer state matters for the resume)
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))


def metrics(cfg):
    rows = [json.loads(line) for line in open(os.path.join(cfg["out_dir"], "metrics.jsonl"))]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def test_stopped_and_resumed_run_matches_the_uninterrupted_one(tmp_path, monkeypatch):
    parity_reward(monkeypatch)
    whole = tiny_cfg(tmp_path / "whole", rl_steps=5, kl_coef=0.05)
    assert train.run(whole) == 0
    part = tiny_cfg(tmp_path / "part", rl_steps=2, kl_coef=0.05)
    assert train.run(part) == 0
    assert train.run({**part, "rl_steps": 5}, resume=True) == 0
    expected, got = metrics(whole), metrics(part)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5]
    assert sum(m["status"] == "updated" for m in expected) >= 3
    # exact equality is the bound here: both runs are in this process (the same kernels, thread
    # count and shapes: the same float operations in the same order), and the resume reads back the
    # weights, optimizer state and RNGs bit for bit; any difference is state the resume lost
    assert got == expected
    a = checkpoint.load_policy(os.path.join(whole["out_dir"], "ckpt"))[0].state_dict()
    b = checkpoint.load_policy(os.path.join(part["out_dir"], "ckpt"))[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_without_a_checkpoint_says_so(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"out_dir": str(tmp_path / "nothing"), "n_layer": 2}))
    assert train.main(["--config", str(cfg), "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint" in err[0] and "--resume" in err[0]


def test_resume_with_another_model_shape_says_so(tmp_path, monkeypatch):
    cfg = tiny_cfg(tmp_path, rl_steps=1)
    assert train.run(cfg) == 0
    with pytest.raises(config.ConfigError, match="n_layer=2 but the config says n_layer=3"):
        train.run({**cfg, "n_layer": 3, "rl_steps": 2}, resume=True)


def test_a_crash_between_the_renames_leaves_a_whole_checkpoint(tmp_path):
    tok = toy_tokenizer()
    path = str(tmp_path / "ckpt")
    save_checkpoint(tiny_llama(tok, seed=0), tok, path, {"config.yaml": "step: 1\n"}, {"step": 1})
    # a crash after `ckpt -> ckpt.old` and before `ckpt.tmp -> ckpt`, with a half-written .tmp
    os.replace(path, path + ".old")
    os.makedirs(path + ".tmp")
    open(os.path.join(path + ".tmp", "config.json"), "w").write("{half")
    assert find_checkpoint(path) == path + ".old"
    assert torch.load(os.path.join(path + ".old", "trainer_state.pt"))["step"] == 1
    # the next save cleans up and leaves exactly one checkpoint
    save_checkpoint(tiny_llama(tok, seed=1), tok, path, {"config.yaml": "step: 2\n"}, {"step": 2})
    assert find_checkpoint(path) == path
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]
    assert torch.load(os.path.join(path, "trainer_state.pt"))["step"] == 2


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_at_any_moment_of_rl_exits_130_and_resume_continues_the_last_checkpoint(tmp_path, monkeypatch,
                                                                                        capsys, signum):
    """A train.py process (forked, train.main as `python train.py` calls it: its own exit status
    and handlers; helpers.fork_process) gets the signal from this process at a moment no one
    chose: once RL has written 3 metrics lines, wherever the run is then (sampling, an update, a
    save). It exits 130 within seconds with one line naming the checkpoint on the disk: the last
    of save_every 2, whole (ckpt, or ckpt.old if the signal struck between a save's renames); the
    steps logged after it are at most 2. --resume, the line's command with rl_steps set to that
    step + 2, redoes the steps after it and writes exactly the metrics, weights and RNG states of a
    run of that many steps never stopped (this process, one thread, as the forked run)."""
    small = {"threads": 1, "sft_steps": 2, "n_test": 2, "save_every": 2, "kl_coef": 0.05}
    cfg = tiny_cfg(tmp_path / "part", rl_steps=100000, **small)
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(cfg))
    pid = fork_process(run_train, (["--config", str(path)],), tmp_path, "train")
    out = cfg["out_dir"]
    metrics_file = os.path.join(out, "metrics.jsonl")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
        if os.path.exists(metrics_file) and len(open(metrics_file).readlines()) >= 3:
            break
        time.sleep(0.02)
    os.kill(pid, signum)
    sent = time.monotonic()
    rc = wait_process(pid, 60)
    seconds, err = time.monotonic() - sent, read_log(tmp_path, "train")[1]
    assert rc == 130 and seconds < 10, (rc, seconds, stderr_tail(err))
    kept = find_checkpoint(os.path.join(out, "ckpt"), state=True)
    step = torch.load(os.path.join(kept, "trainer_state.pt"), weights_only=False)["step"]
    assert kept in (os.path.join(out, "ckpt"), os.path.join(out, "ckpt.old")) and step % 2 == 0, (kept, step)
    again = f"python train.py --config {out}/config.yaml --resume"
    assert lines(err) == [f"interrupted: the checkpoint of RL step {step} in {kept} is saved; continue with: {again}"]
    assert step <= len(open(metrics_file).readlines()) <= step + 2

    parity_reward(monkeypatch)
    whole = tiny_cfg(tmp_path / "whole", rl_steps=step + 2, **small)
    assert train.run(whole) == 0
    capsys.readouterr()
    assert train.main(again.split()[2:] + [f"--rl_steps={step + 2}"]) == 0
    assert f"resumed from {out}/ckpt at step {step}" in capsys.readouterr().out
    assert [m["step"] for m in metrics(cfg)] == list(range(1, step + 3))
    assert sum(m["status"] == "updated" for m in metrics(whole)) >= 3
    assert metrics(cfg) == metrics(whole)
    (a, a_weights), (b, b_weights) = (saved_rngs_and_weights(c) for c in (whole, cfg))
    assert a["step"] == b["step"] == step + 2 and a["task_rng"] == b["task_rng"]
    assert without_seconds(a["progress"]) == without_seconds(b["progress"])
    assert all(torch.equal(a_weights[k], b_weights[k]) for k in a_weights)
    assert all(torch.equal(a["rngs"][0][k], b["rngs"][0][k]) for k in ("torch", "generator"))
    assert not [name for name in os.listdir(out) if name.endswith((".tmp", ".old"))]     # no save left half-done


def test_resume_restores_every_rng_of_its_own_rank(tmp_path):
    """save_state keeps the python, numpy and torch global RNGs, the sampler's generator and the
    task RNG; rl_state on --resume restores them, each rank its own entry of the saved list: the
    draws after the restore are exactly the draws that followed the save, whatever was drawn in
    between. The saved list is made three ranks long by hand (ranks 0 and 2: other states)."""
    import random
    import numpy as np
    tok, cfg = toy_tokenizer(), tiny_cfg(tmp_path)
    model = tiny_llama(tok)
    opt = torch.optim.AdamW(model.parameters())
    random.seed(11), np.random.seed(12), torch.manual_seed(13)
    generator, task_rng = torch.Generator().manual_seed(14), random.Random(15)
    checkpoint.save_state(cfg["out_dir"], model, tok, opt, 7, yaml.safe_dump(cfg), {"skipped": 2},
                          generator, task_rng)

    def draws(generator, task_rng):
        return (random.random(), float(np.random.rand()), torch.rand(1).item(),
                torch.rand(1, generator=generator).item(), task_rng.random())
    expected = draws(generator, task_rng)
    random.seed(0), np.random.seed(0), torch.manual_seed(0)
    _, _, state = checkpoint.load_state(cfg, "cpu", 1)
    theirs = [{"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
               "generator": torch.Generator().manual_seed(seed).get_state(), "cuda": []} for seed in (98, 99)]
    state["rngs"] = [theirs[0], state["rngs"][0], theirs[1]]   # this process is rank 1 of 3
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    _, generator, task_rng, progress, first_step = checkpoint.rl_state(
        model, tok, cfg, state, None, 1, lambda *a: None)
    assert (first_step, progress["skipped"]) == (8, 2)
    assert draws(generator, task_rng) == expected


def test_each_rank_draws_its_own_sampler_stream_and_the_same_tasks(tmp_path):
    """A new run's RL state: the sampler's generator differs per rank (rank 1 sampling rank 0's
    stream would give both ranks the same samples of a task), the task RNG is the same on every
    rank (every rank draws the same global batch, then takes its slice); both follow the seed."""
    tok = toy_tokenizer()
    model = tiny_llama(tok)

    def streams(seed, rank):
        cfg = tiny_cfg(tmp_path / f"s{seed}r{rank}", seed=seed)
        _, generator, task_rng, _, _ = checkpoint.rl_state(model, tok, cfg, None, {"success": 0.0}, rank,
                                                           lambda *a: None)
        return torch.rand(4, generator=generator).tolist(), task_rng.random()
    (g0, t0), (g1, t1), (g0_again, _), (g0_seed2, t0_seed2) = (streams(1, 0), streams(1, 1), streams(1, 0),
                                                                 streams(2, 0))
    assert g0 == g0_again and t0 == t1
    assert g0 != g1 and g0_seed2 not in (g0, g1) and t0_seed2 != t0
    rank1_seed2 = streams(2, 1)[0]
    assert rank1_seed2 not in (g0, g1, g0_seed2)                # no two (seed, rank) share a stream


def test_overwrite_removes_an_earlier_ckpt_old_that_resume_would_pick(tmp_path):
    """An earlier run in out_dir crashed between save_checkpoint's renames: its checkpoint is
    ckpt.old. A run started over with --overwrite saves its warm start and is interrupted in the
    evaluation: --resume must continue that warm start, so the earlier ckpt.old is gone with the
    earlier ckpt (else warm_start_to_resume returns None and load_state resumes ckpt.old)."""
    tok = toy_tokenizer()
    cfg = tiny_cfg(tmp_path)
    out = cfg["out_dir"]
    save_checkpoint(tiny_llama(tok, seed=1), tok, os.path.join(out, "ckpt"), {"config.yaml": yaml.safe_dump(cfg)},
                    {"step": 9})
    os.replace(os.path.join(out, "ckpt"), os.path.join(out, "ckpt.old"))
    assert find_checkpoint(os.path.join(out, "ckpt"), state=True) == os.path.join(out, "ckpt.old")
    checkpoint.save_warm_start(tiny_llama(tok, seed=2), tok, cfg)
    assert sorted(os.listdir(out)) == ["warmstart"]
    assert checkpoint.warm_start_to_resume(cfg) == os.path.join(out, "warmstart")


def _two_rank_runs(rank, world_size, init_file, root):
    """One gloo rank (as under torchrun): a 2-step run, and a 1-step run resumed to 2 steps."""
    import datetime
    from pathlib import Path
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))    # a lost rank fails, never hangs
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    format_plain.task_reward = lambda e, t: float(len(e["ids"]) % 2)        # as parity_reward
    small = {"sft_steps": 2, "n_test": 2, "kl_coef": 0.05, "save_every": 0}
    assert train.run(tiny_cfg(Path(root) / "whole", rl_steps=2, **small)) == 0
    part = tiny_cfg(Path(root) / "part", rl_steps=1, **small)
    assert train.run(part) == 0
    assert train.run({**part, "rl_steps": 2}, resume=True) == 0
    dist.barrier()
    dist.destroy_process_group()


def test_two_rank_run_stopped_and_resumed_matches_the_uninterrupted_one(tmp_path):
    """2 gloo ranks, each sampling its slice of the tasks with its own generator: stopped after
    step 1 and resumed, each rank must take back its own saved stream (rank 1 continuing rank
    0's, or a fresh one, samples other episodes). The resumed run writes the same metrics as the
    uninterrupted one (both ranks' episodes), the same weights and the same RNG states: the same
    operations in the same order on one machine, so equal exactly, as in the one-process test."""
    # forked: the ranks start with the modules already imported (spawn would import torch anew)
    run_ranks(_two_rank_runs, (2, str(tmp_path / "init"), str(tmp_path)), tmp_path, timeout=180)
    whole, part = ({"out_dir": str(tmp_path / name / "run")} for name in ("whole", "part"))
    expected, got = metrics(whole), metrics(part)
    assert [m["step"] for m in got] == [1, 2]
    assert [m["status"] for m in expected] == ["updated"] * 2
    assert got == expected
    a = checkpoint.load_policy(os.path.join(whole["out_dir"], "ckpt"))[0].state_dict()
    b = checkpoint.load_policy(os.path.join(part["out_dir"], "ckpt"))[0].state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    states = [torch.load(os.path.join(c["out_dir"], "ckpt", "trainer_state.pt"), weights_only=False)
              for c in (whole, part)]
    for s, t in zip(*(state["rngs"] for state in states)):
        assert torch.equal(s["generator"], t["generator"]) and torch.equal(s["torch"], t["torch"])
    assert not torch.equal(states[0]["rngs"][0]["generator"], states[0]["rngs"][1]["generator"])


def saved_rngs_and_weights(cfg):
    state = torch.load(os.path.join(cfg["out_dir"], "ckpt", "trainer_state.pt"), weights_only=False)
    return state, checkpoint.load_policy(os.path.join(cfg["out_dir"], "ckpt"))[0].state_dict()


def test_a_loaded_policy_holds_its_weights_as_a_model_built_in_memory_does(tmp_path):
    # a resumed run loads its KL reference and its policy from safetensors files, where a weight lies
    # wherever the file put it (this tiny Llama's: 56 bytes past a 64-byte line); on an AMD EPYC
    # (AVX-512) the matrix kernels then round otherwise than for the copy the run never stopped
    # holds, and the resume stops being exact. load_policy copies every weight into fresh storage:
    # 64-byte aligned like torch's own allocations, the file no longer behind it, ties kept
    tok = toy_tokenizer()
    path = str(tmp_path / "ckpt")
    built = tiny_llama(tok, seed=0)
    save_checkpoint(built, tok, path, {"config.yaml": "step: 1\n"}, {"step": 1})
    model = checkpoint.load_policy(path)[0]
    weights = dict(model.named_parameters())
    assert len(weights) == len(dict(built.named_parameters())) == 20      # 2 layers x 9 + norm + embedding
    assert all(p.data_ptr() % 64 == 0 for p in weights.values())
    assert all(p.untyped_storage().nbytes() == p.numel() * 4 for p in weights.values())   # nothing else in its buffer
    assert model.lm_head.weight is model.model.embed_tokens.weight                     # tie_word_embeddings kept
    assert all(torch.equal(p, built.state_dict()[k]) for k, p in weights.items())
