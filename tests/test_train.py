"""The update: micro-batch accumulation equals one big batch, role coefficients, skipped steps,
and a few-step end-to-end run of train.py that changes the weights and writes finite metrics."""
from formats import format_plain
import envace
import contextlib

from machinery import distributed
from machinery import config
from machinery import checkpoint
import json
import math
import os

import pytest
import torch

from scripts import evaluate_cli
import train
from envace import ACT, REHEARSE, encode_episode
from machinery import sharedprefix
from machinery.sharedprefix import token_logprobs
from helpers import (LOGPROB_TOLERANCE, POSITION_INIT, assert_ratio_one, assert_same_gradients, recording, step_grads,
                     tiny_cfg, tiny_llama, toy_tokenizer, import_graph)
from rollout import sample_episodes

TOK = toy_tokenizer()
FP32 = contextlib.nullcontext()          # rl_step's autocast context on the CPU in fp32
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS = ["price apple", "not pear buy 2 milk and egg", "cost 3 fish", "buy tea"]


def rehearsed_batch(cfg, group_size=3, rewards=None):
    """Rehearse-mode episodes of expert tasks (both roles present), in groups of mixed reward."""
    import random
    import world
    rng = random.Random(0)
    tasks = [world.random_task(rng, "new") for _ in range(4)]
    eps = [encode_episode(TOK, t["prompt"], t["calls"][:k], world.replay(t["calls"][:k]),
                          t["answer"], env_role=REHEARSE)
           for t in tasks for k in range(1, group_size + 1)]
    rewards = rewards or [float(i % 3 == 0) for i in range(len(eps))]
    return train.make_batch(eps, rewards, {**cfg, "group_size": group_size}, TOK.pad_token_id)


def grads_with_micro_batch(model, batch, old, reference, cfg, mb):
    """The gradient train.rl_step applies (a recording SGD of lr 0: the weights stay) with `old` as
    the sampler's logprobs and `reference` the KL reference model, in micro-batches of `mb` tokens."""
    opt = recording(torch.optim.SGD)(model.parameters(), lr=0.0)
    stats = train.rl_step(model, model, opt, {**batch, "sampled_logprobs": old}, {**cfg, "micro_batch_tokens": mb},
                          FP32, reference=reference)
    return step_grads(model, opt), stats


def one_batch_grads(model, batch, old, ref, cfg):
    """The simple path: one forward over the whole right-padded batch, one backward."""
    model.zero_grad(set_to_none=True)
    new = token_logprobs(model, batch["ids"], cfg["temperature"])
    loss, stats = envace.clipped_pg_loss(new, old, batch["advantages"], batch["mask"], batch["n_tokens"], ref,
                                        cfg["eps_low"], cfg["eps_high"], cfg["dual_clip"], batch["kl_coefs"])
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, {"loss": loss.item(), **stats}


def test_length_grouped_micro_batches_give_the_one_batch_gradient():
    model, reference = tiny_llama(TOK), tiny_llama(TOK, seed=1)
    cfg = {**config.DEFAULTS, "kl_coef": 0.1, "kl_rehearse_coef": 0.05}
    batch = rehearsed_batch(cfg)
    with torch.no_grad():
        cur = token_logprobs(model, batch["ids"])
        ref = token_logprobs(reference, batch["ids"])          # another init: KL > 0
    gen = torch.Generator().manual_seed(0)
    old = cur + 0.3 * torch.randn(cur.shape, generator=gen)    # ratios away from 1: clips are hit
    g_all, s_all = one_batch_grads(model, batch, old, ref, cfg)
    budget = 60                                                # 1-3 rows per micro-batch
    assert len(envace.micro_batches(batch["lengths"], budget)) >= 5
    g_mb, s_mb = grads_with_micro_batch(model, batch, old, reference, cfg, mb=budget)
    assert s_all["clip_frac"] > 0 and s_all["kl_ref"] > 0
    assert_same_gradients(g_all, g_mb)                         # (helpers.GRAD_TOLERANCE: why 1e-4)
    # each stat sums n ~ 300 float32 per-token terms whose |values| add up to at most ~3 (|A| <= 1,
    # ratios clipped at 3, k3 and log-ratios ~0.3): summed in another order they differ by at most
    # n x 6e-8 x 3 = 5e-5; a micro-batch left out or counted twice moves them by whole terms (1/n)
    for k in ("loss", "clip_frac", "approx_kl", "kl_ref"):
        assert s_all[k] == pytest.approx(s_mb[k], rel=1e-5, abs=5e-5)


def test_rows_with_no_signal_change_nothing():
    """Groups 1 and 3 have equal rewards: their rows carry advantage 0 everywhere. Without KL the
    update leaves them out of the forward (rl_step's speed line) and still matches the one-batch
    gradient with every row in; with KL they are kept."""
    model, reference = tiny_llama(TOK), tiny_llama(TOK, seed=1)
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    for kl_coef, kept in ((0.0, 6), (0.1, 12)):
        cfg = {**config.DEFAULTS, "kl_coef": kl_coef}
        batch = rehearsed_batch(cfg, rewards=rewards)
        with torch.no_grad():
            old = token_logprobs(model, batch["ids"]) + 0.1
            ref = token_logprobs(reference, batch["ids"]) if kl_coef else None
        g_all, s_all = one_batch_grads(model, batch, old, ref, cfg)
        g_mb, s_mb = grads_with_micro_batch(model, batch, old, reference if kl_coef else None, cfg, mb=60)
        assert s_mb["rows_updated"] == kept
        assert_same_gradients(g_all, g_mb)
        assert s_all["loss"] == pytest.approx(s_mb["loss"], rel=1e-5, abs=5e-5)     # as above


def test_micro_batches_pack_by_length_within_the_budget():
    assert envace.micro_batches([50, 12, 48, 10], 100) == [[0, 2], [1, 3]]
    assert envace.padded_fraction([50, 12, 48, 10], [[0, 2], [1, 3]]) == pytest.approx(1 - 120 / 124)
    assert envace.padded_fraction([50, 12, 48, 10], [[0, 1, 2, 3]]) == pytest.approx(1 - 120 / 200)
    assert envace.micro_batches([70, 5], 60) == [[0], [1]]          # a row over budget goes alone
    assert envace.micro_batches([3] * 5, 9) == [[0, 1, 2], [3, 4]]
    assert envace.padded_fraction([50, 12, 48, 10], [[1, 3]]) == pytest.approx(1 - 22 / 24)   # rows left out


def test_micro_batches_never_mix_groups():
    """Rows of one group (the tool a separate rehearse row plays) share micro-batches, longest
    first within their group; no groups (or one) packs exactly as by length alone."""
    assert envace.micro_batches([50, 12, 48, 10], 100, ["a", "b", "b", "a"]) == [[0, 3], [2, 1]]
    assert envace.micro_batches([50, 12, 48, 10], 100, ["", "", "", ""]) == [[0, 2], [1, 3]]
    # act rows ("") sort before tool rows; a group's rows still split on the budget: 3 x 30 > 80
    assert envace.micro_batches([30, 30, 30, 40, 5], 80, ["pay", "pay", "pay", "", "ask"]) == [[3], [4], [0, 1], [2]]


def test_sampler_logprobs_equal_the_recomputed_old_logprobs():
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    prompts = ["price apple", "not pear buy 2 milk and egg", "cost 3 fish", "buy tea"] * 3
    eps = sample_episodes(model, TOK, prompts, "rehearse", settings={"max_tokens": 40},
                          generator=torch.Generator().manual_seed(3))
    batch = train.make_batch(eps, [float(i % 2) for i in range(12)], {**config.DEFAULTS, "group_size": 3},
                             TOK.pad_token_id)
    d = config.DEFAULTS
    recomputed = sharedprefix.batch_logprobs(model, batch["ids"], batch["lengths"], None, d["temperature"],
                                             d["micro_batch_tokens"], share_prefix=d["share_prefix"])
    sampled = batch["sampled_logprobs"]
    trained = batch["mask"]
    assert trained.sum() > 30
    assert (sampled[trained] - recomputed[trained]).abs().max() < LOGPROB_TOLERANCE



def test_sampler_logprobs_are_reused_only_outside_bf16_autocast(tmp_path):
    """Setup's decision: under bf16 autocast (CUDA with bf16: true, or the CPU with cpu_bf16) a
    cached one-token decode and a full forward round differently, so the old logprobs are
    recomputed (reuse_sampler_logprobs set false in the run's config); in fp32 the sampler's are
    reused. Read back from the config.yaml setup writes."""
    import yaml
    for cpu_bf16, reused in ((False, True), (True, False)):
        cfg = tiny_cfg(tmp_path / str(cpu_bf16), cpu_bf16=cpu_bf16, device="cpu")
        train.setup(cfg, False, False, "cpu", 1, lambda *a: None)
        saved = yaml.safe_load(open(os.path.join(cfg["out_dir"], "config.yaml")))
        assert saved["reuse_sampler_logprobs"] is reused


@pytest.mark.parametrize("reused", [True, False])
def test_rl_step_takes_the_old_logprobs_the_config_names(reused):
    """rl_step with the sampler's logprobs made stale by +0.5 nat (as a bf16 decode would round
    them). Reused, the first epoch's approx_kl = mean(old - new) over trained tokens is exactly that
    0.5; recomputed (reuse_sampler_logprobs false), old = new and approx_kl is 0 (the same forward
    twice: within 1e-5)."""
    model = tiny_llama(TOK)
    eps = sample_episodes(model, TOK, PROMPTS * 2, "rehearse", settings={"max_tokens": 40},
                          generator=torch.Generator().manual_seed(3))
    for e in eps:
        e["logprobs"] = [lp + 0.5 if lp != 0.0 else 0.0 for lp in e["logprobs"]]
    cfg = {**config.DEFAULTS, "reuse_sampler_logprobs": reused, "group_size": 2}
    batch = train.make_batch(eps, [float(i % 2) for i in range(8)], cfg, TOK.pad_token_id)
    stats = train.rl_step(model, model, torch.optim.SGD(model.parameters(), lr=0.0), batch, cfg, FP32)
    assert stats["status"] == "updated"
    assert stats["approx_kl"] == pytest.approx(0.5 if reused else 0.0, abs=1e-5)


def test_role_coefficients_shape_mask_and_advantages():
    both = rehearsed_batch(config.DEFAULTS)
    act_only = rehearsed_batch({**config.DEFAULTS, "rehearse_coef": 0.0})
    target_roles = both["roles"][:, 1:]
    assert both["mask"].eq(torch.isin(target_roles, torch.tensor([ACT, REHEARSE]))).all()
    assert act_only["mask"].eq(target_roles == ACT).all()
    assert act_only["n_tokens"] == int((target_roles == ACT).sum()) < both["n_tokens"]
    assert act_only["advantages"][target_roles == REHEARSE].abs().sum() == 0


def test_all_equal_groups_skip_the_step():
    model = tiny_llama(TOK)
    before = [p.clone() for p in model.parameters()]
    eps = sample_episodes(model, TOK, PROMPTS * 2, "rehearse", settings={"max_tokens": 40})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cfg = {**config.DEFAULTS, "group_size": 2}
    batch = train.make_batch(eps, [1.0] * 8, cfg, TOK.pad_token_id)
    stats = train.rl_step(model, model, opt, batch, cfg, FP32)
    assert stats["status"] == "skipped" and batch["all_equal_groups"] == 4
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("env_mode", ["rehearse", "real", "frozen"])
def test_end_to_end_few_steps(tmp_path, monkeypatch, env_mode):
    # a 5-step warm start answers nothing right; reward by episode length parity instead, so
    # that every group has variance and every step updates (the plumbing is what is tested)
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    cfg = tiny_cfg(tmp_path, env_mode=env_mode, kl_coef=0.1 if env_mode == "rehearse" else 0.0)
    assert train.run(cfg) == 0
    out = cfg["out_dir"]
    lines = [json.loads(text) for text in open(os.path.join(out, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert open(os.path.join(out, "curve.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"    # the run's curve
    # one epoch at ratio 1 (the sampler's logprobs are the old ones): approx_kl 0, and the loss is
    # minus the mean advantage over the trained tokens plus kl_coef x the ACT tokens' KL
    assert len(assert_ratio_one(lines, kl_coef=cfg["kl_coef"])) == 3
    for line in lines:
        for k in ("grad_norm", "tok_per_s"):
            assert math.isfinite(line[k]), k
        assert (line["reward"] * 16).is_integer()                 # 16 episodes, each rewarded 0 or 1
        assert 0 < line["entropy_act"] <= math.log(len(TOK))      # at most the uniform one's
        # no reference without KL; with one, step 1's policy is the warm start itself: KL 0
        assert (line["kl_ref"] < 1e-9) == (env_mode != "rehearse" or line["step"] == 1)
        assert ("fidelity" in line) == (env_mode != "real")     # rehearsal fidelity: a diagnostic
        # only rehearse mode has REHEARSE tokens; only real/frozen have OBS tokens
        assert line["tokens_obs" if env_mode == "rehearse" else "tokens_rehearse"] == 0
    final = checkpoint.load_policy(os.path.join(out, "ckpt"))[0]
    warm = checkpoint.load_policy(os.path.join(out, "warmstart"))[0]
    diff = max((a - b).abs().max().item() for a, b in zip(final.parameters(), warm.parameters()))
    # 3 AdamW steps: an element moves by lr at the first (|m/sqrt(v)| = 1), by at most ~1.004 lr
    # at the next two, plus weight decay (lr x 0.01 x |w|, |w| about 1 for the norms)
    assert cfg["lr"] / 2 < diff <= 3 * cfg["lr"] * 1.03
    result = json.load(open(os.path.join(out, "eval.json")))
    answered = result["causes"].get("answer", 0)
    assert result["n_tasks"] == sum(result["causes"].values()) == 16 and "before" in result
    assert (result["success"] * 16).is_integer()                # scored by the parity reward
    assert result["format_errors"] == pytest.approx(1 - (answered + result["causes"].get("act_limit", 0)) / 16)
    monkeypatch.undo()                                          # the task reward again
    # evaluate.py on the run folder (its latest checkpoint) and on the warm start inside it:
    # only an answer can succeed
    for folder in (out, os.path.join(out, "warmstart")):
        os.remove(os.path.join(folder, "eval.json"))
        assert evaluate_cli.main(["--ckpt", folder, "--n_test=8"]) == 0
        again = json.load(open(os.path.join(folder, "eval.json")))
        answered = again["causes"].get("answer", 0)
        assert again["n_tasks"] == sum(again["causes"].values()) == 8
        assert (again["success"] * 8).is_integer() and again["success"] * 8 <= answered


def test_evaluate_without_a_checkpoint_is_one_line(tmp_path, capsys):
    assert evaluate_cli.main(["--ckpt", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no checkpoint" in err[0]


def test_python_evaluate_py_runs_its_command_line_from_any_folder(tmp_path):
    """`python evaluate.py` as a user types it (a process, started in another folder): its `__main__`
    runs scripts/evaluate_cli.py as a module, which imports evaluate.py; no module imports the other back."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, os.path.join(REPO, "evaluate.py"), "--ckpt", str(tmp_path)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2, "", f"error: no checkpoint written by train.py in {tmp_path}\n")
    graph = import_graph(REPO)
    assert "evaluate" in graph["scripts.evaluate_cli"] and "scripts.evaluate_cli" not in graph["evaluate"]
    while graph:                  # peel off the modules that import nothing left: a cycle never peels
        leaves = {m for m, deps in graph.items() if not deps}
        assert leaves, f"import cycle among {sorted(graph)}"
        graph = {m: deps - leaves for m, deps in graph.items() if m not in leaves}


def test_fidelity_gate_stops_rl(tmp_path, capsys):
    cfg = tiny_cfg(tmp_path, min_fidelity=0.95, rl_steps=1)
    assert train.run(cfg) == 2
    assert "fidelity gate FAILED" in capsys.readouterr().out
    assert not os.path.exists(os.path.join(cfg["out_dir"], "metrics.jsonl"))


def test_logprobs_from_the_first_needed_target_skip_the_prompt_logits(monkeypatch):
    """token_logprobs(start=s): the LM head runs on positions s.. only (a long prompt's logits are
    never made: the chunked head, sharedprefix.head_logprobs, is given those positions' hidden states), the
    values from s on equal the full forward's, and 0 before s; the warm start's and the update's
    gradients through it equal those of the full forward (the prompt has no loss)."""
    model = tiny_llama(TOK)
    eps = [encode_episode(TOK, "not pear buy 2 milk and egg " * 3, ["price milk"], ["2"], "2"),
           encode_episode(TOK, "not pear buy 2 milk and egg " * 2, ["price egg"], ["1"], "1")]
    ids, roles = envace.collate(eps, TOK.pad_token_id)
    mask = envace.loss_mask(roles)
    start = envace.first_target(mask)
    assert start == roles[1].tolist().index(envace.TAG) == 15     # the shorter prompt's <act>: predicts its first ACT
    heads, head_logprobs = [], sharedprefix.head_logprobs
    monkeypatch.setattr(sharedprefix, "head_logprobs",
                        lambda hidden, *a: heads.append(hidden.shape[1]) or head_logprobs(hidden, *a))
    part = token_logprobs(model, ids, start=start)
    full = token_logprobs(model, ids)
    assert heads == [ids.shape[1] - 1 - start, ids.shape[1] - 1]      # the last position predicts nothing
    assert (part[:, :start] == 0).all() and torch.allclose(part[:, start:], full[:, start:], atol=LOGPROB_TOLERANCE)
    grads = []
    for s in (start, 0):
        model.zero_grad(set_to_none=True)
        (token_logprobs(model, ids, start=s) * mask).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert_same_gradients(*grads)
    assert envace.first_target(torch.zeros(2, 5, dtype=torch.bool)) == 0


def test_evaluation_samples_eval_batch_size_tasks_at_once(monkeypatch):
    """eval_batch_size bounds the tasks sampled at once (their KV cache is the evaluation's memory):
    5 toy test tasks at 2 are sampled as 2, 2, 1 prompts, the same prompts in the same order as
    one batch of 5, and every task gets its episode and reward. Mutations: the last part dropped,
    parts overlapping."""
    import random
    import evaluate
    import world
    from formats import features
    tok = toy_tokenizer()
    rng = random.Random(0)
    tasks = [world.random_task(rng, "new") for _ in range(5)]
    model = tiny_llama(tok, seed=0)
    cfg = {**config.DEFAULTS, "n_collusion": 0}
    fmt, setting = features.setup(cfg, tok, {"logged": [], "rl": tasks, "test": tasks})
    real, calls = evaluate.sample_episodes, []

    def recording(model, tokenizer, prompts, *a, **k):
        calls.append(prompts)
        return real(model, tokenizer, prompts, *a, **k)
    monkeypatch.setattr(evaluate, "sample_episodes", recording)
    evaluate.evaluate(model, tok, tasks, cfg, fmt, setting)
    parts = evaluate.evaluate(model, tok, tasks, {**cfg, "eval_batch_size": 2}, fmt, setting)
    assert [len(p) for p in calls] == [5, 2, 2, 1]
    assert calls[1] + calls[2] + calls[3] == calls[0]
    assert len(parts["task_rewards"]) == parts["n_tasks"] == 5 and sum(parts["causes"].values()) == 5


def test_adamw_is_fused_with_the_configs_lr_and_weight_decay():
    """AdamW's steps with bias correction and a constant gradient: m_hat = g, v_hat = g^2, so
    p <- p (1 - lr wd) - lr g / (|g| + eps). p = 1, g = 0.5, lr 0.1, weight_decay 0.01:
    0.999 - 0.1 = 0.899, then 0.899 x 0.999 - 0.1 = 0.798101; p = -2, g = 0.25: -2.098, -2.195902."""
    model = torch.nn.Module()
    model.p = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    opt = distributed.adamw(model, 0.1, {"weight_decay": 0.01})
    assert opt.defaults["fused"] is True         # no parameter-sized temporaries in the step
    for want in ([0.899, -2.098], [0.798101, -2.195902]):
        model.p.grad = torch.tensor([0.5, 0.25])
        opt.step()
        assert model.p.detach().tolist() == pytest.approx(want, abs=1e-6)


def test_a_warm_start_only_run_evaluates_once(tmp_path, monkeypatch):
    """rl_steps 0: the policy after RL is the warm start, so eval.json is the warm start's evaluation
    (with `before` and rl_updates as a run with RL writes them), not a second evaluation of the
    same weights; a run with one RL step evaluates twice (before and after)."""
    from reporting import metrics
    evaluated = []

    def counted(*args, **kwargs):
        evaluated.append(len(args[2]))
        return evaluate(*args, **kwargs)
    evaluate = metrics.evaluate
    monkeypatch.setattr(metrics, "evaluate", counted)
    cfg = tiny_cfg(tmp_path, rl_steps=0, n_test=4, sft_steps=1)
    assert train.run(cfg) == 0 and evaluated == [4]
    with open(os.path.join(cfg["out_dir"], "warmstart", "eval.json")) as f:
        warm = json.load(f)
    with open(os.path.join(cfg["out_dir"], "eval.json")) as f:
        final = json.load(f)
    assert final == {**warm, "before": warm, "rl_updates": {"steps": 0, "updated": 0, "skipped": 0, "nonfinite": 0,
                                                             "updated_share": None}}
    evaluated.clear()
    assert train.run(tiny_cfg(tmp_path / "rl", rl_steps=1, n_test=4, sft_steps=1)) == 0 and evaluated == [4, 4]


def test_evaluations_hold_no_gradients_and_the_final_one_no_optimizer_moments(tmp_path, monkeypatch):
    """What sits beside the model while it is evaluated: at every evaluation of a run (the warm
    start's, one during RL at eval_every 1, the final one) no parameter holds a gradient (4 bytes a
    parameter), and at the final one no optimizer holds AdamW moments (8 bytes a parameter: freed
    once the last checkpoint is saved), where during RL every parameter still has them (RL goes on).
    Episode-length parity as the reward, so that both RL steps update (their moments exist)."""
    import gc
    import warnings
    from reporting import metrics
    seen = []

    def spy(model, *args, **kwargs):
        with warnings.catch_warnings():         # isinstance on every live object touches deprecated ones
            warnings.simplefilter("ignore")
            moments = sum(len(o.state) for o in gc.get_objects() if isinstance(o, torch.optim.Optimizer))
        seen.append((sum(p.grad is not None for p in model.parameters()), moments))
        return evaluate(model, *args, **kwargs)
    evaluate = metrics.evaluate
    monkeypatch.setattr(metrics, "evaluate", spy)
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    cfg = tiny_cfg(tmp_path, rl_steps=2, eval_every=1, n_test=4, sft_steps=1)
    assert train.run(cfg) == 0
    n = len(list(checkpoint.load_policy(os.path.join(cfg["out_dir"], "ckpt"))[0].parameters()))
    assert seen == [(0, 0), (0, n), (0, 0)]


def test_freed_memory_is_released_after_each_backward(monkeypatch):
    """distributed.release_freed_memory calls glibc's malloc_trim(0) (nothing where there is no
    glibc); distributed.in_step, which hands rl_step and the warm start their micro-batches, calls
    it after every micro-batch's forward and backward: a recorded order of the events. 4 episodes
    of 6-18 tokens in micro-batches of at most 60 (rows x padded length): 2 micro-batches, so 2
    backward passes in the update."""
    trims = []
    monkeypatch.setattr(distributed, "LIBC", type("Libc", (), {"malloc_trim": lambda self, pad: trims.append(pad)})())
    distributed.release_freed_memory()
    monkeypatch.setattr(distributed, "LIBC", None)
    distributed.release_freed_memory()
    assert trims == [0]
    events = []
    backward = torch.Tensor.backward
    monkeypatch.setattr(torch.Tensor, "backward", lambda self, *a, **k: events.append("backward") or backward(self, *a, **k))
    monkeypatch.setattr(distributed, "release_freed_memory", lambda: events.append("release"))
    model = tiny_llama(TOK)
    eps = sample_episodes(model, TOK, PROMPTS, "rehearse", settings={"max_tokens": 40},
                          generator=torch.Generator().manual_seed(3))
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 60, "group_size": 2}
    n = len(envace.micro_batches([len(e["ids"]) for e in eps], 60))
    batch = train.make_batch(eps, [1.0, 0.0, 1.0, 0.0], cfg, TOK.pad_token_id)
    stats = train.rl_step(model, model, torch.optim.SGD(model.parameters(), lr=0.1), batch, cfg, FP32)
    assert stats["status"] == "updated" and n >= 2
    assert events == ["backward", "release"] * n
    events.clear()
    train.warm_start(model, model, eps, {**cfg, "sft_steps": 2, "sft_batch_size": 4}, TOK.pad_token_id)
    assert events and events == ["backward", "release"] * (len(events) // 2)


@pytest.mark.parametrize("replay", [True, False])
def test_replay_fidelity_is_a_switch_and_nothing_trained_reads_it(tmp_path, monkeypatch, replay):
    # "no environment in RL" means no real response enters an episode or the loss; the replay of a
    # rehearsed step's calls in the real world only feeds metrics.jsonl's fidelity and collusion.
    # Off, it is never asked; on or off, the step trains exactly the same (same loss, same weights)
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    replays = []                      # the step's replay (evaluations replay their own episodes apart)
    real_replay = format_plain.diagnostics
    monkeypatch.setattr(format_plain, "diagnostics", lambda *a: replays.append(1) or real_replay(*a))
    cfg = tiny_cfg(tmp_path, rl_steps=2, replay_fidelity=replay)
    assert train.run(cfg) == 0
    lines = [json.loads(text) for text in open(os.path.join(cfg["out_dir"], "metrics.jsonl"))]
    assert len(replays) == (2 if replay else 0)                  # once a step, or never
    assert all(("fidelity" in line) == replay and ("collusion" in line) == replay for line in lines)
    trained = [(line["loss"], line["grad_norm"], line["status"]) for line in lines]
    weights = checkpoint.load_policy(os.path.join(cfg["out_dir"], "ckpt"))[0].state_dict()
    other = tiny_cfg(tmp_path / "other", rl_steps=2, replay_fidelity=not replay)
    assert train.run(other) == 0
    other_lines = [json.loads(text) for text in open(os.path.join(other["out_dir"], "metrics.jsonl"))]
    assert trained == [(line["loss"], line["grad_norm"], line["status"]) for line in other_lines]
    other_weights = checkpoint.load_policy(os.path.join(other["out_dir"], "ckpt"))[0].state_dict()
    assert all(torch.equal(weights[k], other_weights[k]) for k in weights)


def test_the_evaluation_line_during_rl_says_what_the_clip_did():
    from reporting.metrics import evaluation_line
    record = {"reward": 0.8125, "clip_frac": 0.0}
    line = evaluation_line({"success": 0.93, "n_tasks": 500}, record, {"env_mode": "rehearse"}, 50)
    assert line == "step 50: real-world success 0.930 (reward in the rehearse world this step 0.812, clip_frac 0.000)"
    assert record["eval_success"] == 0.93
    skipped = evaluation_line({"success": 0.5, "n_tasks": 500}, {"reward": 0.5}, {"env_mode": "real"}, 100)  # no clip
    assert skipped == "step 100: real-world success 0.500 (reward in the real world this step 0.500)"


def test_the_validation_split_is_held_out_of_rl_and_evaluated_during_it(tmp_path, monkeypatch, capsys):
    # n_val 4 of 40 RL tasks: RL samples from the first 36 only; the evaluations every eval_every
    # steps run on the last 4 (val_success), the test split before and after RL alone
    from formats import features
    splits = features.held_out_validation({"rl": list("abcdefgh"), "test": ["t"]}, 3)
    assert (splits["rl"], splits["val"], splits["test"]) == (list("abcde"), list("fgh"), ["t"])
    assert features.held_out_validation({"rl": list("ab"), "test": []}, 0)["val"] == []
    chat = features.build_tasks(config.load_config(os.path.join(REPO, "configs", "chat_tiny.yaml"), ["--n_val=1"]))
    whole = features.build_tasks(config.load_config(os.path.join(REPO, "configs", "chat_tiny.yaml")))
    assert (chat["rl"], chat["val"], whole["val"]) == (whole["rl"][:-1], whole["rl"][-1:], [])   # chat task files too
    with pytest.raises(config.ConfigError, match=r"n_val \(2\) takes every one of the 2 RL tasks"):
        features.held_out_validation({"rl": list("ab"), "test": []}, 2)
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    sampled, evaluated = [], []
    import rollout
    real_sample, real_eval = rollout.sample_episodes, train.metrics.real_world_eval
    # RL's sampler (rollout.sample_episodes, bound at setup) gets each task group_size (4) times
    monkeypatch.setattr(rollout, "sample_episodes", lambda *a, **k: sampled.extend(k["prompts"][::4]) or
                        real_sample(*a, **k))
    monkeypatch.setattr(train.metrics, "real_world_eval", lambda model, tok, tasks, *a, **k: evaluated.append(len(tasks)) or
                        real_eval(model, tok, tasks, *a, **k))
    cfg = tiny_cfg(tmp_path, rl_steps=2, eval_every=1, n_val=4)
    assert train.run(cfg) == 0
    every = features.build_tasks(cfg)
    assert len(every["rl"]) == 36 and len(every["val"]) == 4
    assert len(sampled) == 2 * 4 and all(t in every["rl"] for t in sampled)     # 2 steps x 4 tasks, of the 36 alone
    # the warm start on the test split, then on the validation split (the curve's step 0), steps 1 and 2
    # on validation (the last step's too: the curve ends where RL does), the final one (test)
    assert evaluated == [16, 4, 4, 4, 16]
    result = json.load(open(os.path.join(cfg["out_dir"], "eval.json")))
    assert (result["before"]["val_success"] * 4).is_integer() and result["n_tasks"] == 16
    lines = [json.loads(text) for text in open(os.path.join(cfg["out_dir"], "metrics.jsonl"))]
    assert ["val_success" in line for line in lines] == [True, True]
    assert len(lines[0]["val_task_rewards"]) == 4 and sum(lines[0]["val_task_rewards"]) / 4 == lines[0]["val_success"]
    step0 = json.load(open(os.path.join(cfg["out_dir"], "warmstart", "eval_val.json")))    # the curve's step 0, per task
    assert step0["n_tasks"] == 4 and step0["success"] == result["before"]["val_success"] == sum(step0["task_rewards"]) / 4
    assert not any("eval_success" in line for line in lines)
    out = capsys.readouterr().out
    assert "40 RL" not in out and "36 RL, 16 test, 4 validation" in out
    assert "step 1: validation (4 tasks): real-world success" in out
    assert "warm start on the validation split (4 tasks): success" in out
    # evaluate.py --validation: the same evaluation of a checkpoint, into <checkpoint>/eval_val.json with
    # its step. The warm start's again (its file moved away) gives train.py's step 0 task by task, and
    # the final checkpoint's its step 2 (same weights, greedy, same seed and batches); an existing file
    # is kept
    warm = os.path.join(cfg["out_dir"], "warmstart")
    os.rename(os.path.join(warm, "eval_val.json"), os.path.join(tmp_path, "train_step0.json"))
    assert evaluate_cli.main(["--ckpt", warm, "--validation"]) == 0
    again = json.load(open(os.path.join(warm, "eval_val.json")))
    assert again["task_rewards"] == step0["task_rewards"] and again["step"] == 0
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"], "--validation"]) == 0
    last = json.load(open(os.path.join(cfg["out_dir"], "ckpt", "eval_val.json")))
    assert last["step"] == 2 and last["task_rewards"] == lines[1]["val_task_rewards"]
    capsys.readouterr()
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"], "--validation"]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "eval_val.json exists already" in err
    assert json.load(open(os.path.join(cfg["out_dir"], "ckpt", "eval_val.json"))) == last
    os.remove(os.path.join(warm, "eval_val.json"))
    assert evaluate_cli.main(["--ckpt", warm, "--validation", "--n_val=0"]) == 2
    assert "n_val is 0, so the run has no validation split" in capsys.readouterr().err
