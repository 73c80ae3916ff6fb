"""Ctrl-C and SIGTERM end a run at once, wherever it is: setup, the warm start, its evaluation, an
RL step (sampling, the update, between PPO epochs), an evaluation during RL, the final
evaluation, a checkpoint's save. Each time the run exits with status 130 within seconds and
writes one line on stderr, no traceback: what is saved in out_dir and, when something is, the
--resume command. Checkpoints are written whole, so a signal during a save leaves the previous
one whole; --resume from what was saved then writes exactly the metrics, weights, RNG states and
eval.json of the run never stopped. Any other exception is one line and exit status 1, the
traceback only with --debug.

Each stopped run is `python train.py` as a forked process (helpers.fork_process: its own signal
handlers and exit status) that pauses at the chosen point (rank_faults.pause_at) until the test
sends it the signal from outside, as a user or a scheduler does."""
import json
import os
import re
import signal
import time

import pytest
import torch
import yaml

from machinery import checkpoint
from machinery.savefiles import damaged_file, find_checkpoint
from scripts import evaluate_cli
from formats import features
from formats import format_plain
from reporting import metrics as metrics_module
import train
from helpers import fork_process, read_log, stderr_tail, tiny_cfg, wait_process, without_seconds
from rank_faults import run_train

TIMING = ("time_sample", "time_logprobs", "time_update", "time_step", "tok_per_s")
SIGNALS = pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
ANSWER = 10         # seconds from the signal to the run's exit, at most (it takes a fraction of one)
# small runs: 2 test tasks, a 2-step warm start, 4 RL steps saved every 2 (checkpoints 0, 2, 4),
# several micro-batches per step (60 tokens), a KL reference (resumed: loaded from warmstart/),
# one thread (this process and the forked runs make the same float operations)
SMALL = {"threads": 1, "n_test": 2, "sft_steps": 2, "rl_steps": 4, "save_every": 2, "micro_batch_tokens": 60,
         "kl_coef": 0.05}
NOTHING_SAVED = "interrupted: nothing saved; run the same command to start over"


@pytest.fixture(autouse=True)
def process_settings():
    """train.main in this process makes SIGTERM raise KeyboardInterrupt and sets torch's thread
    count (the config's `threads`): both set back after each test."""
    handlers, threads = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)), torch.get_num_threads()
    yield
    signal.signal(signal.SIGINT, handlers[0])
    signal.signal(signal.SIGTERM, handlers[1])
    torch.set_num_threads(threads)


def parity(e, t):
    return float(len(e["ids"]) % 2)         # as rank_faults.parity_reward: steps with reward variance


def config_file(folder, **kw):
    """(cfg, the path of its YAML file): SMALL with `kw`, out_dir `folder`/run."""
    folder.mkdir(parents=True, exist_ok=True)
    cfg = tiny_cfg(folder, **{**SMALL, **kw})
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return cfg, str(path)


UNINTERRUPTED = {}


@pytest.fixture
def uninterrupted(tmp_path_factory, monkeypatch):
    """uninterrupted(**kw): the cfg of a run of SMALL with `kw`, never stopped, in this process with
    the parity reward (each config run once per session)."""
    def run(**kw):
        key = tuple(sorted(kw.items()))
        if key not in UNINTERRUPTED:
            cfg, _ = config_file(tmp_path_factory.mktemp("whole"), **kw)
            with monkeypatch.context() as m:
                m.setattr(format_plain, "task_reward", parity)
                assert train.run(cfg) == 0
            assert sum(m["status"] == "updated" for m in metrics(cfg)) >= 3
            UNINTERRUPTED[key] = cfg
        return UNINTERRUPTED[key]
    return run


ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def lines(text):
    """The lines of stderr but tqdm's progress bars (bar updates are \\r- or \\n-separated, a
    nested bar moves the cursor with escape codes)."""
    return [line for line in ANSI.sub("", text).replace("\r", "\n").splitlines()
            if line.strip() and "%|" not in line]


def metrics(cfg):
    rows = [json.loads(line) for line in open(os.path.join(cfg["out_dir"], "metrics.jsonl"))]
    return [{k: v for k, v in row.items() if k not in TIMING} for row in rows]


def saved(what, cfg):
    """The line for a run stopped with `what` saved."""
    again = f"python train.py --config {cfg['out_dir']}/config.yaml --resume"
    return f"interrupted: {what} is saved; continue with: {again}"


def stop_run(tmp_path, path, signum, point, call, step=None):
    """`python train.py --config path` (forked) paused at the `call`-th `point` (of RL step `step`,
    rank_faults.pause_at) gets `signum` from this process: (its exit status, the seconds from the
    signal to its exit, its stderr lines but the bars, how many calls of the paused kind started,
    its stdout)."""
    ready, record = str(tmp_path / "ready"), str(tmp_path / "calls")
    pid = fork_process(run_train, (["--config", path], (point, call), ready, record, step), tmp_path, "train")
    deadline = time.monotonic() + 120
    while not os.path.exists(ready + ".0") and time.monotonic() < deadline:
        if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT):      # ended without pausing
            break
        time.sleep(0.01)
    os.kill(pid, signum)
    sent = time.monotonic()
    rc = wait_process(pid, 60)
    seconds = time.monotonic() - sent
    out, err = read_log(tmp_path, "train")
    assert os.path.exists(ready + ".0"), f"the run never paused at {point}: exit status {rc}\n{stderr_tail(err)}"
    calls = json.load(open(record + ".0")) if os.path.exists(record + ".0") else None
    return rc, seconds, lines(err), calls, out


def resume_as_said(line, capsys):
    """Run the command the line names (in this process, the parity reward): its exit status and stdout."""
    command = line.split("continue with: ")[1].split()
    assert command[:2] == ["python", "train.py"] and command[-1] == "--resume", command
    with pytest.MonkeyPatch.context() as m:
        m.setattr(format_plain, "task_reward", parity)
        capsys.readouterr()
        rc = train.main(command[2:])
    return rc, capsys.readouterr().out


def assert_same_run(whole, cfg):
    """The run in cfg's out_dir wrote exactly what the uninterrupted `whole` wrote: every metrics
    line (but its wall times), the final and warm-start weights, every RNG state and counter, the
    evaluations. Exact: both runs make the same float operations in the same order (one thread, the
    same kernels) and --resume reads back weights, optimizer state and RNG states bit for bit."""
    assert metrics(cfg) == metrics(whole)
    for name in ("warmstart", "ckpt"):
        a = checkpoint.load_policy(os.path.join(whole["out_dir"], name))[0].state_dict()
        b = checkpoint.load_policy(os.path.join(cfg["out_dir"], name))[0].state_dict()
        assert all(torch.equal(a[k], b[k]) for k in a), name
    a, b = (torch.load(os.path.join(c["out_dir"], "ckpt", "trainer_state.pt"), weights_only=False)
            for c in (whole, cfg))
    assert a["step"] == b["step"] == whole["rl_steps"] and a["task_rng"] == b["task_rng"]
    assert without_seconds(a["progress"]) == without_seconds(b["progress"])
    assert a["rngs"][0]["python"] == b["rngs"][0]["python"]
    assert all(torch.equal(a["rngs"][0][k], b["rngs"][0][k]) for k in ("torch", "generator"))
    for name in ("warmstart/eval.json", "eval.json"):
        a, b = (json.load(open(os.path.join(c["out_dir"], name))) for c in (whole, cfg))
        assert without_seconds(a) == without_seconds(b), name
    assert not [name for name in os.listdir(cfg["out_dir"]) if name.endswith((".tmp", ".old"))]   # no save half-done


def saved_step(path):
    return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)["step"]


# ----------------------------------------------------------------------------- setup, warm start

@SIGNALS
@pytest.mark.parametrize("point", ["load_config", "build_tasks", "build_policy"])
def test_a_signal_during_setup_is_one_line_and_nothing_saved(tmp_path, signum, point):
    """Reading the config, building the tasks, building the model: nothing is written before
    setup ends (config.yaml is its last act), so the line says nothing is saved; while the config
    is still being read it cannot name an out_dir either."""
    cfg, path = config_file(tmp_path)
    rc, seconds, err, calls, _ = stop_run(tmp_path, path, signum, point, 1)
    assert rc == 130 and seconds < ANSWER, (rc, seconds, err)
    assert err == ["interrupted during setup: nothing saved" if point == "load_config" else NOTHING_SAVED]
    assert calls == 1
    assert not os.path.exists(cfg["out_dir"])


@SIGNALS
def test_a_signal_inside_the_warm_start_stops_it_at_once_and_nothing_is_saved(tmp_path, capsys, uninterrupted,
                                                                               signum):
    """The signal comes during the warm start's second forward (of several micro-batches in its
    first step): no forward runs after it, no warmstart/ or ckpt/ is written (config.yaml only),
    and the line says so. The same command then starts over and makes the run never stopped."""
    cfg, path = config_file(tmp_path)
    rc, seconds, err, calls, _ = stop_run(tmp_path, path, signum, "warm_start", 2)
    assert rc == 130 and seconds < ANSWER, (rc, seconds, err)
    assert err == [NOTHING_SAVED]
    assert calls == 2
    assert os.listdir(cfg["out_dir"]) == ["config.yaml"]
    with pytest.MonkeyPatch.context() as m:
        m.setattr(format_plain, "task_reward", parity)
        assert train.main(["--config", path]) == 0
    assert_same_run(uninterrupted(), cfg)


@SIGNALS
def test_a_signal_during_the_warm_starts_evaluation_keeps_it_and_resume_is_exact(tmp_path, capsys, uninterrupted,
                                                                                signum):
    """The warm start is saved before its evaluation: the line names it, no RL checkpoint and no
    warmstart/eval.json exist yet, and --resume continues from the warm start (not redone: loaded,
    evaluated, RL from step 1), exactly as the run never stopped."""
    cfg, path = config_file(tmp_path)
    rc, seconds, err, calls, _ = stop_run(tmp_path, path, signum, "evaluate", 1)
    out = cfg["out_dir"]
    assert rc == 130 and seconds < ANSWER, (rc, seconds, err)
    assert err == [saved(f"the finished warm start in {out}/warmstart", cfg)]
    assert calls == 1
    assert find_checkpoint(os.path.join(out, "warmstart")) == os.path.join(out, "warmstart")
    assert not {"ckpt", "ckpt.old", "ckpt.tmp", "metrics.jsonl"} & set(os.listdir(out))
    assert not os.path.exists(os.path.join(out, "warmstart", "eval.json"))
    rc, said = resume_as_said(err[0], capsys)
    assert rc == 0 and f"resumed from {out}/warmstart" in said
    assert_same_run(uninterrupted(), cfg)


# ----------------------------------------------------------------------------- RL

@SIGNALS
@pytest.mark.parametrize("point, call, step, kw", [
    ("sampling", 3, 1, {}),                       # step 1's third sampled token: checkpoint 0 is the last
    ("sampling", 3, 3, {}),                       # step 3's: checkpoint 2
    ("update", 1, 3, {}),                         # the first forward of step 3's update
    ("epoch_end", 2, 3, {"ppo_epochs": 2}),       # step 3's first epoch applied, its second not yet
], ids=["step1-sampling", "step3-sampling", "step3-update", "step3-second-epoch"])
def test_a_signal_inside_an_rl_step_ends_the_run_and_resume_redoes_it_exactly(tmp_path, capsys, uninterrupted, signum,
                                                                              point, call, step, kw):
    """Checkpoints 0, 2 and 4 (save_every 2). A signal inside step 1 or step 3 (while it samples,
    in its update, or after its first PPO epoch was applied to the weights in memory) ends the run
    there: nothing of the kind runs after it, the step writes no metrics line, the line names the
    last checkpoint (0 or 2). --resume loads it and redoes the steps after it, exactly as the run
    never stopped: the epoch applied in memory is gone with the process."""
    whole = uninterrupted(**kw)
    cfg, path = config_file(tmp_path, **kw)
    rc, seconds, err, calls, _ = stop_run(tmp_path, path, signum, point, call, step)
    out, last = cfg["out_dir"], step - 1 - (step - 1) % 2
    assert rc == 130 and seconds < ANSWER, (rc, seconds, err)
    assert err == [saved(f"the checkpoint of RL step {last} in {out}/ckpt", cfg)]
    assert calls == call
    assert find_checkpoint(os.path.join(out, "ckpt"), state=True) == os.path.join(out, "ckpt")
    assert saved_step(os.path.join(out, "ckpt")) == last
    assert metrics(cfg) == metrics(whole)[:step - 1]
    rc, said = resume_as_said(err[0], capsys)
    assert rc == 0 and f"resumed from {out}/ckpt at step {last}" in said
    assert_same_run(whole, cfg)


@SIGNALS
@pytest.mark.parametrize("which", ["after step 3", "final"])
def test_a_signal_during_an_evaluation_in_rl_ends_the_run_and_resume_is_exact(tmp_path, capsys, uninterrupted, signum,
                                                                              which):
    """eval_every 1: evaluations after steps 1, 2, 3 (the 2nd to 4th; the 1st is the warm start's),
    the final one the 5th. A signal in the one after step 3 (which comes before step 3's metrics
    line and save) leaves checkpoint 2 and the lines of steps 1-2; in the final one, checkpoint 4
    and every line, no eval.json. --resume redoes what follows, exactly."""
    whole = uninterrupted(eval_every=1)
    cfg, path = config_file(tmp_path, eval_every=1)
    call, last = {"after step 3": (4, 2), "final": (5, 4)}[which]
    rc, seconds, err, calls, _ = stop_run(tmp_path, path, signum, "evaluate", call)
    out = cfg["out_dir"]
    assert rc == 130 and seconds < ANSWER, (rc, seconds, err)
    assert err == [saved(f"the checkpoint of RL step {last} in {out}/ckpt", cfg)]
    assert calls == call
    assert saved_step(find_checkpoint(os.path.join(out, "ckpt"), state=True)) == last
    assert [m["step"] for m in metrics(cfg)] == list(range(1, last + 1))
    assert "eval_success" in metrics(cfg)[0] and not os.path.exists(os.path.join(out, "eval.json"))
    rc, _ = resume_as_said(err[0], capsys)
    assert rc == 0
    assert_same_run(whole, cfg)


@SIGNALS
@pytest.mark.parametrize("moment", ["save_write", "save_rename"])
def test_a_signal_during_a_save_leaves_the_previous_checkpoint_whole(tmp_path, capsys, uninterrupted, signum, moment):
    """The save of checkpoint 2 is stopped while its trainer_state.pt is half written in ckpt.tmp,
    or between the renames (ckpt already renamed to ckpt.old, ckpt.tmp not yet to ckpt).
    Either way checkpoint 0 stays whole (ckpt, or ckpt.old) and is what the line names and what
    find_checkpoint gives; the folder in progress is never taken for a checkpoint. --resume from
    checkpoint 0 redoes steps 1-4 exactly, and its saves clear ckpt.tmp and ckpt.old away."""
    whole = uninterrupted()
    cfg, path = config_file(tmp_path)
    rc, seconds, err, calls, _ = stop_run(tmp_path, path, signum, moment, 2)      # 1: checkpoint 0
    out = cfg["out_dir"]
    kept = os.path.join(out, "ckpt" if moment == "save_write" else "ckpt.old")
    assert rc == 130 and seconds < ANSWER, (rc, seconds, err)
    assert err == [saved(f"the checkpoint of RL step 0 in {kept}", cfg)]
    assert calls == 2
    assert find_checkpoint(os.path.join(out, "ckpt"), state=True) == kept and saved_step(kept) == 0
    assert damaged_file(kept, state=True) is None
    left = set(os.listdir(out))
    if moment == "save_write":
        assert {"ckpt", "ckpt.tmp"} <= left and "ckpt.old" not in left
        assert damaged_file(os.path.join(out, "ckpt.tmp"), state=True).startswith(
            f"{out}/ckpt.tmp/trainer_state.pt is truncated or corrupt")
    else:
        assert {"ckpt.old", "ckpt.tmp"} <= left and "ckpt" not in left
        assert saved_step(os.path.join(out, "ckpt.tmp")) == 2          # whole, but not swapped in: not taken
    assert [m["step"] for m in metrics(cfg)] == [1, 2]
    rc, said = resume_as_said(err[0], capsys)
    assert rc == 0 and f"resumed from {out}/ckpt at step 0" in said
    assert_same_run(whole, cfg)


# ----------------------------------------------------------------------------- other exceptions

def boom(*a, **k):
    raise ValueError("boom")


def ctrl_c(*a, **k):
    raise KeyboardInterrupt


def test_an_exception_in_rl_is_one_line_and_exit_1(tmp_path, monkeypatch, capsys):
    """An unexpected exception (user code, a library) in an RL step: one line with its type and
    message, exit status 1; with --debug its traceback first, the line last."""
    cfg, path = config_file(tmp_path)
    monkeypatch.setattr(train, "rl_step", boom)
    assert train.main(["--config", path]) == 1
    assert lines(capsys.readouterr().err) == ["error: ValueError: boom (--debug shows the traceback)"]
    assert train.main(["--config", path, "--overwrite", "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and 'raise ValueError("boom")' in err
    assert lines(err)[-1] == "error: ValueError: boom"


def test_an_exception_in_setup_or_evaluate_py_is_one_line(tmp_path, monkeypatch, capsys):
    cfg, path = config_file(tmp_path)
    monkeypatch.setattr(checkpoint, "build_tokenizer", lambda words: boom())
    assert train.main(["--config", path]) == 1
    assert lines(capsys.readouterr().err) == ["error: ValueError: boom (--debug shows the traceback)"]
    monkeypatch.setattr(evaluate_cli, "load_run", boom)
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"]]) == 1
    assert lines(capsys.readouterr().err) == [
        "error in loading the checkpoint: ValueError: boom (--debug shows the traceback)"]
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"], "--debug"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_resume_from_a_warm_start_made_otherwise_names_the_key(tmp_path, monkeypatch, capsys):
    """--resume from a finished warm start under another seed, sft_steps, data_seed or
    rehearsal_context (what made that warm start), or another tokenizer: one line naming the key
    (or token), the saved and the new value, exit 2, the warm start untouched; a key only RL reads
    (rl_steps, group_size) may change. (The warm start is left by Ctrl-C in its evaluation: the
    KeyboardInterrupt raised there as Python's handler raises it.)"""
    cfg, path = config_file(tmp_path, rl_steps=2)
    with monkeypatch.context() as m:
        m.setattr(metrics_module, "evaluate", ctrl_c)
        assert train.main(["--config", path]) == 130
    warm = os.path.join(cfg["out_dir"], "warmstart")
    saved_weights = open(os.path.join(warm, "model.safetensors"), "rb").read()
    capsys.readouterr()
    for key, old, new in (("seed", 1, 2), ("sft_steps", 2, 3), ("data_seed", 0, 5),
                          ("rehearsal_context", "inline", "separate")):
        assert train.main(["--config", path, "--resume", f"--{key}={new}"]) == 2, key
        err = lines(capsys.readouterr().err)
        assert err == [f"error: --resume: the warm start in {warm} was made with {key}={old!r} but the config "
                       f"says {key}={new!r}: another warm start; resume with --{key}={old}, or start over "
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
    assert saved_step(os.path.join(cfg["out_dir"], "ckpt")) == 1
