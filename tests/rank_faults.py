"""train.py on each rank of a 2-rank job with a fault (tests/test_distributed.py runs main in
ranks forked by helpers.fork_ranks): on rank 0, a write refused for a full disk or a signal during
the evaluation; or a signal to rank 1 alone while rank 0 evaluates (sigterm_rank1_eval), at its
first sampled token of RL step 1 (sigterm_rank1_sampling) or its first micro-batch of step 1's
update (sigterm_rank1_update). By hand:

    ENVACE_FAULT=metrics torchrun --nproc_per_node=2 tests/rank_faults.py --config c.yaml
"""
import builtins
import errno
import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from formats import format_plain  # noqa: E402
from machinery import checkpoint  # noqa: E402
from machinery import faults  # noqa: E402
from reporting import metrics  # noqa: E402
import rollout  # noqa: E402
import train  # noqa: E402
from helpers import wrap_train_logprobs  # noqa: E402

TORCH_FULL_DISK = "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"


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
    checkpoint 0); torch.save of anything else (collectives pickle with it) is left alone."""
    real_save, calls = checkpoint.torch.save, []

    def patched(obj, f, *a, **k):
        if str(f).endswith("trainer_state.pt"):
            calls.append(1)
            if len(calls) >= call:
                raise RuntimeError(TORCH_FULL_DISK)
        return real_save(obj, f, *a, **k)
    checkpoint.torch.save = patched


def signal_in_from_rank0(call, signum):
    """For rank 1, which waits while rank 0 evaluates: `signum` as it enters its `call`-th wait
    (faults.from_rank0: the evaluations' waits, the warm start's first)."""
    real, calls = faults.from_rank0, []

    def patched(fn):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return real(fn)
    faults.from_rank0 = patched


def signal_in_evaluate(call, signum):
    real, calls = metrics.evaluate, []

    def patched(*a, **k):
        calls.append(1)
        if len(calls) == call:
            os.kill(os.getpid(), signum)
        return real(*a, **k)
    metrics.evaluate = patched


def signal_in_first_call(module, name, signum, counted=lambda *a, **k: True):
    """`signum` to this process as the first call of module.name that `counted` accepts starts
    (train.token_logprobs: as a run's setup chooses it, wrap_train_logprobs)."""
    calls = []

    def signalling(real):
        def patched(*a, **k):
            if counted(*a, **k):
                calls.append(1)
                if len(calls) == 1:
                    os.kill(os.getpid(), signum)
            return real(*a, **k)
        return patched
    if (module, name) == (train, "token_logprobs"):
        wrap_train_logprobs(signalling)
    else:
        setattr(module, name, signalling(getattr(module, name)))


def count_updates():
    """Per RL update (train.accumulate_gradients), [forwards run, this rank's micro-batches]."""
    updates = []
    accumulate, in_step = train.accumulate_gradients, train.until_signalled

    def counted_accumulate(*a, **k):
        updates.append([0, 0])
        return accumulate(*a, **k)

    def counted_in_step(batches, lengths, model):
        if updates:                             # (not the warm start's)
            updates[-1][1] = len(batches)
        return in_step(batches, lengths, model)

    def counted(forward):
        def counted_forward(*a, **k):
            if k.get("with_entropy"):
                updates[-1][0] += 1
            return forward(*a, **k)
        return counted_forward
    train.accumulate_gradients, train.until_signalled = counted_accumulate, counted_in_step
    wrap_train_logprobs(counted)
    return updates


def main(argv, fault, passes=None):
    """train.main(argv) on this rank (RANK set, as torchrun sets it), with `fault` (on rank 0, or
    one of the sigterm_rank1_* on rank 1) patched in first; returns its exit status. `passes`: a
    path prefix, where each rank writes its RL updates' counts (count_updates) as PREFIX.<rank>."""
    rank = int(os.environ["RANK"])
    updates = count_updates()
    if rank == 0:
        {"metrics": lambda: full_disk_for("metrics.jsonl", "a"),      # step 1's line
         "eval_json": lambda: full_disk_for(os.path.join("run", ".tmp.eval.json")),   # the final evaluation's
         "ckpt": lambda: full_disk_from_save(2),                          # step 1's checkpoint
         "sigint_eval": lambda: signal_in_evaluate(1, signal.SIGINT),     # the warm start's evaluation
         "": lambda: None}.get(fault, lambda: None)()
    elif fault == "sigterm_rank1_eval":       # the warm start's evaluation
        signal_in_from_rank0(1, signal.SIGTERM)
    elif fault == "sigterm_rank1_sampling":   # rank 1 samples in RL alone (rank 0 evaluates alone)
        signal_in_first_call(rollout, "sample_token", signal.SIGTERM)
    elif fault == "sigterm_rank1_update":
        format_plain.task_reward = lambda e, t: float(sum(e["ids"]) % 2)    # groups with variance: an update
        signal_in_first_call(train, "token_logprobs", signal.SIGTERM, lambda *a, **k: k.get("with_entropy"))
    rc = train.main(argv)
    if passes:
        with open(f"{passes}.{rank}", "w") as f:
            json.dump(updates, f)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], os.environ.get("ENVACE_FAULT", "")))
