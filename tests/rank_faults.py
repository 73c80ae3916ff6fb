"""train.py with a fault patched in, for the tests that stop a run: in one process
(tests/test_interrupts.py, tests/test_resume.py) or on each rank of a 2-rank job
(tests/test_distributed.py, ranks forked as torchrun starts them). A fault is a refused write on
rank 0 (a full disk), or a point where the run pauses (`pause_at`) until the test sends the
signal: a user's Ctrl-C or a scheduler's SIGTERM from another process, at a moment the test
chose. By hand (the run pauses; Ctrl-C it):

    ENVACE_FAULT=sampling:3:1 torchrun --nproc_per_node=2 tests/rank_faults.py --config c.yaml
"""
import builtins
import errno
import io
import json
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from formats import features  # noqa: E402
from formats import format_plain  # noqa: E402
from machinery import checkpoint  # noqa: E402
from machinery import config  # noqa: E402
from machinery import savefiles  # noqa: E402
from reporting import metrics  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402

TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
WAIT = 60       # the longest a paused run waits for the test's signal (seconds): never a hang


def parity_reward():
    """Reward episode-length parity (a few warm-start steps answer nothing right): groups have
    reward variance, so RL steps really update and the optimizer state matters for a resume."""
    format_plain.task_reward = lambda e, t: float(len(e["ids"]) % 2)


def full_disk_for(name, modes="wa"):
    """open() of a file ending in `name` for writing (`modes`) fails as on a full disk."""
    real_open = builtins.open

    def patched(file, mode="r", *a, **k):
        if str(file).endswith(name) and mode[0] in modes:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(file, mode, *a, **k)
    builtins.open = patched


def full_disk_from_save(call):
    """torch.save of trainer_state.pt fails as on a full disk from its `call`-th save on (1:
    checkpoint 0); torch.save of anything else is left alone."""
    real_save, calls = savefiles.torch.save, []

    def patched(obj, f, *a, **k):
        if str(f).endswith("trainer_state.pt"):
            calls.append(1)
            if len(calls) >= call:
                raise RuntimeError(TORCH_FULL_DISK)
        return real_save(obj, f, *a, **k)
    savefiles.torch.save = patched


def say_ready(ready):
    """Say that the run is at the chosen point: the file `ready`, holding this pid."""
    with open(ready + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(ready + ".tmp", ready)


def wait_for_signal(ready):
    """say_ready, then wait there for the test's signal, which raises KeyboardInterrupt out of the
    sleep at once."""
    say_ready(ready)
    time.sleep(WAIT)


def on_call(module, name, call, act, counted=lambda *a, **k: True):
    """module.name runs act(*a, **k) at its `call`-th call among those `counted` accepts, before
    its work; returns the list of counted calls (its length: how many started)."""
    real, calls = getattr(module, name), []

    def patched(*a, **k):
        if counted(*a, **k):
            calls.append(1)
            if len(calls) == call:
                act(*a, **k)
        return real(*a, **k)
    setattr(module, name, patched)
    return calls


def rl_steps_started():
    """The RL steps started so far, as a one-element list (rollout.sample_episodes, the RL sampler
    features.sampler_and_reward binds at setup, counts them; the evaluations sample otherwise)."""
    started, real = [0], rollout.sample_episodes

    def sample_episodes(*a, **k):
        started[0] += 1
        return real(*a, **k)
    rollout.sample_episodes = sample_episodes
    return started


def pause_at(point, call, ready, step=None):
    """Patch the run to pause (wait_for_signal(ready)) at the `call`-th time it reaches `point`
    (of RL step `step` where the point is inside one); returns the list of counted calls, whose
    length after the run says that nothing of the kind ran after the signal. Points:
      setup: load_config, build_tasks, build_policy (the calls train.py makes, where it looks them up)
      warm_start       a warm-start forward (train.chosen_logprobs' logprobs, no entropy asked)
      evaluate         an evaluation (1: the warm start's; then eval_every's, the final one)
      sampling         a token the RL sampler samples (rollout.sample_token) in step `step`
      update           a forward of step `step`'s update (the logprobs with entropy)
      epoch_end        the check that ends a PPO epoch of step `step` (train.nonfinite, before
                       its optimizer step: call 2 is after epoch 1 was applied)
      save_write       writing a checkpoint's trainer_state.pt (torch.save as savefiles calls it;
                       1: checkpoint 0): half of it is written, then the pause
      save_rename      the rename of ckpt.tmp to ckpt (after ckpt was renamed to ckpt.old)
      eval_wait        on a rank but 0, entering the wait for rank 0's evaluation
                       (reporting.metrics.from_rank0; 1: the warm start's): the pause comes first
      eval_waiting     the same, but the rank says it is there and goes into the wait (a
                       collective, which holds it until rank 0 broadcasts) instead of pausing"""
    def wait(*a, **k):
        wait_for_signal(ready)
    if point in ("eval_wait", "eval_waiting"):
        return on_call(metrics, "from_rank0", call, wait if point == "eval_wait" else lambda *a, **k: say_ready(ready))
    if point in ("load_config", "build_tasks", "build_policy"):
        module = {"load_config": train if hasattr(train, "load_config") else config, "build_tasks": features,
                  "build_policy": checkpoint}[point]
        return on_call(module, point, call, wait)
    if point == "evaluate":
        return on_call(metrics, "evaluate", call, wait)
    if point in ("warm_start", "update"):
        started, chosen, calls = rl_steps_started(), train.chosen_logprobs, []

        def counted(*a, **k):
            return ("with_entropy" not in k) if point == "warm_start" else (k.get("with_entropy") and
                                                                           started[0] == step)

        def chosen_logprobs(cfg):
            logprobs = chosen(cfg)

            def patched(*a, **k):
                if counted(*a, **k):
                    calls.append(1)
                    if len(calls) == call:
                        wait()
                return logprobs(*a, **k)
            return patched
        train.chosen_logprobs = chosen_logprobs
        return calls
    if point == "sampling":
        started, inside = rl_steps_started(), []
        real_sample = rollout.sample_episodes

        def sample_episodes(*a, **k):
            inside.append(1)
            try:
                return real_sample(*a, **k)
            finally:
                inside.pop()
        rollout.sample_episodes = sample_episodes
        return on_call(rollout, "sample_token", call, wait, lambda *a, **k: inside and started[0] == step)
    if point == "epoch_end":
        started = rl_steps_started()
        return on_call(train, "nonfinite", call, wait, lambda *a, **k: started[0] == step)
    if point == "save_write":
        real_save, calls = savefiles.torch.save, []

        def half_written(obj, f, *a, **k):
            if str(f).endswith("trainer_state.pt"):
                calls.append(1)
                if len(calls) == call:
                    whole = io.BytesIO()
                    real_save(obj, whole, *a, **k)
                    with open(f, "wb") as out:
                        out.write(whole.getvalue()[:len(whole.getvalue()) // 2])
                    wait()
            return real_save(obj, f, *a, **k)
        savefiles.torch.save = half_written          # (torch.save itself: this process only)
        return calls
    if point == "save_rename":
        return on_call(savefiles.os, "replace", call, wait, lambda src, dst: str(src).endswith("ckpt.tmp"))
    raise ValueError(f"no such point: {point}")


def own_tqdm_lock():
    """Give this forked process tqdm write locks of its own. tqdm's lock is a multiprocessing lock
    shared with the process this one was forked from (the test's), plus a thread lock copied at
    the fork: a signal that stops this process while it holds the first (a bar's update) would
    leave the test hanging at its next bar, and a fork while the test's monitor thread held the
    second would leave this process hanging at its first."""
    import multiprocessing
    import threading
    from tqdm import tqdm
    from tqdm.std import TqdmDefaultWriteLock
    TqdmDefaultWriteLock.mp_lock, TqdmDefaultWriteLock.th_lock = multiprocessing.RLock(), threading.RLock()
    tqdm.set_lock(TqdmDefaultWriteLock())


def run_train(argv, fault=None, ready=None, record=None, step=None):
    """train.main(argv) in this process (a forked `python train.py`, or a rank of a job: RANK
    set), its RL reward the parity one, with `fault` patched in first: a refused write on rank 0
    ("metrics", "eval_json", "ckpt"), or (POINT, CALL) paused at on every rank (pause_at: the file
    `ready` + ".<rank>"), or a list of those, one per rank (None: none on that rank). `record`: a
    path where the run writes how many calls of the paused kind started (as `record`.<rank>).
    Returns the exit status."""
    rank = int(os.environ.get("RANK", 0))
    own_tqdm_lock()
    parity_reward()
    calls = []
    if isinstance(fault, list):
        fault = fault[rank]
    if fault in ("metrics", "eval_json", "ckpt"):
        if rank == 0:
            {"metrics": lambda: full_disk_for("metrics.jsonl", "a"),                 # step 1's line
             "eval_json": lambda: full_disk_for(os.path.join("run", ".tmp.eval.json")),  # the final evaluation's
             "ckpt": lambda: full_disk_from_save(2)}[fault]()                       # step 1's checkpoint
    elif fault is not None:
        point, call = fault
        calls = pause_at(point, call, f"{ready}.{rank}", step)
    rc = train.main(argv)
    for signum in (signal.SIGINT, signal.SIGTERM):   # a signal sent to a run already ended: its exit status stays
        signal.signal(signum, signal.SIG_IGN)
    if record:
        with open(f"{record}.{rank}", "w") as f:
            json.dump(len(calls), f)
    return rc


if __name__ == "__main__":
    # ENVACE_FAULT=POINT:CALL[:STEP] (pause_at; the ready files are ./ready.<rank>) or a refused write
    spec = os.environ.get("ENVACE_FAULT", "")
    parts = spec.split(":")
    if len(parts) > 1:
        sys.exit(run_train(sys.argv[1:], (parts[0], int(parts[1])), "ready",
                           step=int(parts[2]) if len(parts) > 2 else None))
    sys.exit(run_train(sys.argv[1:], spec or None))
