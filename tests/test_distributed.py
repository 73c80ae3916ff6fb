"""Several processes (gloo on CPU): 2 ranks x B/2 rows make the same update as 1 rank x B rows,
a rank with no trained token adds nothing to the loss's token count, and a 2-process torchrun
run of a small config finishes and writes one metrics file; a write refused on rank 0 stops every
rank with one line; Ctrl-C or SIGTERM forwarded to every rank (as torchrun does) ends them all
with rank 0's one line."""
import envace
from machinery import config
import json
import contextlib
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP

from machinery import checkpoint
import train
import world
from envace import REHEARSE, encode_episode
import rank_faults
from helpers import (GRAD_TOLERANCE, assert_same_gradients, descendants, fork_process, fork_ranks, read_log, recording,
                     run_command, run_ranks, stderr_tail, step_grads, tiny_cfg, tiny_llama, toy_tokenizer, wait_ranks)
from test_interrupts import lines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fixed_step_inputs():
    """4 groups of 3 rehearse-mode episodes with mixed rewards, built by hand (no sampling)."""
    tok = toy_tokenizer()
    rng = random.Random(0)
    tasks = [world.random_task(rng, "new") for _ in range(4)]
    episodes = [encode_episode(tok, t["prompt"], t["calls"][:k], world.replay(t["calls"][:k]), t["answer"],
                               env_role=REHEARSE) for t in tasks for k in (1, 2, 3)]
    rewards = [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    groups = [i // 3 for i in range(12)]
    return tok, episodes, rewards, groups


BUDGET = 50     # rank 0's rows pack into 3 micro-batches, rank 1's into 5: the ranks must still
                # run the same number of forward/backward passes (rank 0 adds 2 with weight 0)


SGD_LR = 0.1


def one_update(rank, world_size):
    """One rl_step from the fixed inputs on this rank's share of the groups, with plain SGD (the
    weights move by lr x the gradient, so a float difference in the gradient stays that small in
    the weights; AdamW's first step is g / |g| elementwise, which turns a last-bit difference of a
    near-zero entry into a whole learning rate); returns the model and the step's gradients."""
    tok, episodes, rewards, groups = fixed_step_inputs()
    model = tiny_llama(tok, seed=0)
    ddp_model = DDP(model) if world_size > 1 else model
    opt = recording(torch.optim.SGD)(model.parameters(), lr=SGD_LR)
    share = slice(rank * 12 // world_size, (rank + 1) * 12 // world_size)    # whole groups per rank
    cfg = {**config.DEFAULTS, "micro_batch_tokens": BUDGET, "kl_coef": 0.0, "group_size": 3}
    batch = train.make_batch(episodes[share], rewards[share], cfg, tok.pad_token_id)
    stats = train.rl_step(model, ddp_model, opt, batch, cfg, contextlib.nullcontext())   # (world size: the group's)
    assert stats["status"] == "updated"
    return model, step_grads(model, opt)


def _worker(rank, world_size, init_file, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    model, grads = one_update(rank, world_size)
    if rank == 0:
        torch.save((model.state_dict(), grads), result_file)
    dist.destroy_process_group()


def test_two_ranks_make_the_one_rank_update(tmp_path):
    torch.set_num_threads(1)
    lengths = [len(e["ids"]) for e in fixed_step_inputs()[1]]
    assert [len(envace.micro_batches(half, BUDGET)) for half in (lengths[:6], lengths[6:])] == [3, 5]
    result = str(tmp_path / "two_ranks.pt")
    run_ranks(_worker, (2, str(tmp_path / "init"), result), tmp_path)
    two, two_grads = torch.load(result)
    model, one_grads = one_update(0, 1)
    one = model.state_dict()
    # the first step's gradient, before any optimizer step (GRAD_TOLERANCE: why 1e-4 of the largest
    # entry): a wrong normaliser (local instead of global token count, no x world_size) moves it by half
    assert_same_gradients(one_grads, two_grads)
    # one SGD step, w - lr x g (the gradient's norm is under grad_clip: not clipped): the largest
    # move is lr x the largest gradient entry, and the two runs' weights differ by at most lr x
    # their gradients' difference plus a float32 rounding of each w (|w| <= 1: 6e-8 each)
    g_max = max(g.abs().max().item() for g in one_grads.values())
    assert math.sqrt(sum(g.square().sum().item() for g in one_grads.values())) < 1
    start = tiny_llama(toy_tokenizer(), seed=0).state_dict()
    moved = max((one[k] - start[k]).abs().max().item() for k in one)
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    print(f"max abs weight difference, 2 ranks vs 1: {diff:.3g} (the step moved them up to {moved:.3g})")
    assert moved == pytest.approx(SGD_LR * g_max, rel=1e-3)
    assert diff <= SGD_LR * GRAD_TOLERANCE * g_max + 1.2e-7


def _zero_token_worker(rank, world_size, init_file, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    sums, batch, grads = zero_token_update(rank, world_size)
    torch.save((sums, batch["n_tokens"], grads), f"{result_file}.{rank}")
    dist.destroy_process_group()


def zero_token_update(rank, world_size):
    """act_coef 0: only REHEARSE targets are trained. Rank 0 holds three rehearse-mode episodes of
    'price apple' with 1, 2, 3 calls ('3 </env>': 2, 4, 6 REHEARSE targets) and rewards 1, 0, 0;
    rank 1 (on 2 ranks) holds the same three episodes in real mode (responses OBS): no trained
    target at all. The old logprobs are recomputed (ratio 1)."""
    tok = toy_tokenizer()
    env_role = REHEARSE if rank == 0 else envace.OBS
    episodes = [encode_episode(tok, "price apple", ["price apple"] * k, ["3"] * k, "3", env_role=env_role)
                for k in (1, 2, 3)]
    model = tiny_llama(tok, seed=0)
    ddp_model = DDP(model) if world_size > 1 else model
    cfg = {**config.DEFAULTS, "act_coef": 0.0, "kl_coef": 0.0, "reuse_sampler_logprobs": False, "group_size": 3}
    batch = train.make_batch(episodes, [1.0, 0.0, 0.0], cfg, tok.pad_token_id)
    opt = recording(torch.optim.SGD)(model.parameters(), lr=0.0)
    stats = train.rl_step(model, ddp_model, opt, batch, cfg, contextlib.nullcontext())
    assert stats["status"] == "updated"
    targets = batch["roles"][:, 1:]            # trained (REHEARSE) and context (OBS) targets of this rank
    counts = {"tokens_rehearse": int((targets == REHEARSE).sum()), "tokens_obs": int((targets == envace.OBS).sum())}
    return {**stats, **counts}, batch, step_grads(model, opt)


def test_a_rank_without_trained_tokens_adds_nothing_to_the_token_count(tmp_path):
    """The loss is divided by the trained tokens of the whole step: 2 + 4 + 6 = 12 REHEARSE targets,
    all on rank 0. Advantages 2/3, -1/3, -1/3 at ratio 1: loss = -(2/3 x 2 - 1/3 x 4 - 1/3 x 6) / 12
    = 2 / 12 = 1/6 over both ranks, the 1-rank loss of rank 0's episodes alone, and so is the
    gradient. Mutation: each rank's count clamped to >= 1 before the sum (13: loss 2/13)."""
    torch.set_num_threads(1)
    result = str(tmp_path / "sums")
    run_ranks(_zero_token_worker, (2, str(tmp_path / "init"), result), tmp_path)
    (sums0, n0, grads0), (sums1, n1, grads1) = (torch.load(f"{result}.{r}") for r in (0, 1))
    assert (n0, n1) == (12, 0)                             # make_batch: this rank's own count, 0 if none
    assert sums0["tokens_rehearse"] == 12 and sums1["tokens_rehearse"] == 0 and sums1["tokens_obs"] == 12
    # ratio 1 within float32 rounding of two forwards (1e-6 of each token's term, 12 terms)
    assert sums0["loss"] + sums1["loss"] == pytest.approx(1 / 6, abs=1e-5)
    assert sums1["loss"] == 0.0 and sums1["rows_updated"] == 0
    alone_sums, _, alone_grads = zero_token_update(0, 1)
    assert alone_sums["loss"] == pytest.approx(1 / 6, abs=1e-5)
    assert_same_gradients(alone_grads, grads0)
    assert_same_gradients(grads0, grads1)                  # DDP: every rank holds the summed gradient


def test_torchrun_two_processes_write_one_metrics_file(tmp_path):
    cfg = tiny_cfg(tmp_path, rl_steps=2, save_every=1)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_command([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "train.py", "--config", str(path)], 240, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-1500:] + proc.stderr[-3000:]
    out = cfg["out_dir"]
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [1, 2]
    # 4 tasks x 4 samples over 2 ranks: the metrics add up both ranks' episodes
    assert all(sum(line["causes"].values()) == 16 for line in lines)
    assert proc.stdout.count("real-world success") == 1, proc.stdout          # rank 0 prints alone
    assert os.path.isfile(os.path.join(out, "ckpt", "trainer_state.pt"))
    assert len(torch.load(os.path.join(out, "ckpt", "trainer_state.pt"), weights_only=False)["rngs"]) == 2


def ranks_with_fault(tmp_path, fault, **kw):
    """train.py on 2 ranks (forked as torchrun would start them: helpers.fork_ranks) with `fault`
    on rank 0 (rank_faults.run_train): (cfg, each rank's exit status, our lines on stderr). A rank
    left waiting at a collective fails the test after fork_ranks' timeout instead of hanging."""
    cfg = tiny_cfg(tmp_path, sft_steps=2, n_test=2, rl_steps=1, **kw)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rcs, err = fork_ranks(rank_faults.run_train, (["--config", str(path)], fault), tmp_path)
    ours = [line for line in err if line.startswith(("error", "rank ", "interrupted", "warning"))]
    return cfg, rcs, ours


@pytest.mark.parametrize("fault, file", [("ckpt", "ckpt"), ("eval_json", "eval.json")])
def test_a_write_refused_on_rank0_stops_every_rank_with_one_line(tmp_path, fault, file):
    """Rank 0 alone writes; its full disk in a write every rank waits for (the step-1 checkpoint,
    the final eval.json: distributed.from_rank0) is one `error:` line naming the file and exit 2
    on BOTH ranks, rank 1 told by from_rank0 instead of dying of rank 0's closed connection."""
    cfg, rcs, ours = ranks_with_fault(tmp_path, fault)
    assert rcs == [2, 2], (rcs, ours)
    assert len(ours) == 1 and ours[0].startswith("error: cannot ") and f"{cfg['out_dir']}/{file}" in ours[0], ours
    ckpt = os.path.join(cfg["out_dir"], "ckpt")
    assert checkpoint.find_checkpoint(ckpt, state=True) == ckpt and not os.path.exists(ckpt + ".tmp")
    step = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)["step"]
    assert step == (1 if fault == "eval_json" else 0)       # the last good checkpoint, whole
    assert not os.path.exists(os.path.join(cfg["out_dir"], "eval.json"))


def start_ranks(target, args, log_dir, world_size=2):
    """The pids of `world_size` ranks of one gloo job running target(*args), started as
    helpers.fork_ranks starts them (the variables torchrun sets; output in log_dir/rank<N>.out,
    .err), for a test that signals them before it waits (helpers.wait_ranks)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return [fork_process(target, args, log_dir, f"rank{rank}",
                         {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                          "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
            for rank in range(world_size)]


ANSWER = 10     # seconds from the signal to the last rank's exit, at most (it takes a fraction of one)


def signalled_ranks(tmp_path, signum, faults, to=(1, 0), settle=0.0, one_by_one=False, step=None, **kw):
    """train.py on 2 ranks, rank r paused at faults[r] (rank_faults.pause_at; None: not paused).
    Once every paused rank is there (and `settle` seconds more), this process sends `signum` to the
    ranks `to` in that order, as torchrun forwards a Ctrl-C or a SIGTERM to its workers (rank 1's
    first by default: a rank that waits for rank 0 then holds its own signal before rank 0 can act
    on its; `one_by_one`: each after the one before has exited). Returns (cfg, each rank's exit
    status, the seconds from the first signal to the last exit, each rank's stderr lines but the
    bars, each rank's count of calls of its paused kind)."""
    cfg = tiny_cfg(tmp_path, threads=1, sft_steps=2, n_test=2, rl_steps=2, save_every=1, **kw)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    ready, record = str(tmp_path / "ready"), str(tmp_path / "calls")
    pids = start_ranks(rank_faults.run_train, (["--config", str(path)], faults, ready, record, step), tmp_path)

    def ended(pid):
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    deadline = time.monotonic() + 120
    while not all(os.path.exists(f"{ready}.{r}") for r in (0, 1) if faults[r]) and time.monotonic() < deadline:
        if any(ended(pid) for pid in pids):
            break
        time.sleep(0.01)
    time.sleep(settle)
    sent = time.monotonic()
    for r in to:
        os.kill(pids[r], signum)
        while one_by_one and not ended(pids[r]) and time.monotonic() < sent + 30:
            time.sleep(0.01)
    rcs = wait_ranks(pids, tmp_path, 60)
    seconds = time.monotonic() - sent
    err = [lines(read_log(tmp_path, f"rank{r}")[1]) for r in (0, 1)]
    assert all(os.path.exists(f"{ready}.{r}") for r in (0, 1) if faults[r]), (rcs, err)
    calls = [json.load(open(f"{record}.{r}")) if os.path.exists(f"{record}.{r}") else None for r in (0, 1)]
    return cfg, rcs, seconds, err, calls


def interrupted_line(cfg, what):
    return (f"interrupted: {what} is saved; continue with: python train.py --config {cfg['out_dir']}/config.yaml "
            f"--resume")


@pytest.mark.parametrize("signum, point, call", [(signal.SIGINT, "sampling", 3), (signal.SIGTERM, "update", 1)],
                         ids=["SIGINT-sampling", "SIGTERM-update"])
def test_a_signal_to_every_rank_inside_an_rl_step_ends_both_with_one_line(tmp_path, signum, point, call):
    """Both ranks inside RL step 2 (each sampling its own share, at its third token; or at the
    first forward of the update), the signal sent to both as torchrun forwards it: both exit 130
    within seconds, nothing of the kind runs after it on either, rank 0 alone prints its one line
    naming the checkpoint of step 1 (save_every 1), rank 1 prints nothing."""
    cfg, rcs, seconds, err, calls = signalled_ranks(tmp_path, signum, [(point, call)] * 2, step=2)
    assert rcs == [130, 130] and seconds < ANSWER, (rcs, seconds, err)
    out = cfg["out_dir"]
    assert err == [[interrupted_line(cfg, f"the checkpoint of RL step 1 in {out}/ckpt")], []], err
    assert calls == [call, call]
    assert torch.load(os.path.join(out, "ckpt", "trainer_state.pt"), weights_only=False)["step"] == 1
    assert [json.loads(line)["step"] for line in open(os.path.join(out, "metrics.jsonl"))] == [1]


@pytest.mark.parametrize("signum, to", [
    (signal.SIGINT, (0,)),
    (signal.SIGTERM, (1, 0)),
], ids=["rank0-alone", "both"])
def test_a_signal_during_rank0s_evaluation_ends_both_ranks(tmp_path, signum, to):
    """Rank 0 runs the warm start's evaluation alone while rank 1 waits for its result inside a
    collective (distributed.from_rank0's broadcast; the signal comes a second after rank 1 went
    in). The signal to rank 0 alone, or to both as torchrun forwards it (rank 1's own then waits
    in the collective, which no signal interrupts, until rank 0 broadcasts): both exit 130 within
    seconds, rank 1 by the KeyboardInterrupt from_rank0 raises on hearing that rank 0 was
    interrupted (or its own, pending); rank 0's one line names the saved warm start, rank 1 prints
    nothing, no RL checkpoint is written."""
    cfg, rcs, seconds, err, calls = signalled_ranks(tmp_path, signum, [("evaluate", 1), ("eval_waiting", 1)], to,
                                                    settle=1.0)
    assert rcs == [130, 130] and seconds < ANSWER, (rcs, seconds, err)
    warm = os.path.join(cfg["out_dir"], "warmstart")
    assert err == [[interrupted_line(cfg, f"the finished warm start in {warm}")], []], err
    assert calls == [1, 1]
    assert checkpoint.find_checkpoint(warm) == warm and not os.path.exists(os.path.join(cfg["out_dir"], "ckpt"))


def test_a_signal_to_both_ranks_while_rank1_is_not_yet_in_its_wait(tmp_path):
    """As above, but rank 1 gets its signal in Python, on its way into the wait for rank 0's
    evaluation (paused just before it), and has exited when rank 0 gets its own, as torchrun's
    forwarded signals may find them: both must still exit 130, rank 0 with its one line."""
    cfg, rcs, seconds, err, calls = signalled_ranks(tmp_path, signal.SIGINT, [("evaluate", 1), ("eval_wait", 1)],
                                                    (1, 0), one_by_one=True)
    assert rcs == [130, 130] and seconds < ANSWER, (rcs, seconds, err)
    warm = os.path.join(cfg["out_dir"], "warmstart")
    assert err == [[interrupted_line(cfg, f"the finished warm start in {warm}")], []], err


def test_ctrl_c_to_torchrun_ends_both_workers_with_one_line_and_resume_continues(tmp_path):
    """The real launcher: `torchrun --nproc_per_node=2 train.py` (gloo on CPU) gets Ctrl-C (SIGINT)
    once RL has written a metrics line, at no chosen point of a step (save_every 0: checkpoint 0 is
    the last, and no save is running then). torchrun
    forwards it to both workers (its log says so); each ends at once, rank 0 with its one line
    naming checkpoint 0. torchrun itself then raises its own SignalException (its traceback, torch's
    elastic agent's, not train.py's) and exits with status 1, not the workers' 130: a script reads
    torchrun's 1 and rank 0's line. No worker is left running, and --resume on 2 ranks continues
    from checkpoint 0. A worker's exit takes a few seconds here (the interpreter's final garbage
    collection of torch's modules), hence the 60 s bound."""
    cfg = tiny_cfg(tmp_path, threads=1, sft_steps=2, n_test=2, rl_steps=1000, save_every=0)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = cfg["out_dir"]
    metrics_file = os.path.join(out, "metrics.jsonl")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    with open(tmp_path / "torchrun.out", "w") as stdout, open(tmp_path / "torchrun.err", "w") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                                 "train.py", "--config", str(path)], cwd=ROOT, env=env, stdout=stdout, stderr=stderr)
    workers = []
    try:
        deadline = time.monotonic() + 180
        while proc.poll() is None and time.monotonic() < deadline:
            workers = descendants(proc.pid) or workers
            if os.path.exists(metrics_file) and open(metrics_file).read().count("\n") >= 1:
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"torchrun ended before RL: {proc.returncode}"
        proc.send_signal(signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:                     # (a hang: everything it started killed, never left running)
            for pid in descendants(proc.pid) + [proc.pid]:
                os.kill(pid, signal.SIGKILL)
            proc.wait()
    err = open(tmp_path / "torchrun.err").read()
    assert rc == 1 and "SignalException: Process" in err and "got signal: 2" in err, (rc, stderr_tail(err))
    assert err.count("Traceback") == 1                          # torchrun's own; none from a worker
    assert err.count("closing signal SIGINT") == 2              # forwarded to both workers
    assert len(workers) == 2 and not [w for w in workers if alive(w)]
    ours = [line for line in lines(err) if line.startswith(("interrupted", "error", "rank ", "warning"))]
    assert ours == [interrupted_line(cfg, f"the checkpoint of RL step 0 in {out}/ckpt")], ours

    rcs, _ = fork_ranks(train.main, (["--config", f"{out}/config.yaml", "--resume", "--rl_steps=1"],), tmp_path)
    assert rcs == [0, 0], read_log(tmp_path, "rank0")[1][-3000:]
    assert f"resumed from {out}/ckpt at step 0" in read_log(tmp_path, "rank0")[0]
    assert [json.loads(line)["step"] for line in open(metrics_file)] == [1]
    assert torch.load(os.path.join(out, "ckpt", "trainer_state.pt"), weights_only=False)["step"] == 1


def alive(pid):
    """Whether process `pid` still runs (not gone, not a zombie left for its parent to reap)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _deadlocked_rank(rank, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    if rank == 1:
        dist.barrier()                      # rank 0 never calls it
    else:
        dist.all_reduce(torch.zeros(1))


def test_ranks_at_different_collectives_fail_the_test_with_their_stacks(tmp_path):
    """The harness of every multi-process test (helpers.run_ranks; fork_ranks waits the same way):
    ranks deadlocked at different collectives are killed at the timeout and the test fails
    naming where each one waits, instead of hanging the suite (mp.start_processes(join=True)
    waited for gloo's 30 minutes)."""
    with pytest.raises(pytest.fail.Exception) as failed:
        run_ranks(_deadlocked_rank, (str(tmp_path / "init"),), tmp_path, timeout=5)
    message = str(failed.value)
    assert message.startswith("still running after 5 s: a deadlock") and "killed rank(s) [0, 1]" in message, message
    rank0, rank1 = message.split("rank 1 stderr ends:")
    assert " in all_reduce" in rank0 and " in barrier" in rank1, message


def test_a_command_still_running_is_killed_with_every_process_it_started(tmp_path):
    """helpers.run_command (the torchrun test's): past its timeout the command and every process
    below it are killed, one in a session of its own too (as torchrun starts its workers), and
    the test fails instead of hanging."""
    pid_file = tmp_path / "worker.pid"
    script = ("import subprocess, sys, time\n"
              "w = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'], start_new_session=True,\n"
              "                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)\n"
              f"open({str(pid_file)!r}, 'w').write(str(w.pid))\n"
              "time.sleep(600)\n")
    with pytest.raises(pytest.fail.Exception, match="still running after 3 s .* killed with every process it started"):
        run_command([sys.executable, "-c", script], 3)
    worker = int(pid_file.read_text())
    try:                                    # gone, or a zombie left for init to reap
        state = open(f"/proc/{worker}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z"), state


def _dynamic_sampling_worker(rank, world_size, init_file, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    result = dynamic_sampling_update(rank, world_size)
    torch.save(result, f"{result_file}.{rank}")
    dist.destroy_process_group()


def dynamic_sampling_update(rank, world_size, only=None):
    """max_sample_rounds 2, tasks_per_step 4, group_size 2 (test_dynamic_sampling's scripted format:
    B, D, F vary, A, C, E, H do not). Round 1 draws B D A C: rank 0 samples B D (both vary), rank
    1 A C (none): 2 of 4; round 2 draws F A E H: rank 0's F varies, rank 1's E H do not: 3, and
    the rounds are spent. Both ranks: 2 rounds, 3 groups kept, rank 0's B D F, rank 1 none (an idle
    row). Then one SGD rl_step on the batch of what the sampler returned, as train.py's loop makes
    it; `only`: one process updating on those episodes and rewards alone."""
    from types import SimpleNamespace
    from formats import features
    from test_dynamic_sampling import G, TASKS, ScriptedDraws, ScriptedFormat
    tok = toy_tokenizer()
    cfg = {**config.DEFAULTS, "tasks_per_step": 4, "group_size": G, "max_sample_rounds": 2, "kl_coef": 0.0,
           "reuse_sampler_logprobs": False}
    fmt, rng = ScriptedFormat(), ScriptedDraws("BDAC", "FAEH")
    sample, reward = features.sampler_and_reward(fmt, SimpleNamespace(tokenizer=None), cfg, TASKS,
                                                 contextlib.nullcontext(), rng)       # ranks: the process group's
    prompts = [t for t in rng.sample(TASKS, 4)[rank * 2:(rank + 1) * 2] for _ in range(G)]   # the loop's slice
    episodes = sample(None, prompts=prompts, generator=None)
    rewards = [reward(e, t) for e, t in zip(episodes, prompts)]
    if only is not None:
        episodes, rewards = only
    model = tiny_llama(tok, seed=0)
    ddp_model = DDP(model) if world_size > 1 else model
    opt = recording(torch.optim.SGD)(model.parameters(), lr=0.1)
    stats = train.rl_step(model, ddp_model, opt, train.make_batch(episodes, rewards, cfg, tok.pad_token_id), cfg,
                          contextlib.nullcontext())
    return {"names": fmt.sampled, "kept": [e["name"] if "name" in e else e["cause"] for e in episodes[::G]],
            "counts": episodes[0]["sampling"], "episodes": (episodes, rewards), "status": stats["status"],
            "grads": step_grads(model, opt)}


def test_two_ranks_draw_as_many_rounds_and_update_on_the_groups_kept(tmp_path):
    """Every rank takes the same rounds (the count of kept groups is summed over ranks) and keeps
    the first groups in the global order; a rank that kept none joins the update with an idle row
    and adds nothing: the 2-rank gradient is the 1-process gradient of rank 0's kept rows alone.
    Mutations: the count not summed over ranks (rank 1 sees 0 kept: all its rows, the all-equal
    ones, in the token mean), the idle row's tokens trained."""
    torch.set_num_threads(1)
    result = str(tmp_path / "ranks")
    run_ranks(_dynamic_sampling_worker, (2, str(tmp_path / "init"), result), tmp_path)
    r0, r1 = (torch.load(f"{result}.{r}", weights_only=False) for r in (0, 1))
    assert r0["names"] == [["B", "D"], ["F", "A"]] and r1["names"] == [["A", "C"], ["E", "H"]]
    assert r0["counts"] == r1["counts"] == {"sample_rounds": 2, "groups_sampled": 8, "episodes_sampled": 16,
                                            "groups_kept": 3}
    assert (r0["kept"], r1["kept"]) == (["B", "D", "F"], ["idle"])
    assert [len(r0["episodes"][0]), len(r1["episodes"][0])] == [6, 1]
    assert r0["status"] == r1["status"] == "updated"
    alone = dynamic_sampling_update(0, 1, only=r0["episodes"])
    assert_same_gradients(alone["grads"], r0["grads"])
    assert_same_gradients(r0["grads"], r1["grads"])
