"""Interruptions and failures outside the RL loop: Ctrl-C during the warm start is one line and
exit 130 with nothing saved; during the warm start's evaluation the finished warm start is kept
and --resume continues it exactly as if never stopped; any other exception is one line naming
the phase and the exception, exit 1, the traceback only with --debug."""
import json
import os
import signal
import time

import pytest
import torch
import yaml

from machinery import checkpoint
from scripts import evaluate_cli
from formats import features
from formats import format_plain
from machinery import faults
from reporting import metrics as metrics_module
import train
from helpers import fork_process, read_log, tiny_cfg, wait_process, without_seconds, wrap_train_logprobs

TIMING = ("time_sample", "time_logprobs", "time_update", "time_step", "tok_per_s")


def parity_reward(monkeypatch):
    # as in test_resume: rewards with variance, so that RL steps really update
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))


def config_file(tmp_path, name, **kw):
    cfg = tiny_cfg(tmp_path / name, **kw)
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return cfg, str(path)


def signal_on_call(monkeypatch, module, name, call=1, signum=signal.SIGINT):
    """module.name sends this process `signum` on its `call`-th call, then does its work."""
    original, calls = getattr(module, name), []

    def wrapped(*a, **k):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return original(*a, **k)
    monkeypatch.setattr(module, name, wrapped)
    return calls


def lines(text):
    """The lines of stderr but tqdm's progress bars (bar updates are \r-separated)."""
    return [line for line in text.replace("\r", "\n").splitlines() if line.strip() and "%|" not in line]


def metrics(cfg):
    rows = [json.loads(line) for line in open(os.path.join(cfg["out_dir"], "metrics.jsonl"))]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_warm_start_is_one_line_and_nothing_saved(tmp_path, monkeypatch, capsys, signum):
    cfg, path = config_file(tmp_path, "run", sft_steps=50)
    calls = signal_on_call(monkeypatch, train, "collate", call=2, signum=signum)   # warm-start step 2's batch
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)     # SIG_IGN in a background job
    assert train.main(["--config", path]) == 130
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "interrupted during warm start: nothing saved" in err[0], err
    assert len(calls) == 2                 # stopped between steps: step 3 never drew its batch
    assert not os.path.exists(os.path.join(cfg["out_dir"], "ckpt"))
    assert not os.path.exists(os.path.join(cfg["out_dir"], "warmstart"))
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before   # handlers restored


def count_warm_start_passes(monkeypatch, signal_at=None, signum=signal.SIGINT, wait=None):
    """(micro-batches per warm-start step, forwards run): hooks on train.until_signalled and
    train.token_logprobs. Before forward number `signal_at` runs, this process gets `signum`;
    with `wait` (a path), that forward writes the file `wait` and waits instead, as a slow step
    does, until a signal from another process is caught."""
    steps, forwards = [], []
    in_step = train.until_signalled

    def counted_in_step(batches, lengths, model):
        steps.append(len(batches))
        return in_step(batches, lengths, model)

    def counted(forward):
        def counted_forward(*a, **k):
            forwards.append(1)
            if len(forwards) == signal_at and wait is None:
                os.kill(os.getpid(), signum)
            elif len(forwards) == signal_at:
                open(wait, "w").close()
                for _ in range(6000):                # (a minute at most: never hangs)
                    if any(stop.signal is not None for stop in faults._installed):
                        break
                    time.sleep(0.01)
            return forward(*a, **k)
        return counted_forward
    monkeypatch.setattr(train, "until_signalled", counted_in_step)
    wrap_train_logprobs(counted, monkeypatch.setattr)
    return steps, forwards


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_inside_a_warm_start_step_stops_it_before_its_next_micro_batch(tmp_path, monkeypatch, capsys,
                                                                                  signum):
    """A warm-start step is many micro-batches (a real model's: minutes). A signal during the
    first one stops the warm start before the second (forwards counted): one line, exit 130,
    nothing saved. Before, the whole step ran first."""
    cfg, path = config_file(tmp_path, "run", sft_steps=50, micro_batch_tokens=60)
    steps, forwards = count_warm_start_passes(monkeypatch, signal_at=1, signum=signum)
    assert train.main(["--config", path]) == 130
    assert len(steps) == 1 and steps[0] >= 3 and len(forwards) == 1, (steps, forwards)
    assert lines(capsys.readouterr().err) == [
        "interrupted during warm start: nothing saved; run the same command to start over"]
    assert os.listdir(cfg["out_dir"]) == ["config.yaml"]       # no warmstart/, ckpt/ or .tmp


def test_sigterm_from_another_process_inside_a_warm_start_step(tmp_path, monkeypatch):
    """As on a real model: `python train.py` (forked: its own handlers and exit status) gets
    SIGTERM from another process while the first micro-batch of a warm-start step runs (its
    forward waits until the signal is caught: no timing). The step's second micro-batch never
    starts: one line, exit 130, nothing saved."""
    cfg, path = config_file(tmp_path, "run", sft_steps=50, micro_batch_tokens=60)
    ready, passes = tmp_path / "first_forward", tmp_path / "passes.json"
    steps, forwards = count_warm_start_passes(monkeypatch, signal_at=1, wait=str(ready))

    def train_py():
        rc = train.main(["--config", path])
        passes.write_text(json.dumps([steps, len(forwards)]))
        return rc
    pid = fork_process(train_py, (), tmp_path, "train")
    for _ in range(12000):                      # (two minutes at most)
        if ready.exists() or os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):
            break
        time.sleep(0.01)
    os.kill(pid, signal.SIGTERM)
    rc = wait_process(pid, 60)
    err = lines(read_log(tmp_path, "train")[1])
    assert rc == 130, err
    assert err == ["interrupted during warm start: nothing saved; run the same command to start over"]
    steps, forwards = json.loads(passes.read_text())
    assert len(steps) == 1 and steps[0] >= 3 and forwards == 1, (steps, forwards)
    assert sorted(os.listdir(cfg["out_dir"])) == ["config.yaml"]


def test_a_signal_during_the_warm_start_evaluation_keeps_it_and_resume_matches(tmp_path, monkeypatch, capsys):
    parity_reward(monkeypatch)
    whole, _ = config_file(tmp_path, "whole", rl_steps=3, kl_coef=0.05)
    assert train.run(whole) == 0
    cfg, path = config_file(tmp_path, "part", rl_steps=3, kl_coef=0.05)
    capsys.readouterr()
    with monkeypatch.context() as m:
        signal_on_call(m, metrics_module, "evaluate", call=1)       # the warm start's real-world evaluation
        assert train.main(["--config", path]) == 130
    err = lines(capsys.readouterr().err)
    out_dir = cfg["out_dir"]
    assert len(err) == 1 and "interrupted during evaluation" in err[0] and f"{out_dir}/warmstart" in err[0] \
        and "--resume" in err[0], err
    assert checkpoint.find_checkpoint(os.path.join(out_dir, "warmstart")) is not None
    assert not os.path.exists(os.path.join(out_dir, "ckpt"))
    assert not os.path.exists(os.path.join(out_dir, "warmstart", "eval.json"))

    assert train.main(["--config", os.path.join(out_dir, "config.yaml"), "--resume"]) == 0
    assert f"resumed from {out_dir}/warmstart" in capsys.readouterr().out
    # the same warm start, its evaluation, every RL step and the final policy as the run never stopped,
    # exactly: both runs are in this process (the same float operations in the same order) and the
    # resume reads the warm start back bit for bit
    for name in ("warmstart/eval.json", "eval.json"):
        a, b = (json.load(open(os.path.join(d, name))) for d in (whole["out_dir"], out_dir))
        assert without_seconds(a) == without_seconds(b), name          # (their wall times differ)
    assert [m["step"] for m in metrics(cfg)] == [1, 2, 3]
    assert sum(m["status"] == "updated" for m in metrics(whole)) >= 2
    assert metrics(cfg) == metrics(whole)
    for name in ("warmstart", "ckpt"):
        a = checkpoint.load_policy(os.path.join(whole["out_dir"], name))[0].state_dict()
        b = checkpoint.load_policy(os.path.join(out_dir, name))[0].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    a, b = (torch.load(os.path.join(d, "ckpt", "trainer_state.pt"), weights_only=False)
            for d in (whole["out_dir"], out_dir))
    assert a["step"] == b["step"] == 3 and without_seconds(a["progress"]) == without_seconds(b["progress"])
    for key in ("python", "torch", "generator"):         # every RNG where the uninterrupted run left it
        assert (a["rngs"][0][key] == b["rngs"][0][key]) if key == "python" else \
            torch.equal(a["rngs"][0][key], b["rngs"][0][key]), key


def test_a_signal_during_the_final_evaluation_keeps_ckpt(tmp_path, monkeypatch, capsys):
    cfg, path = config_file(tmp_path, "run", rl_steps=1, sft_steps=1)
    signal_on_call(monkeypatch, metrics_module, "evaluate", call=2)       # 1: the warm start's, 2: the final one
    assert train.main(["--config", path]) == 130
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "interrupted during final evaluation" in err[0] \
        and f"step 1 is saved in {cfg['out_dir']}/ckpt" in err[0], err
    assert torch.load(os.path.join(cfg["out_dir"], "ckpt", "trainer_state.pt"), weights_only=False)["step"] == 1
    assert not os.path.exists(os.path.join(cfg["out_dir"], "eval.json"))


def test_a_run_starts_with_nothing_saved_whatever_the_run_before_it_left(tmp_path, monkeypatch, capsys):
    """The run's position (faults.start_run, now, saved) belongs to one run: a second run in the same
    process, stopped early, says only what it saved itself. The first stops in its final evaluation
    with its checkpoint of step 1 saved; the second, into another out_dir, is interrupted during its
    warm start (nothing saved), another fails in loading its config (setup, before run starts)."""
    first, first_path = config_file(tmp_path, "first", rl_steps=1, sft_steps=1, n_test=2)
    with monkeypatch.context() as m:
        signal_on_call(m, metrics_module, "evaluate", call=2)         # the final evaluation
        assert train.main(["--config", first_path]) == 130
    assert "interrupted during final evaluation: the checkpoint of step 1 is saved" in capsys.readouterr().err
    assert (faults.position.phase, faults.position.saved, faults.position.step) == ("final evaluation", "ckpt", 1)
    second, second_path = config_file(tmp_path, "second", sft_steps=2)
    with monkeypatch.context() as m:
        signal_on_call(m, train, "collate", call=1)                    # the warm start's first batch
        assert train.main(["--config", second_path]) == 130
    assert lines(capsys.readouterr().err) == [
        "interrupted during warm start: nothing saved; run the same command to start over"]
    for left in ("warmstart", "ckpt"):               # what an earlier run left, then train.run called directly
        faults.now("final evaluation")
        faults.saved(left, 4)
        with monkeypatch.context() as m:
            signal_on_call(m, train, "collate", call=1)
            with pytest.raises(faults.Interrupted, match="^interrupted during warm start: nothing saved; run the same"):
                train.run(second, overwrite=True)
    faults.now("final evaluation")
    faults.saved("ckpt", 4)
    monkeypatch.setattr(train, "load_config", boom)
    assert train.main(["--config", second_path]) == 1
    assert lines(capsys.readouterr().err) == ["error in setup: ValueError: boom (--debug shows the traceback)"]


def boom(*a, **k):
    raise ValueError("boom")


def test_an_exception_in_rl_is_one_line_naming_the_phase(tmp_path, monkeypatch, capsys):
    cfg, path = config_file(tmp_path, "run", sft_steps=1, n_test=4)
    monkeypatch.setattr(train, "rl_step", boom)
    assert train.main(["--config", path]) == 1
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "error in RL step 1: ValueError: boom" in err[0] and "--debug" in err[0], err
    assert train.main(["--config", path, "--overwrite", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise ValueError("boom")' in err
    assert "error in RL step 1: ValueError: boom" in lines(err)[-1]


def test_an_exception_in_setup_or_evaluate_py_is_one_line(tmp_path, monkeypatch, capsys):
    cfg, path = config_file(tmp_path, "run", sft_steps=1)
    monkeypatch.setattr(checkpoint, "build_tokenizer", lambda words: boom())
    assert train.main(["--config", path]) == 1
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "error in setup: ValueError: boom" in err[0], err
    monkeypatch.setattr(evaluate_cli, "load_run", boom)
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"]]) == 1
    err = lines(capsys.readouterr().err)
    assert len(err) == 1 and "error in loading the checkpoint: ValueError: boom" in err[0], err
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"], "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_resume_from_a_warm_start_made_otherwise_names_the_key(tmp_path, monkeypatch, capsys):
    """--resume from a finished warm start under another seed, sft_steps, data_seed or
    rehearsal_context (what made that warm start), or another tokenizer: one line naming the key
    (or token), the saved and the new value, exit 2, the warm start untouched; a key only RL reads
    (rl_steps, group_size) may change."""
    cfg, path = config_file(tmp_path, "run", sft_steps=2, n_test=2, rl_steps=2)
    with monkeypatch.context() as m:
        signal_on_call(m, metrics_module, "evaluate", call=1)       # the warm start is saved, its evaluation stopped
        assert train.main(["--config", path]) == 130
    warm = os.path.join(cfg["out_dir"], "warmstart")
    saved_weights = open(os.path.join(warm, "model.safetensors"), "rb").read()
    capsys.readouterr()
    for key, saved, new in (("seed", 1, 2), ("sft_steps", 2, 3), ("data_seed", 0, 5),
                            ("rehearsal_context", "inline", "separate")):
        assert train.main(["--config", path, "--resume", f"--{key}={new}"]) == 2, key
        err = lines(capsys.readouterr().err)
        assert err == [f"error: --resume: the warm start in {warm} was made with {key}={saved!r} but the config "
                       f"says {key}={new!r}: another warm start; resume with --{key}={saved}, or start over "
                       f"with --overwrite"], err
    words = features.tiny_words(cfg)
    with monkeypatch.context() as m:                   # the same keys, the vocabulary's first two words swapped
        m.setattr(train.features, "tiny_words", lambda c: [words[1], words[0]] + words[2:])
        assert train.main(["--config", path, "--resume"]) == 2
    first, n_tags = min(words[:2]), len(checkpoint.TAGS)       # the first differing token, by name
    there = n_tags + words.index(first)
    here = n_tags + 1 - words.index(first)
    assert lines(capsys.readouterr().err) == [
        f"error: --resume: the warm start in {warm} was saved with another tokenizer (token {first!r}: "
        f"id {there} there, {here} here); start over with --overwrite"]
    assert open(os.path.join(warm, "model.safetensors"), "rb").read() == saved_weights
    assert not os.path.exists(os.path.join(cfg["out_dir"], "ckpt"))
    assert train.main(["--config", path, "--resume", "--rl_steps=1", "--group_size=2"]) == 0
    assert torch.load(os.path.join(cfg["out_dir"], "ckpt", "trainer_state.pt"), weights_only=False)["step"] == 1
