"""The sampler: roles for every token in each env mode, the shifted loss mask, forced tags, stops
and truncation causes, and KV-cached logprobs against a full teacher-forced forward."""
import inspect
from types import SimpleNamespace

import pytest
import torch

from worldmodel import honesty
from worldmodel.separate import sample_separate
import rehearse
import rollout
import world
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, collate, encode, loss_mask, tag_ids
from helpers import POSITION_INIT, Bigram, ScriptedModel, assert_sampled_logprobs_match_a_forward, tiny_llama, toy_tokenizer
from machinery import config
from rollout import new_row, sample_episodes, sample_rows

P, A, R, O, T = PROMPT, ACT, REHEARSE, OBS, TAG
EPISODE = "<act> price apple </act> <env> 3 </env> <act> answer 3 </act>"
TOK = toy_tokenizer()


def words(ids):
    return " ".join(TOK.convert_ids_to_tokens(ids))


def run(scripts, prompts, env_mode="rehearse", env_scripts=None, **settings):
    """Sample with scripted models; prompts must differ (a script is found by its prompt)."""
    policy = ScriptedModel(TOK, dict(zip(prompts, scripts)))
    env_model = ScriptedModel(TOK, dict(zip(prompts, env_scripts))) if env_scripts else None
    return sample_episodes(policy, TOK, prompts, env_mode, env_model=env_model,
                           settings={"temperature": 1.0, **settings})


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
        eps = sample_episodes(model, TOK, prompts, "rehearse", settings={"temperature": temperature, "max_tokens": 48},
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
    eps = sample_episodes(model, TOK, prompts, "rehearse", settings={"temperature": 1.0, "max_tokens": 40},
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
    eps = sample_episodes(model, TOK, prompts, "real", plans=[calls[p] for p in prompts], settings={"max_tokens": 60},
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



def old_keywords_episodes(model, prompts, env_mode, generator, temperature=1.0, top_p=1.0, max_turns=6,
                          max_act_tokens=8, max_env_tokens=6, max_tokens=96, tags=None, rehearse_check=None):
    """What sample_episodes did with its separate keywords (their old defaults here): the rows
    built and sampled by hand, as its body did."""
    tags = tags or tag_ids(TOK)
    rows = [new_row(tags["bos"] + encode(TOK, p), world, tags=tags, tokenizer=TOK) for p in prompts]
    limits = {"max_turns": max_turns, "max_act_tokens": max_act_tokens, "max_env_tokens": max_env_tokens,
              "max_tokens": max_tokens, "rehearse_check": rehearse_check}
    return sample_rows(model, TOK, rows, env_mode, None, tags, limits, temperature, top_p, generator)


def test_settings_give_the_episodes_the_old_keywords_gave():
    """`settings` (a dict merged over SAMPLING) against the old keywords: None, the full dict of
    SAMPLING's values, and a partial dict each sample the same episodes token for token (ids,
    roles, logprobs, calls, responses, causes) as the old body with the same values, from a seeded
    generator, in three cases (the defaults; every setting chosen, a guard included; real mode).
    Each setting, moved a little, changes some case's episodes: none is ignored. SAMPLING holds
    the old defaults, and rollout.sampling reads them from the config."""
    assert rollout.SAMPLING == {"temperature": 1.0, "top_p": 1.0, "max_turns": 6, "max_act_tokens": 8,
                                "max_env_tokens": 6, "max_tokens": 96, "tags": None, "rehearse_check": None}
    cfg = {**config.DEFAULTS, "temperature": 0.7, "top_p": 0.9, "max_tokens": 40}
    assert rollout.sampling(cfg, rehearse_check=rehearse.check_rehearsal) == {
        "temperature": 0.7, "top_p": 0.9, "max_turns": cfg["max_turns"], "max_act_tokens": cfg["max_act_tokens"],
        "max_env_tokens": cfg["max_env_tokens"], "max_tokens": 40, "rehearse_check": rehearse.check_rehearsal}
    pairs = {"<act>": "price", "price": "apple", "apple": "</act>", "<env>": "3", "3": "</env>", "</env>": "<act>"}
    model = Bigram(tiny_llama(TOK, seed=2, init_range=POSITION_INIT), TOK, pairs)
    prompts = ["price apple", "not pear buy 2 milk and egg", "cost 3 fish", "buy tea"] * 3

    def one_digit(call, response, world):          # a guard that ends the rows rehearsing "33"
        return len(response) == 1
    chosen = {"temperature": 1.3, "top_p": 0.95, "max_turns": 4, "max_act_tokens": 5, "max_env_tokens": 3,
              "max_tokens": 40, "rehearse_check": one_digit}
    cases = [("rehearse", {}, [None, dict(rollout.SAMPLING), {}]),
             ("rehearse", chosen, [chosen, {**rollout.SAMPLING, **chosen}]),
             ("real", {"temperature": 1.3, "max_tokens": 24}, [{"temperature": 1.3, "max_tokens": 24}])]

    def seen(eps):
        return [[e[k] for k in ("ids", "roles", "logprobs", "calls", "responses", "cause")] for e in eps]

    def episodes(env_mode, settings):
        return seen(sample_episodes(model, TOK, prompts, env_mode, settings=settings,
                                    generator=torch.Generator().manual_seed(4)))
    moved = set()
    for env_mode, old, news in cases:
        want = old_keywords_episodes(model, prompts, env_mode, torch.Generator().manual_seed(4), **old)
        assert len({len(e["ids"]) for e in want}) > 2                      # rows of several lengths
        want = seen(want)
        for settings in news:
            assert episodes(env_mode, settings) == want, (env_mode, settings)
        full = {**rollout.SAMPLING, **old}
        for key, value in full.items():                # each setting moved a little, the others kept
            if key == "tags":
                continue                               # None: the toy's tags (the chat tests choose others)
            if key == "rehearse_check":
                other = None if value else one_digit
            elif key in ("temperature", "top_p"):
                other = value * 0.9
            else:
                other = value - 1
            if episodes(env_mode, {**full, key: other}) != want:
                moved.add(key)
    assert moved == set(rollout.SAMPLING) - {"tags"}


def test_an_unknown_setting_is_a_type_error_naming_it():
    """A key SAMPLING lacks (a misspelt limit) is refused as a bad keyword argument would be, by
    both samplers; sample_episodes has at most 9 parameters."""
    with pytest.raises(TypeError, match="max_token'"):
        sample_episodes(ScriptedModel(TOK, {"price apple": EPISODE}), TOK, ["price apple"], settings={"max_token": 40})
    with pytest.raises(TypeError, match="temprature"):
        sample_separate(ScriptedModel(TOK, {"price apple": EPISODE}), TOK, ["price apple"],
                        settings={"temprature": 0.5, "top_p": 1.0})
    assert len(inspect.signature(sample_episodes).parameters) <= 9


def test_growing_cache_keeps_every_step_across_its_growth():
    """GrowingLayer's first buffer holds 64 positions (or twice the first update); past it, the
    keys and values written so far are copied into a buffer twice as long. After any number of
    updates its keys and values must be exactly the concatenation of everything written (copies,
    no arithmetic: compared with torch.equal), also after rows are dropped and copied."""
    from machinery.kvcache import GrowingLayer
    g = torch.Generator().manual_seed(0)
    layer, keys, values, rooms = GrowingLayer(), [], [], []
    for n in (5, 1, 30, 28, 1, 100):                   # 5, 6, 36, 64 (full), 65 (growth), 165 (growth)
        k, v = torch.randn(3, 2, n, 4, generator=g), torch.randn(3, 2, n, 4, generator=g)
        keys.append(k)
        values.append(v)
        got_k, got_v = layer.update(k, v)
        assert torch.equal(got_k, torch.cat(keys, -2)) and torch.equal(got_v, torch.cat(values, -2))
        rooms.append(layer.buffers[0].shape[-2])
    assert rooms == [64, 64, 64, 64, 130, 330]          # full at 64, then twice what is needed
    index = torch.tensor([2, 0, 0])                    # drop row 1, copy row 0
    layer.batch_select_indices(index)
    k, v = torch.randn(3, 2, 200, 4, generator=g), torch.randn(3, 2, 200, 4, generator=g)
    got_k, got_v = layer.update(k, v)                  # and grow once more after the selection
    assert torch.equal(got_k, torch.cat([torch.cat(keys, -2)[index], k], -2))
    assert torch.equal(got_v, torch.cat([torch.cat(values, -2)[index], v], -2))


@pytest.mark.parametrize("split_cost", [float("inf"), 0])
def test_decoder_rows_fed_runs_of_different_lengths_match_a_plain_forward(split_cost, monkeypatch):
    """kvcache.Decoder on a RoPE model (tiny Llama), rows fed runs of different lengths per step
    (0 to 9 ids: holes in the shorter ones), two rows copied from one shared prefix, a row dropped
    midway, the cache grown past its first buffer: each row's next position is its own count of
    ids, and its logits after every step equal a plain unpadded forward over its ids. Each step
    in one forward, and (SPLIT_COST 0) every step with a run longer than one id in two: every
    row's first id, then the longer runs on a copy of their rows' cache (Decoder._step_rows).
    Mutations of the split: the hole columns of the other rows left out, the rows' positions or
    logits not taken from the second forward.
    Tolerance: fp32 (unit roundoff u = 6e-8); the cached and the plain forward sum the same
    products in another order (padded vs unpadded attention, other matmul shapes), an error of at
    most one u per accumulated term, bounded by n = layers x (width + longest row) terms each of
    size up to max|logit|: tol = n u max(1, max|logit|) (1.2e-5 here; measured 6e-8 with 1 thread,
    1.2e-7 with 2). The attention's query/key weights are scaled by 4 so that a row read at a
    wrong position (RoPE) moves the logits by about 1e-2, far above tol."""
    from machinery import kvcache
    from machinery.kvcache import Decoder
    monkeypatch.setattr(kvcache, "SPLIT_COST", split_cost)
    model = tiny_llama(TOK, seed=2)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(4.0)
            layer.self_attn.k_proj.weight.mul_(4.0)
    forwards = []
    model.register_forward_hook(lambda m, args, out: forwards.append(1))
    g = torch.Generator().manual_seed(0)
    a, b, c = (torch.randint(5, len(TOK), (n,), generator=g).tolist() for n in (5, 11, 2))
    dec = Decoder(model, [a, b, a, c], TOK.pad_token_id)           # rows 0 and 2 share one prefill
    rows, alive = [list(a), list(b), list(a), list(c)], [0, 1, 2, 3]
    runs_per_step = [[1, 7, 3, 2], [4, 1, 0, 9], [2, 2, 9, 1], [0, 3, 1, 5]] * 4
    cached = []                                                    # (row, its length, logits there)
    for step, lengths in enumerate(runs_per_step):
        if step == 6:                                              # row 1 leaves the cache
            alive = [0, 2, 3]
            dec.keep(torch.tensor([0, 2, 3]))
        runs = [torch.randint(5, len(TOK), (lengths[r],), generator=g).tolist() for r in alive]
        logits = dec.step(runs)
        for j, (r, run) in enumerate(zip(alive, runs)):
            rows[r] += run
            assert dec.pos[j].item() == len(rows[r])               # prefix + every id it was fed
            if run:
                cached.append((r, len(rows[r]), logits[j]))
    assert dec.cache.layers[0].buffers[0].shape[-2] > 64           # the cache grew past its first buffer
    split = sum(any(n > 1 for n in lengths) for lengths in runs_per_step)   # every step here
    assert len(forwards) == 1 + len(runs_per_step) + (split if split_cost == 0 else 0)
    with torch.no_grad():                                          # position t's logits: after t + 1 ids
        plain = [model(input_ids=torch.tensor([row])).logits[0] for row in rows]
    n_terms = model.config.num_hidden_layers * (model.config.hidden_size + max(map(len, rows)))
    tol = n_terms * 2 ** -24 * max(1.0, max(p.abs().max().item() for p in plain))
    worst = max((logits - plain[r][n - 1]).abs().max().item() for r, n, logits in cached)
    assert len(cached) == 56 - 10 and worst <= tol, (worst, tol)     # row 1 left 10 runs out


def test_decoder_splits_a_step_only_where_its_holes_cost_more_than_a_forward(monkeypatch):
    """Decoder.step with runs of 1, 1 and 4 ids: one forward of width 4 leaves 2 rows x 3 positions
    = 6 holes, costing 6 x N (N: the model's parameters). At SPLIT_COST = 6 N the step runs as
    one forward; at 6 N - 1 as two (every row's first id, then the long run alone); a step whose
    runs are all one id has no holes and never splits (SPLIT_COST 0). Both ways give every row's
    logits within fp32 roundoff of the other: the same products summed in another order, at most
    one unit roundoff u = 6e-8 per accumulated term, n = layers x (hidden + longest row) terms of
    size up to max|logit|."""
    from machinery import kvcache
    from machinery.kvcache import Decoder
    model = tiny_llama(TOK, seed=3)
    n = sum(p.numel() for p in model.parameters())
    forwards = []
    model.register_forward_hook(lambda m, args, out: forwards.append(1))
    prefixes, runs = [[5, 6, 7], [8, 9], [10, 11, 12, 13]], [[14], [15], [16, 17, 18, 19]]
    got = {}
    for cost, step_forwards in ((6 * n, 1), (6 * n - 1, 2)):
        monkeypatch.setattr(kvcache, "SPLIT_COST", cost)
        dec = Decoder(model, prefixes, TOK.pad_token_id)
        forwards.clear()
        got[cost] = dec.step(runs)
        assert len(forwards) == step_forwards, cost
    terms = model.config.num_hidden_layers * (model.config.hidden_size + 7)
    tol = terms * 2 ** -24 * max(1.0, got[6 * n].abs().max().item())
    assert (got[6 * n] - got[6 * n - 1]).abs().max().item() <= tol
    monkeypatch.setattr(kvcache, "SPLIT_COST", 0)
    dec = Decoder(model, prefixes, TOK.pad_token_id)
    forwards.clear()
    dec.step([[14], [15], [16]])
    assert len(forwards) == 1


def test_segments_exactly_at_their_token_limit_pass_one_more_is_cut():
    """max_env_tokens=4: a rehearsed response of exactly 4 tokens is read ('1 2 3 4' -> '1234'),
    a 5th token ends the row (env_limit) right after it; the same for the actor at
    max_act_tokens=4 ('answer 1 2 3' passes, 'answer 1 2 3 4' is act_limit at its 4)."""
    exact = "<act> price apple </act> <env> 1 2 3 4 </env> <act> answer 1 2 3 </act>"
    env_over = "<act> price milk </act> <env> 1 2 3 4 5 </env> <act> answer 1 </act>"
    act_over = "<act> answer 1 2 3 4 </act>"
    eps = run([exact, env_over, act_over], ["price apple", "price milk", "price egg"],
              max_act_tokens=4, max_env_tokens=4)
    assert [(e["cause"], e["responses"], e["answer"]) for e in eps] == [
        ("answer", ["1234"], "123"), ("env_limit", [], None), ("act_limit", [], None)]
    assert words(eps[0]["ids"]) == "<bos> price apple " + exact
    assert words(eps[1]["ids"]) == "<bos> price milk <act> price milk </act> <env> 1 2 3 4 5"
    assert eps[1]["roles"][-5:] == [R] * 5
    assert words(eps[2]["ids"]) == "<bos> price egg <act> answer 1 2 3 4"


def test_the_decoder_runs_the_lm_head_on_each_rows_last_position_only():
    """A prefill of 3 rows x up to 9 ids and a step of runs of 4: the LM head sees [3, 1, width]
    each time (a real model's vocabulary makes the other positions' logits the largest tensor of
    sampling), and the logits it returns are the full forward's at each row's last id."""
    from machinery.kvcache import Decoder
    model = tiny_llama(TOK, seed=1)
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(tuple(args[0].shape)))
    rows = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [5, 6, 7], [9, 8, 7, 6, 5]]
    dec = Decoder(model, rows, TOK.pad_token_id)
    first = dec.logits.clone()
    dec.step([[14, 15, 16, 17]] * 3)
    width = model.config.hidden_size
    assert seen == [(3, 1, width), (3, 1, width)]
    with torch.no_grad():
        for j, row in enumerate(rows):
            full = model(input_ids=torch.tensor([row + [14, 15, 16, 17]])).logits[0]
            assert torch.allclose(first[j], full[len(row) - 1], atol=1e-5)   # fp32, other sum orders: ~1e-7
            assert torch.allclose(dec.logits[j], full[-1], atol=1e-5)


def test_the_decoder_prefills_the_ids_every_prefix_starts_with_once():
    """Four prefixes (two alike) that start with the same 20 ids, then 1, 3 and 6 ids of their own:
    the 20 run once as one row, the rests as one step of right-aligned runs; each row's logits,
    then and after a further step, equal a plain forward over its ids (a RoPE model at
    POSITION_INIT: a row read one position off moves them by ~1e-1; fp32 sums in another order ~1e-7)."""
    from machinery.sharedprefix import shared_prefix_length
    from machinery.kvcache import Decoder
    model = tiny_llama(TOK, seed=3, init_range=POSITION_INIT)
    g = torch.Generator().manual_seed(1)
    shared = torch.randint(5, len(TOK), (20,), generator=g).tolist()
    rests = [torch.randint(5, len(TOK), (n,), generator=g).tolist() for n in (1, 3, 6)]
    prefixes = [shared + rests[0], shared + rests[1], shared + rests[0], shared + rests[2]]
    assert shared_prefix_length(torch.tensor([p + [0] * (26 - len(p)) for p in prefixes]), list(map(len, prefixes))) == 20
    shapes = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: shapes.append(tuple(args[0].shape)))
    dec = Decoder(model, prefixes, TOK.pad_token_id)
    assert shapes == [(1, 20), (3, 6)]                # the shared ids once; the three distinct rests
    first = dec.logits.clone()
    extra = [[7], [8, 9], [10], [11, 12, 13]]
    dec.step(extra)
    with torch.no_grad():
        for j, p in enumerate(prefixes):
            full = model(input_ids=torch.tensor([p + extra[j]])).logits[0]
            assert torch.allclose(first[j], full[len(p) - 1], atol=1e-5), j
            assert torch.allclose(dec.logits[j], full[-1], atol=1e-5), j
    assert dec.pos.tolist() == [len(p) + len(e) for p, e in zip(prefixes, extra)]


def test_world_token_is_the_world_turn_of_a_row_by_hand():
    """rehearse.world_token, one token of a row's env phase at a time (the row as rollout.new_row
    makes it, after the call `price apple` and the forced <env>): rehearse mode keeps the policy's
    tokens, reads them back at </env> (world.parse_response: "1 2" -> "12") and hands the turn back
    (True); a tag, a response the world cannot read, one token past max_env_tokens or a wrong form
    under rehearse_check end the row with their cause; real mode's forced tokens decide nothing."""
    tags = tag_ids(TOK)

    def row_after_call():
        row = new_row(encode(TOK, "buy apple"), world, phase="env")
        row["calls"].append("price apple")
        return row

    def feed(row, text, env_mode="rehearse", max_env_tokens=6, check=None):
        ids = encode(TOK, text) + [tags["env_end"]]
        return [rehearse.world_token(row, t, tags, TOK, env_mode, max_env_tokens, check) for t in ids]

    row = row_after_call()
    assert feed(row, "1 2") == [False, False, True]
    assert row["responses"] == ["12"] and row["segment"] == [] and row["phase"] == "env" and row["cause"] is None
    row = row_after_call()
    assert rehearse.world_token(row, tags["act_end"], tags, TOK, "rehearse", 6) is False
    assert (row["phase"], row["cause"]) == ("done", "bad_rehearsal")          # the world wrote a tag
    row = row_after_call()
    assert feed(row, "apple") == [False, False] and (row["cause"], row["responses"]) == ("bad_rehearsal", [])
    row = row_after_call()
    assert [rehearse.world_token(row, t, tags, TOK, "rehearse", 2) for t in encode(TOK, "1 2 3")] == [False] * 3
    assert (row["phase"], row["cause"], row["segment"]) == ("done", "env_limit", encode(TOK, "1 2"))
    row = row_after_call()
    assert feed(row, "error funds", check=rehearse.check_rehearsal)[-1] is False   # price answers a number
    assert (row["cause"], row["responses"]) == ("rehearse_check", ["error funds"])
    row = row_after_call()
    row["responses"].append("3")                                  # real mode: written whole at the call
    assert feed(row, "3", env_mode="real") == [False, True] and row["responses"] == ["3"]
