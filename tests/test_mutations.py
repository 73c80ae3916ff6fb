"""Gaps a mutation test found: each test here passes on the code and fails on a one-line mutation
of it (the mutation named in each docstring). Expectations are computed by hand, never read back
from the code under test."""
from machinery import config
import contextlib
import math
import os
import random
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaForCausalLM

from machinery import checkpoint
import envace
from formats import format_plain
from reporting import metrics
from worldmodel import honesty
import train
import world
from envace import ACT, PROMPT, REHEARSE, encode_episode
from machinery.checkpoint import find_checkpoint, save_checkpoint
from evaluate import evaluate
from helpers import GRAD_TOLERANCE, ScriptedModel, assert_same_gradients, run_ranks, tiny_llama, toy_tokenizer
from chat.chat_reward import calls_match, value_match
from rollout import sample_episodes, sample_token

TOK = toy_tokenizer()
V = len(TOK)


def words(ids):
    return " ".join(TOK.convert_ids_to_tokens(ids))


# ----------------------------------------------------------------------------- 1. checkpoints

def same_weights(path, model):
    loaded = LlamaForCausalLM.from_pretrained(path).state_dict()
    return all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def same_weights_dict(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def test_a_save_that_fails_midway_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    """Mutations: the old checkpoint deleted before the new one is in place (no <path>.old kept),
    writing into <path> instead of <path>.tmp, find_checkpoint not looking at <path>.old, or
    preferring <path>.old over <path>."""
    older, newer = tiny_llama(TOK, seed=0), tiny_llama(TOK, seed=1)
    assert not same_weights_dict(older, newer)
    path = str(tmp_path / "ckpt")
    save_checkpoint(older, TOK, path, {"note.txt": "older"})
    assert find_checkpoint(path) == path and same_weights(path, older)

    # a crash while the new checkpoint is written (<path>.tmp): <path> is untouched
    def broken_save(*a, **k):
        raise OSError("disk full")
    with monkeypatch.context() as m:
        m.setattr(type(TOK), "save_pretrained", broken_save)
        with pytest.raises(OSError, match="disk full"):
            save_checkpoint(newer, TOK, path, {"note.txt": "newer"})
    assert find_checkpoint(path) == path and same_weights(path, older)
    assert open(os.path.join(path, "note.txt")).read() == "older"

    # a crash between the two renames (<path> -> <path>.old done, <path>.tmp -> <path> fails):
    # the complete older checkpoint is found at <path>.old
    real_replace = os.replace

    def crash_on_second_rename(src, dst):
        if str(src) == path + ".tmp":
            raise OSError("power cut")
        return real_replace(src, dst)
    with monkeypatch.context() as m:
        m.setattr(checkpoint.os, "replace", crash_on_second_rename)
        with pytest.raises(OSError, match="power cut"):
            save_checkpoint(newer, TOK, path, {"note.txt": "newer"})
    assert not os.path.exists(path)
    assert find_checkpoint(path) == path + ".old" and same_weights(path + ".old", older)
    assert open(os.path.join(path + ".old", "note.txt")).read() == "older"

    # a save after that crash goes through: the newer weights at <path>, no .old or .tmp left
    save_checkpoint(newer, TOK, path, {"note.txt": "newer"})
    assert find_checkpoint(path) == path and same_weights(path, newer)
    assert not os.path.exists(path + ".old") and not os.path.exists(path + ".tmp")


def test_find_checkpoint_prefers_path_when_old_is_left_too(tmp_path, monkeypatch):
    """A crash after both renames, before <path>.old is removed: both are complete, <path> holds
    the newer weights and must win. Mutation: find_checkpoint trying <path>.old first."""
    older, newer = tiny_llama(TOK, seed=0), tiny_llama(TOK, seed=1)
    path = str(tmp_path / "ckpt")
    save_checkpoint(older, TOK, path)
    real_rmtree = checkpoint.shutil.rmtree

    def crash_at_cleanup(p, *a, **k):
        if str(p) == path + ".old" and not os.path.exists(path + ".tmp"):    # both renames done
            raise OSError("killed")
        return real_rmtree(p, *a, **k)
    with monkeypatch.context() as m:
        m.setattr(checkpoint.shutil, "rmtree", crash_at_cleanup)
        with pytest.raises(OSError, match="killed"):
            save_checkpoint(newer, TOK, path)
    assert os.path.isdir(path) and os.path.isdir(path + ".old")
    assert same_weights(path + ".old", older)
    assert find_checkpoint(path) == path and same_weights(path, newer)


# ----------------------------------------------------------------------------- 2 and 6. logged entropy and KL

class FixedLogits(torch.nn.Module):
    """A causal LM whose logits are the same vector `row` at every position, whatever it reads."""

    def __init__(self, row):
        super().__init__()
        self.row = torch.nn.Parameter(torch.tensor(row, dtype=torch.float32))

    def forward(self, input_ids, **kw):
        return SimpleNamespace(logits=self.row.expand(*input_ids.shape, -1))


def hand_batch(cfg):
    """Two rehearse-mode episodes of one group with rewards 1 and 0 (both rows get a gradient)."""
    eps = [encode_episode(TOK, "price apple", ["price apple"], ["3"], "3", env_role=REHEARSE),
           encode_episode(TOK, "buy tea", ["price tea", "pay 4"], ["4", "5"], "5", env_role=REHEARSE)]
    # targets are roles[1:]: ACT = each call's words + </act> and 'answer N </act>', REHEARSE = 'N </env>'
    n_act, n_rehearse = (3 + 3) + (3 + 3 + 3), 2 + 2 + 2
    assert [sum(r == ACT for r in e["roles"][1:]) for e in eps] == [6, 9]
    return train.make_batch(eps, [1.0, 0.0], {**cfg, "group_size": 2}, TOK.pad_token_id), n_act, n_rehearse


def record_of(totals):
    """metrics.metrics_record over one rank's sums (the episode-level figures are placeholders)."""
    s = {"n_episodes": 2, "reward_sum": 1.0, "calls_sum": 3, "causes": {}, "all_equal_groups": 0,
         "n_tok": 10, **{f"{k}_{r}": 0 for k in ("tokens", "adv_sum") for r in ("act", "rehearse", "obs")},
         **totals}
    return metrics.metrics_record(1, {**s, "status": "updated"}, {"skipped": 0, "nonfinite": 0}, 1.0)


def update_stats(model, batch, cfg, reference=None):
    """train.rl_step's stats on `batch` (the sampler's logprobs as the old ones; an SGD of lr 0)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    stats = train.rl_step(model, model, opt, batch, cfg, contextlib.nullcontext(), reference=reference)
    assert stats["status"] == "updated"
    return stats


@pytest.mark.parametrize("row, entropy", [
    ([0.0] * V, math.log(V)),                                        # uniform over V tokens: log V
    # logits 2, 1, 0...: Z = e^2 + e + (V - 2), H = log Z - (2 e^2 + e) / Z
    ([2.0, 1.0] + [0.0] * (V - 2),
     math.log(math.e ** 2 + math.e + V - 2) - (2 * math.e ** 2 + math.e) / (math.e ** 2 + math.e + V - 2)),
])
def test_logged_entropy_is_the_hand_computed_one(row, entropy):
    """Mutations: the entropy's sign flipped in token_logprobs ((p log p).sum), or its sum taken
    over the wrong role / a wrong count in train.rl_step."""
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 20}              # one row per micro-batch
    batch, n_act, n_rehearse = hand_batch(cfg)
    model = FixedLogits(row)
    totals = update_stats(model, batch, cfg)
    assert totals["entropy_count_act"] == n_act and totals["entropy_count_rehearse"] == n_rehearse
    assert totals["entropy_act"] == pytest.approx(entropy * n_act, rel=1e-5)
    assert totals["entropy_rehearse"] == pytest.approx(entropy * n_rehearse, rel=1e-5)
    record = record_of(totals)
    assert entropy > 0 and record["entropy_act"] == pytest.approx(entropy, rel=1e-5)
    assert record["entropy_rehearse"] == pytest.approx(entropy, rel=1e-5)


def test_per_role_kl_is_kl_new_to_ref(monkeypatch):
    """k3 of KL(new || ref) is exp(ref - new) - (ref - new) - 1, which is not symmetric.
    Mutation: ref and new swapped in metrics.add_micro_batch (or at its call in train.rl_step)."""
    new = torch.tensor([[-1.0, -2.0, -3.0, -0.5]])
    ref = torch.tensor([[-2.0, -1.5, -1.0, -4.0]])
    roles = torch.tensor([[ACT, REHEARSE, PROMPT, ACT]])             # PROMPT: not trained, not counted
    totals = {}
    metrics.add_micro_batch(totals, {}, torch.zeros_like(new), new, ref, roles, roles != PROMPT, weight=1.0)
    # ACT: d = ref - new = -1 and -3.5; REHEARSE: d = 0.5
    act = (math.exp(-1) + 1 - 1) + (math.exp(-3.5) + 3.5 - 1)
    assert totals["kl_sum_act"] == pytest.approx(act) and totals["kl_count_act"] == 2
    assert totals["kl_sum_rehearse"] == pytest.approx(math.exp(0.5) - 0.5 - 1) and totals["kl_count_rehearse"] == 1
    swapped = (math.exp(1) - 1 - 1) + (math.exp(3.5) - 3.5 - 1)
    assert abs(act - swapped) > 1                                    # the test tells the two apart
    record = record_of(totals)
    assert record["kl_ref_act"] == pytest.approx(act / 2)
    assert record["kl_ref_rehearse"] == pytest.approx(math.exp(0.5) - 1.5)

    # through the update: a uniform model (new = -log V on every target), the reference's
    # logprobs set by hand (train.reference_logprobs for the reference): ref = new + 1
    cfg = {**config.DEFAULTS, "kl_coef": 0.1, "kl_rehearse_coef": 0.1}
    batch, n_act, n_rehearse = hand_batch(cfg)
    reference = torch.nn.Identity()
    monkeypatch.setattr(train, "reference_logprobs", lambda m, b, *a: torch.full(b["sampled_logprobs"].shape,
                                                                                 -math.log(V) + 1.0))
    totals = update_stats(FixedLogits([0.0] * V), batch, cfg, reference)
    assert totals["kl_count_act"] == n_act and totals["kl_count_rehearse"] == n_rehearse
    record = record_of(totals)
    assert record["kl_ref_act"] == pytest.approx(math.e - 2, rel=1e-5)          # d = +1
    assert record["kl_ref_rehearse"] == pytest.approx(math.e - 2, rel=1e-5)     # swapped: 1/e


# ----------------------------------------------------------------------------- 3. top-p

def test_top_p_keeps_the_smallest_set_reaching_p_and_logprobs_are_the_full_ones():
    """probs 0.15, 0.5, 0.05, 0.3 (ids 0..3): sorted 0.5, 0.3, 0.15, 0.05, the mass before each
    0, 0.5, 0.8, 0.95. top_p 0.7 keeps {1, 3}, 0.9 keeps {1, 3, 0}, 0.4 keeps {1}. Mutations: the
    cumulative sum without `- sorted_p` (top_p 0.7 would keep {1} only), the kept probabilities
    not scattered back to their ids, a logprob from the truncated, renormalised distribution."""
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])
    n = 4000
    logits = probs.log().expand(n, -1)
    for top_p, kept in ((0.7, {1, 3}), (0.9, {0, 1, 3}), (0.4, {1})):
        tokens, logps = sample_token(logits, 1.0, top_p, torch.Generator().manual_seed(0))
        assert set(tokens.tolist()) == kept, top_p
        # the recorded logprob is the full distribution's: log 0.5 for id 1, never log(0.5 / 0.8)
        assert torch.allclose(logps, probs.log()[tokens], atol=1e-6)
    tokens, _ = sample_token(logits, 1.0, 0.7, torch.Generator().manual_seed(1))
    assert (tokens == 1).float().mean().item() == pytest.approx(0.5 / 0.8, abs=0.03)   # 4 sigma
    # temperature 0.5: probs ~ p^2 = .0225, .25, .0025, .09 (sum .365); top_p 0.7 keeps {1, 3}
    # (mass before id 3: .25/.365 = .685), and the logprob is that of the tempered distribution
    tokens, logps = sample_token(logits, 0.5, 0.7, torch.Generator().manual_seed(2))
    assert set(tokens.tolist()) == {1, 3}
    tempered = torch.tensor([0.0225, 0.25, 0.0025, 0.09]) / 0.365
    assert torch.allclose(logps, tempered.log()[tokens], atol=1e-5)


# ----------------------------------------------------------------------------- 4 and 5. warm start

def warm_inputs():
    """8 logged expert episodes of several lengths (responses OBS), a 3-step warm-start config."""
    rng = random.Random(0)
    tasks = [world.random_task(rng, "plain") for _ in range(8)]
    seqs = [encode_episode(TOK, t["prompt"], t["calls"], world.replay(t["calls"]), t["answer"]) for t in tasks]
    cfg = {**config.DEFAULTS, "sft_steps": 3, "sft_batch_size": 4, "sft_lr": 1e-3, "micro_batch_tokens": 60,
           "grad_clip": 0.0, "seed": 0}      # no clipping: the gradients are compared unscaled
    return seqs, cfg


class RecordingSGD(torch.optim.SGD):
    """Plain SGD in the warm start's place (it makes AdamW(params, lr=, weight_decay=)), keeping
    every step's gradients: SGD moves a weight by lr x its gradient, so float differences between
    two runs stay that small, where AdamW's first step (g / |g| elementwise) turns a last-bit
    difference of a near-zero entry into a whole learning rate."""
    steps = []

    def step(self, *a, **k):
        RecordingSGD.steps.append([p.grad.clone() for p in self.param_groups[0]["params"]])
        return super().step(*a, **k)


def warm_started(rank, world_size):
    seqs, cfg = warm_inputs()
    model = tiny_llama(TOK, seed=0)
    ddp_model = DDP(model) if world_size > 1 else model
    RecordingSGD.steps = []
    train.warm_start(model, ddp_model, seqs, {**cfg, "sft_lr": 0.3}, TOK.pad_token_id)   # ranks: the process group's
    names = [name for name, _ in model.named_parameters()]
    return model, [dict(zip(names, grads)) for grads in RecordingSGD.steps]


def _warm_worker(rank, world_size, init_file, result_file):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    model, steps = warm_started(rank, world_size)
    if rank == 0:
        torch.save((model.state_dict(), steps), result_file)
    dist.destroy_process_group()


def test_warm_start_on_two_ranks_equals_one_rank(tmp_path, monkeypatch):
    """Each rank trains its half of the same global batch: 2 gloo ranks must make the 1-rank
    update, step by step. Mutations: the loss not multiplied by world_size (DDP then averages:
    half the gradient), or the token count taken per rank instead of globally."""
    seqs, cfg = warm_inputs()
    # the two ranks' halves pack into different numbers of micro-batches at some step
    rng = random.Random(cfg["seed"])
    counts = set()
    for _ in range(cfg["sft_steps"]):
        batch = rng.sample(seqs, cfg["sft_batch_size"])
        counts |= {tuple(len(envace.micro_batches([len(s["ids"]) for s in half], cfg["micro_batch_tokens"]))
                         for half in (batch[:2], batch[2:]))}
    assert any(a != b for a, b in counts)
    monkeypatch.setattr(train.torch.optim, "AdamW", RecordingSGD)       # (the forked ranks inherit it)
    result = str(tmp_path / "two.pt")
    # forked: the children start with the modules already imported (spawn would import torch anew)
    run_ranks(_warm_worker, (2, str(tmp_path / "init"), result), tmp_path)
    two, two_steps = torch.load(result)
    model, one_steps = warm_started(0, 1)
    assert len(one_steps) == len(two_steps) == cfg["sft_steps"]
    # each step's gradient (helpers.GRAD_TOLERANCE: 1e-4 of each tensor's largest entry); steps 2
    # and 3 start from weights that differ by the earlier steps' lr x gradient difference (below)
    for one_grads, two_grads in zip(one_steps, two_steps):
        assert_same_gradients(one_grads, two_grads)
    # the weights: w0 - sum over steps of lr_k x g_k (lr_k <= sft_lr 0.3), so they differ by at most
    # the sum of the steps' gradient differences plus a float32 rounding of w per step (|w| <= 1)
    bound = sum(0.3 * GRAD_TOLERANCE * max(g.abs().max().item() for g in step.values()) for step in one_steps)
    one, start = model.state_dict(), tiny_llama(TOK, seed=0).state_dict()
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 100 * bound       # it moved
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= bound + 3 * 6e-8


def test_warm_start_learning_rate_is_cosine_to_a_tenth(monkeypatch):
    """lr(it) = sft_lr * (0.1 + 0.9 * (1 + cos(pi * it / steps)) / 2): with 4 steps and sft_lr
    1e-3, cos(pi/4) = 0.70711: 1e-3, 0.86820e-3, 0.55e-3, 0.23180e-3. Mutations: the cosine's
    phase off by one step, the floor 0.1 dropped, the schedule not written to the optimizer."""
    used = []

    class Recording(torch.optim.AdamW):
        def step(self, *a, **k):
            used.append(self.param_groups[0]["lr"])
            return super().step(*a, **k)
    monkeypatch.setattr(train.torch.optim, "AdamW", Recording)
    seqs, cfg = warm_inputs()
    cfg = {**cfg, "sft_steps": 4, "micro_batch_tokens": 512}
    model = tiny_llama(TOK, seed=0)
    train.warm_start(model, model, seqs, cfg, TOK.pad_token_id)
    assert used == pytest.approx([1e-3, 0.868198e-3, 0.55e-3, 0.231802e-3], rel=1e-5)


# ----------------------------------------------------------------------------- 7. would-rehearse

class Teacher(torch.nn.Module):
    """Teacher-forced: the argmax after position t is the true token t+1, except at the positions
    in `wrong` ({t: token}), where it is `token`."""

    def __init__(self, wrong=None):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.wrong = wrong or {}

    def forward(self, input_ids, **kw):
        target = torch.roll(input_ids, -1, dims=1)
        for t, tok in self.wrong.items():
            target[:, t] = tok
        return SimpleNamespace(logits=torch.nn.functional.one_hot(target, V).float())


def test_would_rehearse_counts_the_closing_env_tag():
    """A model that writes the response '3' right but not its `</env>` would not have rehearsed
    it: greedy decoding would run on. Mutation: the closing tag left out of each response's
    segment (or the segment cut before it)."""
    e = {**encode_episode(TOK, "buy apple", ["price apple", "pay 3"], ["3", "6"], "6"),
         "calls": ["price apple", "pay 3"], "responses": ["3", "6"]}
    env_end, digit3, digit6 = TOK.convert_tokens_to_ids(["</env>", "3", "6"])
    first_end = e["ids"].index(env_end)
    assert e["ids"][first_end - 1] == digit3
    second_end = e["ids"].index(env_end, first_end + 1)
    assert e["ids"][second_end - 1] == digit6
    assert honesty.would_rehearse_calls(Teacher(), TOK, [e]) == [("price apple", True), ("pay 3", True)]
    # after '3' it predicts '3' again instead of </env> (the prediction of t+1 sits at t)
    wrong_end = Teacher({first_end - 1: digit3})
    assert honesty.would_rehearse_calls(wrong_end, TOK, [e]) == [("price apple", False), ("pay 3", True)]
    # the other way round: the digit wrong, the closing tag right
    wrong_digit = Teacher({second_end - 2: digit3})
    assert honesty.would_rehearse_calls(wrong_digit, TOK, [e]) == [("price apple", True), ("pay 3", False)]


# ----------------------------------------------------------------------------- 8. chat rewards

def test_value_match_never_takes_a_bool_for_a_number():
    """Mutations: either side of the bool check dropped (`isinstance(got, bool)` or
    `isinstance(want, bool)`)."""
    assert value_match(True, True) and value_match(False, False)
    assert not value_match(True, 1) and not value_match(1, True)
    assert not value_match(False, 0) and not value_match(0, False)
    assert not value_match(True, False)
    assert not value_match(True, 1.0) and not value_match(1.0, True)
    assert value_match(1, 1.0) and value_match({"n": [2, True]}, {"n": [2.0, True]})
    assert not value_match({"n": [2, 1]}, {"n": [2, True]})


def test_calls_match_any_order_uses_each_call_once():
    """Mutation: a matched call not removed (`left.pop(hit)`), so one call answers two gold calls."""
    a = {"name": "price", "arguments": {"item": "apple"}}
    b = {"name": "price", "arguments": {"item": "pear"}}
    assert not calls_match([a, b], [a, a], "any")
    assert calls_match([a, a], [a, a], "any")
    assert calls_match([b, a], [a, b], "any") and not calls_match([b, a], [a, b], "exact")
    assert not calls_match([a, b], [b, b], "any") and not calls_match([a], [a, a], "any")


# ----------------------------------------------------------------------------- 9. format errors

def test_evaluate_format_errors_over_real_causes():
    """Five tasks: a right answer, a wrong answer, a malformed call, a call past max_act_tokens,
    a tag written by the actor. format_errors = the 2 malformed endings / 5 = 0.4 (a wrong
    answer is no format error, and an act past max_act_tokens is cut_at_act_limit, 1/5);
    success = 1/5. Mutations: format_errors as 1 - success, or counting wrong answers or the
    cut act, or a single cause."""
    cases = [("price apple", "3", "<act> price apple </act> <env> x x <act> answer 3 </act>"),   # answer, right
             ("price milk", "2", "<act> answer 5 </act>"),                                      # answer, wrong
             ("price egg", "1", "<act> mul egg </act>"),                                        # bad_call
             ("price tea", "4", "<act>" + " price" * 10),                                       # act_limit
             ("price fish", "9", "<act> price fish <env>")]                                     # bad_act
    tasks = [{"prompt": p, "answer": a, "family": "price"} for p, a, _ in cases]
    model = ScriptedModel(TOK, {p: s for p, _, s in cases})
    cfg = {**config.DEFAULTS, "n_collusion": 0}
    result = evaluate(model, TOK, tasks, cfg, format_plain, format_plain.setup(cfg, TOK, {"logged": []}))
    assert result["causes"] == {"answer": 2, "bad_call": 1, "act_limit": 1, "bad_act": 1}
    assert result["format_errors"] == pytest.approx(2 / 5)
    assert result["cut_at_act_limit"] == pytest.approx(1 / 5)
    assert result["success"] == pytest.approx(1 / 5)
    assert result["mean_calls"] == pytest.approx(1 / 5)


# ----------------------------------------------------------------------------- 10. token budget

def test_token_budget_is_per_row_whatever_the_prompt_length():
    """A 3-id and an 8-id prompt in one batch, both scripted to run on: each row stops with
    token_limit at exactly max_tokens ids. Mutations: the step count taken from the longest
    prompt (the short row stops early) or the budget counted after the prompt."""
    loop = "<act> price apple </act> <env> 3 </env> " * 6
    prompts = ["price apple", "not pear buy 2 milk and egg"]
    lengths = [len(TOK.encode(p, add_special_tokens=False)) + 1 for p in prompts]
    assert lengths == [3, 8]
    model = ScriptedModel(TOK, {p: loop for p in prompts})
    for env_mode in ("rehearse", "real"):
        eps = sample_episodes(model, TOK, prompts, env_mode, settings={"max_tokens": 20, "max_turns": 6})
        for e, p, n in zip(eps, prompts, lengths):
            assert e["cause"] == "token_limit" and len(e["ids"]) == 20, (env_mode, p)
            assert words(e["ids"]) == f"<bos> {p} " + " ".join(loop.split()[:20 - n])
            assert len(e["roles"]) == len(e["logprobs"]) == 20
