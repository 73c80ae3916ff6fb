"""Keeping the rehearsed world honest: the collusion count on hand-made episodes, the
`rehearse_check` guard (form of a rehearsed response), the per-role KL to the warm start
(`kl_rehearse_coef`), and their plumbing through a few-step run."""
from formats import features
from formats import format_plain
from formats import setting as formats_setting
import envace
from machinery import distributed
from machinery import config
import contextlib
import json
import math
import os

import pytest
import torch

from scripts import evaluate_cli
from reporting import metrics
from worldmodel import honesty
import rehearse
from worldmodel import separate
import train
import world
from machinery.checkpoint import build_tokenizer
from envace import ACT, PROMPT, REHEARSE, TAG, encode_episode, token_logprobs
from helpers import ScriptedModel, assert_same_gradients, recording, step_grads, tiny_cfg, tiny_llama, toy_tokenizer
from reward import cause_counts, task_reward
from rollout import sample_episodes

TOK = toy_tokenizer()
FP32 = contextlib.nullcontext()          # rl_step's autocast context on the CPU in fp32
# not pear cost 3 milk: milk costs 2, pear 4; the solution's path is price -> 2, mul -> 6
TASK = {"prompt": "not pear cost 3 milk", "answer": "6", "family": "cost",
        "calls": ["price milk", "mul 3 , 2"]}


def episode(calls, responses, answer):
    return {"calls": calls, "responses": responses, "answer": answer,
            "cause": "answer" if answer is not None else "bad_rehearsal"}


COLLUDING = episode(["price pear", "mul 3 , 2"], ["2", "6"], "6")     # pear answered as milk
HONEST_WRONG = episode(["price pear", "mul 3 , 4"], ["4", "12"], "12")  # true rehearsals, fails
HONEST = episode(["price milk", "mul 3 , 2"], ["2", "6"], "6")


# ----------------------------------------------------------------------------- collusion

def test_collusion_counts_on_hand_made_episodes():
    count = honesty.collusion_counts
    # price pear is wrong (real 4, off the path); its rehearsed 2 is the path's price and the
    # episode succeeded: it colludes. mul 3 , 2 is right (real 6 is on the path).
    assert count([COLLUDING], [TASK]) == {"calls": 2, "wrong": 1, "colluding": 1}
    # both calls wrong in the real world (4 and 12 are off the path), told truthfully: no collusion
    assert count([HONEST_WRONG], [TASK]) == {"calls": 2, "wrong": 2, "colluding": 0}
    assert count([HONEST], [TASK]) == {"calls": 2, "wrong": 0, "colluding": 0}
    total = count([COLLUDING, HONEST_WRONG, HONEST], [TASK] * 3)
    assert total == {"calls": 6, "wrong": 3, "colluding": 1}
    assert honesty.collusion_rate(total)["rate"] == pytest.approx(1 / 3)
    assert honesty.collusion_rate(count([HONEST], [TASK]))["rate"] is None


def test_a_lie_that_does_not_win_is_not_collusion():
    # the same lie in an episode that then answers wrong (reward 0): wrong call, no collusion
    lost = episode(["price pear", "mul 3 , 2"], ["2", "6"], "7")
    assert honesty.collusion_counts([lost], [TASK]) == {"calls": 2, "wrong": 1, "colluding": 0}
    # a lie with a value the task never needed, in a won episode: not collusion either
    detour = episode(["price pear", "price milk", "mul 3 , 2"], ["5", "2", "6"], "6")
    assert honesty.collusion_counts([detour], [TASK]) == {"calls": 3, "wrong": 1, "colluding": 0}


def test_collusion_with_the_wallet_errors_and_truncation():
    buy = {"prompt": "not tea buy 2 salt", "answer": "7", "family": "buyq",
           "calls": ["price salt", "mul 2 , 1", "pay 2"]}                 # path: 1, 2, balance 7
    # pay 9 really leaves 0 (off the path); rehearsed as 7, the episode answers 7: colludes
    overpay = episode(["price salt", "mul 2 , 1", "pay 9"], ["1", "2", "7"], "7")
    # price 3 really errs: wrong; answered as if it were salt's price, then the episode wins
    error = episode(["price 3", "mul 2 , 1", "pay 2"], ["1", "2", "7"], "7")
    # truncated after one rehearsal: only the call with a response counts, reward 0
    cut = {"calls": ["price tea", "mul 2 , 4"], "responses": ["1"], "answer": None, "cause": "env_limit"}
    assert honesty.collusion_counts([overpay, error, cut], [buy] * 3) == {
        "calls": 7, "wrong": 3, "colluding": 2}
    # a task from a file has no expert calls: skipped
    assert honesty.collusion_counts([overpay], [{"prompt": "x", "answer": "7"}])["calls"] == 0


def test_collusion_rates_add_up_over_ranks_as_counts():
    """Two ranks' sums (1 of 3 wrong, 1 of 1 wrong) make 2 / 4 = 0.5, not the mean of rates."""
    def sums(episodes):            # a rank's step sums with its replay diagnostics, as log_step adds them
        rewards = [task_reward(e, TASK) for e in episodes]
        batch = {"all_equal_groups": 0, "roles": torch.full((len(episodes), 5), PROMPT),
                 "advantages": torch.zeros(len(episodes), 4)}
        return {**metrics.step_sums([dict(e, ids=[0] * 5) for e in episodes], rewards, batch),
                "fidelity": honesty.replay_fidelity(episodes),
                "collusion": honesty.collusion_counts(episodes, [TASK] * len(episodes))}
    total = distributed.add_up([sums([COLLUDING, HONEST_WRONG]), sums([COLLUDING])])
    record = metrics.metrics_record(1, {**total, "status": "updated"}, {"skipped": 0, "nonfinite": 0}, 1.0)
    assert (record["reward"], record["mean_calls"]) == (2 / 3, 2.0)     # the colluding episodes answer 6
    assert record["collusion"] == {"calls": 6, "wrong": 4, "colluding": 2, "rate": 0.5}
    assert record["fidelity"] == {"lookup": pytest.approx(1 / 3), "compute": 1.0}
    assert record["fidelity_counts"] == {"lookup": [1, 3], "compute": [3, 3]}


# ----------------------------------------------------------------------------- rehearse_check

@pytest.mark.parametrize("call, response, ok", [
    ("price apple", "3", True),          # valid
    ("price apple", "7", True),          # the wrong value but the right form: not the check's job
    ("price apple", "error item", False),  # a catalogue item gets a number
    ("price 3", "5", False),             # not an item: the schema says error, a number is missing it
    ("price 3", "error item", True),
    ("price 3", "error args", False),    # the schema's own error, not another
    ("mul 2 , 3", "6", True),
    ("mul 2 , 3", "error args", False),
    ("mul 0 , 12", "0", False),
    ("mul 0 , 12", "error args", True),
    ("pay 5", "4", True),
    ("pay 5", "error funds", True),      # depends on the wallet: allowed
    ("pay 0", "9", False),
    ("pay 0", "error args", True),
])
def test_check_rehearsal_form(call, response, ok):
    assert rehearse.check_rehearsal(call, response) is ok


def test_every_real_response_passes_the_check_whatever_the_wallet():
    calls = [f"price {i}" for i in world.ITEMS] + ["price 3", "price buy"]
    calls += [f"mul {a} , {b}" for a in range(0, 11) for b in (0, 1, 9, 10)]
    calls += [f"pay {n}" for n in range(0, 12)]
    for spent in range(world.WALLET + 1):
        for call in calls:
            state = {"balance": world.WALLET - spent}
            response = world.step(state, call)
            assert rehearse.check_rehearsal(call, response), (spent, call, response)


# two rehearsals of the wrong form for their call, then a valid episode
CHECK_SCRIPTS = {"cost 2 apple": "<act> price apple </act> <env> 3 </env> <act> mul 2 , 3 </act> <env> "
                                 "error args </env> <act> answer 6 </act>",        # wrong form
                 "price 3": "<act> price 3 </act> <env> 5 </env> <act> answer 5 </act>",  # error missing
                 "buy apple": "<act> price apple </act> <env> 3 </env> <act> pay 3 </act> <env> 6 </env> "
                              "<act> answer 6 </act>"}                              # valid


def test_rehearse_check_ends_the_episode_with_reward_0():
    scripts = CHECK_SCRIPTS
    tasks = [{"answer": "6"}, {"answer": "5"}, {"answer": "6"}]
    policy = ScriptedModel(TOK, scripts)
    off = sample_episodes(policy, TOK, list(scripts), "rehearse", settings={"temperature": 0})
    on = sample_episodes(policy, TOK, list(scripts), "rehearse",
                         settings={"temperature": 0, "rehearse_check": rehearse.check_rehearsal})
    assert [task_reward(e, t) for e, t in zip(off, tasks)] == [1.0, 1.0, 1.0]
    assert [task_reward(e, t) for e, t in zip(on, tasks)] == [0.0, 0.0, 1.0]
    assert cause_counts(on) == {"rehearse_check": 2, "answer": 1}
    # the offending response is kept (fidelity counts it as a miss); nothing is sampled after it
    assert on[0]["responses"] == ["3", "error args"] and on[1]["responses"] == ["5"]
    assert TOK.convert_ids_to_tokens(on[1]["ids"][-2:]) == ["5", "</env>"]
    assert on[2]["ids"] == off[2]["ids"]


def test_the_rl_sampler_carries_the_config_chosen_once(monkeypatch):
    """features.setup puts env_mode and the config's sampling keys in the setting that rl_sample reads:
    the guard and the token budget reach RL's episodes with nothing passed at the call; env_mode
    picks the sampler (the layout's when the policy rehearses, inline rollout.sample_episodes else)."""
    scripts = CHECK_SCRIPTS                   # the check ends the first two
    policy, splits = ScriptedModel(TOK, scripts), {"logged": [], "rl": [], "test": []}

    def causes(**kw):
        fmt, setting = features.setup({**config.DEFAULTS, "temperature": 0, **kw}, TOK, splits)
        prompts, worlds, tags = fmt.inputs(setting, [{"prompt": p} for p in scripts])
        return cause_counts(fmt.rl_sample(setting, policy, TOK, prompts, worlds, tags, None, None))
    assert causes() == {"answer": 3}
    assert causes(rehearse_check=True) == {"rehearse_check": 2, "answer": 1}
    assert causes(max_tokens=8) == {"token_limit": 3}     # "price 3": 3 prompt ids + <act> price 3 </act> <env>
    called = []

    def spy(name):
        return lambda model, tok, prompts, env_mode, **kw: called.append((name, env_mode, kw["settings"]["max_tokens"])) or []
    monkeypatch.setattr(format_plain, "sample_episodes", spy("inline"))         # the inline layout's
    monkeypatch.setattr(formats_setting, "sample_episodes", spy("inline"))     # RL's when the world is real
    monkeypatch.setattr(separate, "sample_separate", spy("separate"))

    def sampler(**kw):                        # a vocabulary with the separate prompt's words
        tok = build_tokenizer(world.WORDS + separate.SEPARATE_WORDS)
        fmt, setting = features.setup({**config.DEFAULTS, "max_tokens": 50, **kw}, tok, splits)
        fmt.rl_sample(setting, policy, tok, [], world, None, None, None)
        return called.pop()
    assert sampler() == ("inline", "rehearse", 50)
    assert sampler(env_mode="real") == ("inline", "real", 50)
    assert sampler(env_mode="real", rehearsal_context="separate") == ("inline", "real", 50)   # real: inline
    assert sampler(rehearsal_context="separate") == ("separate", "rehearse", 50)
    assert sampler(env_mode="frozen", rehearsal_context="separate") == ("separate", "frozen", 50)


# ----------------------------------------------------------------------------- KL per role

K3_LOG2 = 2 - math.log(2) - 1            # k3 with ref - new = log 2


def test_kl_coefficient_per_role_hand_computed():
    # roles P T A A T R R: targets T A A T R R, trained A A R R
    roles = torch.tensor([[PROMPT, TAG, ACT, ACT, TAG, REHEARSE, REHEARSE]])
    coefs = envace.token_kl_coefs(roles, 0.1, 2.0)
    assert coefs.tolist() == [pytest.approx([0.0, 0.1, 0.1, 0.0, 2.0, 2.0])]
    mask = torch.tensor([[False, True, True, False, True, True]])
    adv = torch.tensor([[0.0, 0.5, 0.5, 0.0, 0.5, 0.5]], dtype=torch.float64)
    old = torch.full((1, 6), -1.0, dtype=torch.float64)
    new = old.clone().requires_grad_(True)                       # ratio 1
    ref = old + math.log(2)                                      # ref above new by log 2 everywhere
    loss, stats = envace.clipped_pg_loss(new, old, adv, mask, 4, ref, kl_coef=coefs.double())
    # per trained token: -A * 1 = -0.5, plus coef * k3; act 0.1, rehearse 2.0; over 4 tokens
    assert loss.item() == pytest.approx((4 * -0.5 + 2 * 0.1 * K3_LOG2 + 2 * 2.0 * K3_LOG2) / 4, abs=1e-9)
    assert stats["kl_ref"] == pytest.approx(K3_LOG2, abs=1e-9)
    # d/dnew: -A + coef * (1 - e^{log 2}) = -0.5 - coef, over 4
    (grad,) = torch.autograd.grad(loss, new)
    assert grad[0].tolist() == pytest.approx([0.0, -0.6 / 4, -0.6 / 4, 0.0, -2.5 / 4, -2.5 / 4], abs=1e-8)


def rehearsed_batch(cfg, rewards):
    import random
    rng = random.Random(0)
    tasks = [world.random_task(rng, "new") for _ in range(4)]
    eps = [encode_episode(TOK, t["prompt"], t["calls"][:k], world.replay(t["calls"][:k]), t["answer"],
                          env_role=REHEARSE) for t in tasks for k in range(1, 4)]
    return train.make_batch(eps, rewards, {**cfg, "group_size": 3}, TOK.pad_token_id)


def test_rows_with_rehearse_kl_are_kept_and_match_the_one_batch_gradient():
    """Groups 1 and 3 have equal rewards (advantage 0). With kl_rehearse_coef alone their rows
    still carry a loss and are kept; the update (rl_step's gradient, taken by a recording SGD of lr
    0, the KL reference another model) equals one forward over the whole batch with the per-role
    coefficients. When rehearse tokens are not trained (rehearse_coef 0), there is no KL on them
    either, and the zero-advantage rows are skipped again."""
    model, reference = tiny_llama(TOK), tiny_llama(TOK, seed=1)
    rewards = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    for extra, kept in (({}, 12), ({"rehearse_coef": 0.0}, 6)):
        cfg = {**config.DEFAULTS, "kl_coef": 0.0, "kl_rehearse_coef": 0.5, **extra}
        batch = rehearsed_batch(cfg, rewards)
        with torch.no_grad():
            old = token_logprobs(model, batch["ids"]) + 0.1
            ref = token_logprobs(reference, batch["ids"])
        model.zero_grad(set_to_none=True)
        new = token_logprobs(model, batch["ids"])
        loss, _ = envace.clipped_pg_loss(new, old, batch["advantages"], batch["mask"], batch["n_tokens"],
                                        ref, kl_coef=batch["kl_coefs"])
        loss.backward()
        g_all = {n: p.grad.clone() for n, p in model.named_parameters()}
        opt = recording(torch.optim.SGD)(model.parameters(), lr=0.0)
        stats = train.rl_step(model, model, opt, {**batch, "sampled_logprobs": old},
                              {**cfg, "micro_batch_tokens": 60}, FP32, reference=reference)
        assert stats["status"] == "updated" and stats["rows_updated"] == kept
        # ~300 float32 per-token terms with |values| adding up to < 3, summed in another order:
        # at most 300 x 6e-8 x 3 = 5e-5 apart (a row left out moves the loss by its whole terms)
        assert stats["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=5e-5)
        assert_same_gradients(g_all, step_grads(model, opt))
        assert stats["kl_count_rehearse"] == (0 if extra else int((batch["roles"][:, 1:] == REHEARSE).sum()))


@pytest.mark.parametrize("kl, passed", [({}, False), ({"kl_rehearse_coef": 0.1}, True), ({"kl_coef": 0.1}, True)])
def test_the_kl_reference_is_built_and_passed_only_with_a_kl_coefficient(tmp_path, monkeypatch, kl, passed):
    """A run keeps a frozen copy of the warm start for the KL only when a KL coefficient is > 0
    (rehearse mode: no frozen simulator either): without one, rl_step gets no reference and no copy
    of the model is made (checkpoint.reference_model returns None)."""
    from machinery import checkpoint
    references, made, real_step, real_reference = [], [], train.rl_step, checkpoint.reference_model
    def rl_step(model, ddp_model, opt, batch, cfg, amp, logprobs, reference=None):
        references.append(reference)
        return real_step(model, ddp_model, opt, batch, cfg, amp, logprobs, reference)
    monkeypatch.setattr(train, "rl_step", rl_step)
    monkeypatch.setattr(checkpoint, "reference_model", lambda *a: made.append(real_reference(*a)) or made[-1])
    assert train.run(tiny_cfg(tmp_path, sft_steps=1, rl_steps=2, n_test=2, **kl)) == 0
    assert len(references) == 2 and all((r is not None) == passed for r in references)
    assert (made[0] is not None) == passed and all(r is made[0] for r in references)


def test_rehearse_kl_changes_the_loss_only_through_rehearse_tokens(monkeypatch):
    """rl_step at ratio 1 (the old logprobs are the model's own) with the reference's logprobs set by
    hand (train.reference_logprobs for the reference): log 2 above the old ones on every target."""
    model = tiny_llama(TOK)
    rewards = [1.0, 0.0, 0.0] * 4
    losses, reference, real_reference = {}, torch.nn.Identity(), train.reference_logprobs
    for kl_coef, kl_rehearse in ((0.0, 0.0), (0.0, 1.0), (1.0, 0.0)):
        cfg = {**config.DEFAULTS, "kl_coef": kl_coef, "kl_rehearse_coef": kl_rehearse}
        batch = rehearsed_batch(cfg, rewards)
        with torch.no_grad():
            old = token_logprobs(model, batch["ids"])
        monkeypatch.setattr(train, "reference_logprobs", lambda m, *a: old + math.log(2) if m is reference
                            else real_reference(m, *a))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        stats = train.rl_step(model, model, opt, {**batch, "sampled_logprobs": old}, cfg, FP32, reference=reference)
        losses[kl_coef, kl_rehearse] = stats["loss"]
    target_roles = batch["roles"][:, 1:]
    n = batch["n_tokens"]
    n_rehearse, n_act = int((target_roles == REHEARSE).sum()), int((target_roles == ACT).sum())
    # at ratio 1 and ref above by log 2 every trained token adds coef * k3(log 2); each loss is a
    # float32 sum of ~300 terms (error < 1e-6), the differences ~0.05: 1e-4 of them holds
    assert losses[0.0, 1.0] - losses[0.0, 0.0] == pytest.approx(n_rehearse * K3_LOG2 / n, rel=1e-4)
    assert losses[1.0, 0.0] - losses[0.0, 0.0] == pytest.approx(n_act * K3_LOG2 / n, rel=1e-4)


# ----------------------------------------------------------------------------- plumbing

def test_guarded_run_logs_kl_per_role_collusion_and_fidelity(tmp_path, monkeypatch):
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    # KL on both roles: every row has KL terms, so every row is updated (none left out for a zero
    # advantage) and the per-role KL means are over all of each role's trained targets
    cfg = tiny_cfg(tmp_path, rl_steps=2, kl_coef=0.1, kl_rehearse_coef=0.1, rehearse_check=True, n_collusion=8)
    assert train.run(cfg) == 0
    out = cfg["out_dir"]
    lines = [json.loads(text) for text in open(os.path.join(out, "metrics.jsonl"))]
    for line in lines:
        n_act, n_rehearse = line["tokens_act"], line["tokens_rehearse"]
        assert line["status"] == "updated" and line["rows_updated"] == 16 and n_act > 0
        if line["step"] == 1:         # the policy is still the warm start, its reference: KL 0
            assert line["kl_ref"] < 1e-9 and line["kl_ref_act"] < 1e-9 and line.get("kl_ref_rehearse", 0) < 1e-9
        else:                         # moved away from it
            assert line["kl_ref_act"] > 1e-9
        # kl_ref (the loss's stat: the sum over trained targets / their count) is the per-role
        # means weighted by the roles' counts (float32 sums in another order: 1e-4 of the value)
        weighted = (line["kl_ref_act"] * n_act + line.get("kl_ref_rehearse", 0.0) * n_rehearse) / (n_act + n_rehearse)
        assert line["kl_ref"] == pytest.approx(weighted, rel=1e-4, abs=1e-12)
        assert ("kl_ref_rehearse" in line) == (n_rehearse > 0)
        c = line["collusion"]
        assert c["rate"] == (c["colluding"] / c["wrong"] if c["wrong"] else None)
        assert sum(n for _, n in line["fidelity_counts"].values()) == c["calls"]
    result = json.load(open(os.path.join(out, "eval.json")))
    c = result["collusion"]           # the same imagined calls, counted twice; 8 imagined episodes
    assert c["calls"] == sum(n for _, n in result["imagined_fidelity_counts"].values())
    assert c["rate"] == (c["colluding"] / c["wrong"] if c["wrong"] else None)
    assert (result["imagined_success"] * 8).is_integer() and "collusion" in result["before"]
    before = open(os.path.join(out, "eval.json")).read()
    assert evaluate_cli.main(["--ckpt", out, "--collusion"]) == 0
    again = json.load(open(os.path.join(out, "collusion.json")))
    # the final policy, its 8 test tasks and the eval seed again: the very same imagined episodes
    assert again == {k: result[k] for k in ("imagined_success", "imagined_fidelity", "imagined_fidelity_counts",
                                             "collusion")}
    assert open(os.path.join(out, "eval.json")).read() == before
