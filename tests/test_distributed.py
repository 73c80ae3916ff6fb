"""Several processes (gloo on CPU): 2 ranks x B/2 rows make the same update as 1 rank x B rows,
a rank with no trained token adds nothing to the loss's token count, and a 2-process torchrun
run of a small config finishes and writes one metrics file."""
import envace
from machinery import config
import json
import math
import os
import random
import sys

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
from helpers import (GRAD_TOLERANCE, assert_same_gradients, fork_ranks, read_log, recording, run_command, run_ranks,
                     step_grads, tiny_cfg, tiny_llama, toy_tokenizer)

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
    cfg = {**config.DEFAULTS, "micro_batch_tokens": BUDGET, "kl_coef": 0.0}
    _, status = train.rl_step(model, ddp_model, opt, episodes[share], rewards[share], groups[share],
                              cfg, tok.pad_token_id)      # (the world size from the process group)
    assert status == "updated"
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
    cfg = {**config.DEFAULTS, "act_coef": 0.0, "kl_coef": 0.0, "reuse_sampler_logprobs": False}
    batch = train.make_batch(episodes, [1.0, 0.0, 0.0], [rank] * 3, cfg, tok.pad_token_id)
    opt = recording(torch.optim.SGD)(model.parameters(), lr=0.0)
    sums, status = train.rl_step(model, ddp_model, opt, episodes, [1.0, 0.0, 0.0], [rank] * 3, cfg,
                                 tok.pad_token_id)
    assert status == "updated"
    return sums, batch, step_grads(model, opt)


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
    """tests/rank_faults.py on 2 ranks (forked as torchrun would start them: helpers.fork_ranks)
    with `fault` on rank 0: (cfg, each rank's exit status, our lines on stderr). A rank left
    waiting at a collective fails the test after fork_ranks' timeout instead of hanging. Each
    rank's RL updates' counts (rank_faults.count_updates) are in tmp_path/passes.<rank>."""
    cfg = tiny_cfg(tmp_path, sft_steps=2, n_test=2, rl_steps=1, **kw)
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    rcs, err = fork_ranks(rank_faults.main, (["--config", str(path)], fault, str(tmp_path / "passes")), tmp_path)
    ours = [line for line in err if line.startswith(("error", "rank ", "interrupted", "warning"))]
    return cfg, rcs, ours


@pytest.mark.parametrize("fault, file", [("ckpt", "ckpt"), ("metrics", "metrics.jsonl"), ("eval_json", "eval.json")])
def test_a_write_refused_on_rank0_stops_every_rank_with_one_line(tmp_path, fault, file):
    """Rank 0 alone writes; its full disk (the step-1 checkpoint, a metrics line, the final
    eval.json) is one `error:` line naming the file and exit 2 on BOTH ranks: before, rank 1 went
    on to the next collective and died of rank 0's closed connection (its own line, exit 1)."""
    cfg, rcs, ours = ranks_with_fault(tmp_path, fault)
    assert rcs == [2, 2], (rcs, ours)
    assert len(ours) == 1 and ours[0].startswith("error: cannot ") and f"{cfg['out_dir']}/{file}" in ours[0], ours
    ckpt = os.path.join(cfg["out_dir"], "ckpt")
    assert checkpoint.find_checkpoint(ckpt, state=True) == ckpt and not os.path.exists(ckpt + ".tmp")
    step = torch.load(os.path.join(ckpt, "trainer_state.pt"), weights_only=False)["step"]
    assert step == (1 if fault == "eval_json" else 0)       # the last good checkpoint, whole
    assert not os.path.exists(os.path.join(cfg["out_dir"], "eval.json"))


@pytest.mark.parametrize("fault", ["sigint_eval", "sigterm_rank1_eval"])
def test_a_signal_during_rank0s_evaluation_stops_every_rank_with_one_line(tmp_path, fault):
    """Ctrl-C reaching rank 0 while it runs the warm start's evaluation alone, or SIGTERM reaching
    rank 1 alone while it waits for it: exit 130 on both ranks, rank 0's one line naming the saved
    warm start (the final evaluation goes the same way, real_world_eval); before, one rank died of
    the other's closed connection with a second line and exit 1."""
    cfg, rcs, ours = ranks_with_fault(tmp_path, fault)
    assert rcs == [130, 130], (rcs, ours)
    warm = os.path.join(cfg["out_dir"], "warmstart")
    assert ours == [f"interrupted during evaluation: the finished warm start is saved in {warm}; continue from "
                    f"it (evaluation, gate, RL) with: python train.py --config {cfg['out_dir']}/config.yaml "
                    f"--resume"], ours
    assert checkpoint.find_checkpoint(warm) == warm and not os.path.exists(os.path.join(cfg["out_dir"], "ckpt"))


@pytest.mark.parametrize("fault", ["sigterm_rank1_sampling", "sigterm_rank1_update"])
def test_a_signal_to_one_rank_inside_an_rl_step_drops_it_on_every_rank(tmp_path, fault):
    """SIGTERM reaching rank 1 alone at its first sampled token of RL step 1 (rank 1 stops
    sampling there; rank 0 samples on, then both agree before anything else) or at the first
    micro-batch of its update (both stop before their second): the step is dropped on both ranks
    (no update ran, or one micro-batch of several; counted on each rank), exit 0 on both, rank 0's
    one line; the checkpoint of step 0 stays the last, nothing half-saved."""
    cfg, rcs, ours = ranks_with_fault(tmp_path, fault, micro_batch_tokens=60)
    assert rcs == [0, 0], (rcs, ours)
    out = cfg["out_dir"]
    said = [line for line in read_log(tmp_path, "rank0")[0].splitlines() if line.startswith("interrupted")]
    assert said == [f"interrupted during RL step 1 (dropped: --resume redoes it): checkpoint of step 0 saved in "
                    f"{out}/ckpt. Resume with:"], said
    assert read_log(tmp_path, "rank1")[0] == ""
    updates = [json.load(open(tmp_path / f"passes.{rank}")) for rank in (0, 1)]
    if fault == "sigterm_rank1_sampling":
        assert updates == [[], []]
    else:
        # every rank runs as many micro-batches as the rank with most (distributed.in_step)
        assert [forwards for (forwards, _), in updates] == [1, 1] and max(n for (_, n), in updates) >= 2, updates
    assert torch.load(os.path.join(out, "ckpt", "trainer_state.pt"), weights_only=False)["step"] == 0
    assert open(os.path.join(out, "metrics.jsonl")).read() == ""
    assert sorted(os.listdir(out)) == ["ckpt", "config.yaml", "metrics.jsonl", "warmstart"]


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
    the rounds are spent. Both ranks: 2 rounds, 3 groups kept, rank 0's B D F (ids 0, 1, 2), rank 1
    none (an idle row). Then one SGD rl_step; `only`: one process updating on those rows alone."""
    from test_dynamic_sampling import step
    tok = toy_tokenizer()
    names, sampled, kept, counts, _ = step(["BDAC", "FAEH"], rounds=2, tasks_per_step=4)   # ranks: the process group's
    cfg = {**config.DEFAULTS, "tasks_per_step": 4, "group_size": 2, "max_sample_rounds": 2, "kl_coef": 0.0,
           "reuse_sampler_logprobs": False}
    rows, rewards, groups = train.update_rows(sampled, kept, counts["groups_kept"], cfg, tok.pad_token_id)
    if only is not None:
        rows, rewards, groups = only
    model = tiny_llama(tok, seed=0)
    ddp_model = DDP(model) if world_size > 1 else model
    opt = recording(torch.optim.SGD)(model.parameters(), lr=0.1)
    sums, status = train.rl_step(model, ddp_model, opt, rows, rewards, groups, cfg, tok.pad_token_id)
    return {"names": names, "kept": kept, "counts": counts, "rows": (rows, rewards, groups), "status": status,
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
    assert (r0["kept"], r1["kept"]) == ([0, 1, 2], [])
    assert [len(r0["rows"][0]), len(r1["rows"][0])] == [6, 1] and r1["rows"][2] == [-1]
    assert r0["status"] == r1["status"] == "updated"
    alone = dynamic_sampling_update(0, 1, only=r0["rows"])
    assert_same_gradients(alone["grads"], r0["grads"])
    assert_same_gradients(r0["grads"], r1["grads"])
