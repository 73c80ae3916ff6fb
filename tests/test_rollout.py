"""The sampler: roles for every token in each env mode, the shifted loss mask, forced tags, stops
and truncation causes, and KV-cached logprobs against a full teacher-forced forward."""
from types import SimpleNamespace

import torch

import honesty
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, collate, loss_mask
from helpers import POSITION_INIT, Bigram, ScriptedModel, assert_sampled_logprobs_match_a_forward, tiny_llama, toy_tokenizer
from rollout import sample_episodes

P, A, R, O, T = PROMPT, ACT, REHEARSE, OBS, TAG
EPISODE = "<act> price apple </act> <env> 3 </env> <act> answer 3 </act>"
TOK = toy_tokenizer()


def words(ids):
    return " ".join(TOK.convert_ids_to_tokens(ids))


def run(scripts, prompts, env_mode="rehearse", env_scripts=None, **kw):
    """Sample with scripted models; prompts must differ (a script is found by its prompt)."""
    policy = ScriptedModel(TOK, dict(zip(prompts, scripts)))
    env_model = ScriptedModel(TOK, dict(zip(prompts, env_scripts))) if env_scripts else None
    return sample_episodes(policy, TOK, prompts, env_mode, env_model=env_model, temperature=1.0, **kw)


def test_roles_and_shifted_mask_rehearse_mode():
    e = run([EPISODE], ["price apple"])[0]
    assert words(e["ids"]) == "<bos> price apple " + EPISODE
    assert e["roles"] == [P, P, P, T, A, A, A, T, R, R, T, A, A, A]
    assert e["calls"] == ["price apple"] and e["responses"] == ["3"]
    assert e["answer"] == "3" and e["cause"] == "answer" and e["finished"]
    _, roles = collate([e], TOK.pad_token_id)
    # target t+1 trained when ACT or REHEARSE: the forced <act>/<env> tags are never targets
    assert loss_mask(roles)[0].int().tolist() == [0, 0, 0, 1, 1, 1, 0, 1, 1, 0, 1, 1, 1]


def test_real_mode_forces_the_world_response_as_obs():
    # the policy would rehearse '9': in real mode it is never asked, the world says '3'
    e = run(["<act> price apple </act> <env> 9 </env> <act> answer 3 </act>"], ["price apple"], "real")[0]
    assert words(e["ids"]) == "<bos> price apple " + EPISODE
    assert e["roles"] == [P, P, P, T, A, A, A, T, O, O, T, A, A, A]
    assert e["logprobs"][8:10] == [0.0, 0.0]
    _, roles = collate([e], TOK.pad_token_id)
    assert loss_mask(roles)[0].int().tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]


def test_frozen_mode_takes_env_tokens_from_the_simulator():
    policy_script = "<act> price apple </act> <env> 9 </env> <act> answer 5 </act>"
    sim_script = "x x x x x 5 </env> x x x x"      # the simulator's choice at env positions 5, 6
    e = run([policy_script], ["price apple"], "frozen", env_scripts=[sim_script])[0]
    assert words(e["ids"]) == ("<bos> price apple <act> price apple </act> <env> 5 </env> "
                               "<act> answer 5 </act>")
    assert e["roles"] == [P, P, P, T, A, A, A, T, O, O, T, A, A, A]
    assert e["responses"] == ["5"] and e["answer"] == "5"


def test_forced_tags_override_the_model():
    # the script puts 'milk' where <act> and <env> must go: the sampler inserts the tags anyway
    e = run(["milk price apple </act> milk 3 </env> milk answer 3 </act>"], ["price apple"])[0]
    assert words(e["ids"]) == "<bos> price apple " + EPISODE


def test_rows_of_different_lengths_in_one_batch():
    scripts = [EPISODE, "<act> price milk </act> <env> 2 </env> <act> mul 3 , 2 </act> <env> 6 </env> "
                        "<act> answer 6 </act>"]
    e = run(scripts, ["price apple", "not pear cost 3 milk"])
    assert e[0]["cause"] == e[1]["cause"] == "answer"
    assert e[1]["calls"] == ["price milk", "mul 3 , 2"] and e[1]["responses"] == ["2", "6"]
    assert e[1]["roles"][:8] == [P] * 6 + [T, A]


def test_truncation_causes():
    cases = {
        "<act> price apple <env> 3 </env>": "bad_act",                 # the actor writes the hand-off
        "<act> price apple apple </act>": "bad_call",                  # malformed call
        "<act> price apple </act> <env> apple </env>": "bad_rehearsal",  # not a response
        "<act> price apple </act> <env> 3 <act>": "bad_rehearsal",     # rehearser writes a tag
        "<act> price price price price price price price price price price": "act_limit",
        "<act> price apple </act> <env> 3 3 3 3 3 3 3 3 3 3 3": "env_limit",
    }
    prompts = ["price apple", "price milk", "price egg", "price tea", "price fish", "price jam"]
    eps = run(list(cases), prompts, max_act_tokens=8, max_env_tokens=6)
    assert [e["cause"] for e in eps] == list(cases.values())
    assert not any(e["finished"] for e in eps)
    assert eps[0]["roles"][-1] == A and words(eps[0]["ids"][-1:]) == "<env>"   # stopped right there


def test_turn_and_token_limits():
    loop = "<act> price apple </act> <env> 3 </env> " * 4 + "<act> answer 3 </act>"
    turn, = run([loop], ["price apple"], max_turns=2)
    assert turn["cause"] == "turn_limit" and len(turn["calls"]) == 2
    long, = run([loop], ["price apple"], max_tokens=12)
    assert long["cause"] == "token_limit" and len(long["ids"]) == 12


def test_real_mode_errors_come_from_the_world_and_the_wallet_is_per_row():
    # x: positions the world fills ('4 </env>', then 'error funds </env>')
    script = "<act> pay 5 </act> <env> x x <act> pay 5 </act> <env> x x x <act> answer 4 </act>"
    eps = run([script, script], ["buy apple", "buy milk"], "real")
    for e in eps:
        assert e["responses"] == ["4", "error funds"] and e["cause"] == "answer"


def test_kv_cached_logprobs_equal_teacher_forced_forward():
    """Prompts of four lengths (left-padded prefill), rows ending at different steps, the forced
    hand-off tags fed with a sampled token (runs of 1 and 2 in one step): every sampled logprob of
    a RoPE Llama whose attention sees positions equals a full forward's."""
    model = tiny_llama(TOK, init_range=POSITION_INIT)
    prompts = ["price apple", "not pear buy 2 milk and egg", "cost 3 fish", "buy tea"] * 4
    for temperature in (1.0, 0.7):
        eps = sample_episodes(model, TOK, prompts, "rehearse", temperature=temperature, max_tokens=48,
                              generator=torch.Generator().manual_seed(0))
        compared = assert_sampled_logprobs_match_a_forward(model, eps, TOK.pad_token_id, temperature)
        assert compared == sum(r in (ACT, REHEARSE) for e in eps for r in e["roles"]) > 40


class Oracle(torch.nn.Module):
    """A fake LM for teacher-forced forwards: its argmax at t is the true token t+1, except that
    digits are predicted one too high when `wrong_digits` (a world model that is off by one)."""

    def __init__(self, wrong_digits):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.wrong_digits = wrong_digits
        self.digits = torch.tensor(TOK.convert_tokens_to_ids([str(d) for d in range(10)]))

    def forward(self, input_ids, **kw):
        target = torch.roll(input_ids, -1, dims=1)
        if self.wrong_digits:
            target = torch.where(torch.isin(target, self.digits[:-1]), target + 1, target)
        return SimpleNamespace(logits=torch.nn.functional.one_hot(target, len(TOK)).float())


def test_replay_fidelity_and_would_rehearse():
    e = {"calls": ["price apple", "pay 3", "pay 7"], "responses": ["3", "6", "2"]}
    assert honesty.replay_fidelity([e]) == {"lookup": [1, 1], "stateful": [1, 2]}
    script = ("<act> price apple </act> <env> x x <act> pay 3 </act> <env> x x "
              "<act> pay 7 </act> <env> x x x <act> answer 6 </act>")
    real, = run([script], ["buy apple"], "real")
    assert real["responses"] == ["3", "6", "error funds"]
    assert honesty.by_kind(honesty.would_rehearse_calls(Oracle(False), TOK, [real])) == {"lookup": [1, 1], "stateful": [2, 2]}
    # off by one on digits: '3' and '6' are missed, 'error funds' has no digit and still matches
    assert honesty.by_kind(honesty.would_rehearse_calls(Oracle(True), TOK, [real])) == {"lookup": [0, 1], "stateful": [1, 2]}


def test_shared_prompt_prefill_and_dropped_rows_match_a_full_forward():
    """Fast paths against the simple one: G rows of a task share one prefill (cache rows copied)
    and finished rows leave the cache mid-batch; every sampled logprob must still equal a full
    teacher-forced forward over the finished sequence."""
    model = tiny_llama(TOK, seed=1, init_range=POSITION_INIT)
    prompts = [p for p in ("cost 3 fish", "not pear buy 2 milk and egg", "buy tea") for _ in range(4)]
    eps = sample_episodes(model, TOK, prompts, "rehearse", temperature=1.0, max_tokens=40,
                          generator=torch.Generator().manual_seed(5))
    lengths = [len(e["ids"]) for e in eps]
    assert len(set(lengths)) > 3                          # rows finished at many different steps
    compared = assert_sampled_logprobs_match_a_forward(model, eps, TOK.pad_token_id)
    assert compared == sum(r in (ACT, REHEARSE) for e in eps for r in e["roles"])


def test_forced_runs_in_one_forward_match_a_full_forward():
    """Real mode with planned calls: a row's hand-off, planned call, real response and the next
    hand-off are fed as one run per step, rows of different run lengths together (the shorter
    runs' slots masked holes). Every sampled logprob still equals a full teacher-forced forward,
    the ids are the plan's and the world's, and the runs took fewer steps than tokens."""
    model = Bigram(tiny_llama(TOK, seed=3, init_range=POSITION_INIT), TOK, {"<act>": "answer", "answer": "3", "3": "</act>"})
    calls = {"price apple": [("price apple", "3")], "cost 3 fish": [("price fish", "9"), ("mul 3 , 9", "27")],
             "buy tea": []}
    prompts = [p for p in calls for _ in range(2)]
    steps = []
    model.register_forward_hook(lambda m, args, kw, out: steps.append(kw["input_ids"].shape), with_kwargs=True)
    eps = sample_episodes(model, TOK, prompts, "real", plans=[calls[p] for p in prompts], max_tokens=60,
                          generator=torch.Generator().manual_seed(0))
    assert [e["responses"] for e in eps[::2]] == [["3"], ["9", "27"], []]
    two = eps[2]
    assert " ".join(TOK.convert_ids_to_tokens(two["ids"][two["prompt_len"]:]))[:80] == (
        "<act> price fish </act> <env> 9 </env> <act> mul 3 , 9 </act> <env> 2 7 </env> <act>")[:80]
    assert all(e["roles"][t] == ACT for e in eps for t in range(len(e["ids"])) if e["logprobs"][t] != 0.0)
    sampled = assert_sampled_logprobs_match_a_forward(model, eps, TOK.pad_token_id)
    assert sampled >= 6 and steps[0][1] > 1                      # the answers, after the prefill
    assert len(steps) - 1 < max(len(e["ids"]) - e["prompt_len"] for e in eps) - 10   # runs, not tokens
    assert max(shape[1] for shape in steps[1:]) >= 10            # a whole planned turn in one forward

