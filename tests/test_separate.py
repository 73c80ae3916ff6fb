"""rehearsal_context separate: each rehearsal in a row of its own. Roles and shifted masks of an
actor row and its rehearse rows, the copied response (context, no loss), the grounding examples
(in the rehearse prompt only), truncations, advantage groups, the warm start's and evaluation's
rows in the same format as RL's, the config check, and a short train.run."""
import functools
import json
import os
from types import SimpleNamespace

import pytest
import torch

from machinery import config
import envace
from scripts import evaluate_cli
from formats import features
from formats import format_plain
from worldmodel import honesty
import rehearse
from worldmodel import separate, toolcache
import train
import world
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, collate, loss_mask, tag_ids
from machinery.checkpoint import build_tokenizer
from helpers import (POSITION_INIT, assert_ratio_one, assert_rehearse_logprobs_match_a_forward,
                     assert_sampled_logprobs_match_a_forward,
                     Bigram, ScriptedModel, tiny_cfg, tiny_llama)
from reward import group_advantages, training_rows
from rollout import sample_episodes, sample_rows
from worldmodel.separate import _rehearse_row, sample_separate

P, A, R, O, T = PROMPT, ACT, REHEARSE, OBS, TAG
TOK = build_tokenizer(world.WORDS + separate.SEPARATE_WORDS)
# the tool cache of the grounding examples: price milk -> 2, pay 5 -> 4 (the rehearsed calls below,
# price apple and pay 3, are not in it: each gets its tool's nearest, at distance 1)
LOGGED = [("price milk", "2"), ("pay 5", "4")]
EXAMPLES = functools.partial(toolcache.examples, toolcache.build(LOGGED, toolcache.plain_call), k=1)
RH1 = "rehearse price item example <act> price milk </act> <env> 2 </env> dialogue buy apple <act> price apple </act> <env>"
RH2 = ("rehearse pay number example <act> pay 5 </act> <env> 4 </env> dialogue buy apple "
       "<act> price apple </act> <env> 3 </env> <act> pay 3 </act> <env>")
# what the scripted policy writes after each prefill: the actor row keeps its cache over
# sample_separate's rounds, so its script runs on through the copied responses; each rehearse row
# is prefilled anew
SCRIPTS = {
    "buy apple": "<act> price apple </act> <env> 3 </env> <act> pay 3 </act> <env> 6 </env> <act> answer 6 </act>",
    RH1: "3 </env>",
    RH2: "6 </env>",
}


class PrefixScripted(ScriptedModel):
    """ScriptedModel keyed by a row's whole prefix rather than its task prompt."""

    def _prompt_index(self, ids):
        words = [w for w in self.tokenizer.convert_ids_to_tokens(ids) if w not in ("<pad>", "<bos>")]
        return self.prompts.index(" ".join(words))


def words(ids):
    return " ".join(TOK.convert_ids_to_tokens(ids))


def sample(scripts, prompts, **kw):
    return sample_separate(PrefixScripted(TOK, scripts), TOK, prompts, examples=EXAMPLES, **kw)


def mask_of(row):
    return loss_mask(collate([row], TOK.pad_token_id)[1])[0].int().tolist()


def test_actor_row_and_its_rehearse_rows():
    e, = sample(SCRIPTS, ["buy apple"])
    assert e["cause"] == "answer" and e["finished"] and e["answer"] == "6"
    assert e["calls"] == ["price apple", "pay 3"] and e["responses"] == ["3", "6"]
    # the actor row: exactly the inline episode's ids, but the responses are OBS (context)
    assert words(e["ids"]) == ("<bos> buy apple <act> price apple </act> <env> 3 </env> <act> pay 3 </act> "
                               "<env> 6 </env> <act> answer 6 </act>")
    assert e["roles"] == [P, P, P, T, A, A, A, T, O, O, T, A, A, A, T, O, O, T, A, A, A]
    assert mask_of(e) == [0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert [e["logprobs"][t] for t in (7, 8, 9, 14, 15, 16)] == [0.0] * 6
    # its rehearse rows: own prompt (PROMPT), the response and </env> REHEARSE, trained
    r1, r2 = e["rehearsals"]
    assert (r1["episode"], r1["turn"], r2["episode"], r2["turn"]) == (0, 0, 0, 1)
    assert words(r1["ids"]) == "<bos> " + RH1 + " 3 </env>"
    assert r1["roles"] == [P] * 20 + [R, R] and r1["cause"] == "response" and r1["responses"] == ["3"]
    assert mask_of(r1) == [0] * 19 + [1, 1]
    assert words(r2["ids"]) == "<bos> " + RH2 + " 6 </env>" and r2["roles"][-3:] == [P, R, R]
    # the copied response is the rehearse row's sampled ids, and the actor never sees the prompt
    assert e["ids"][8:10] == r1["ids"][-2:] and e["ids"][15:17] == r2["ids"][-2:]
    for word in separate.SEPARATE_WORDS + ["milk", "item"]:
        assert word not in words(e["ids"]).split()


def test_grounding_examples_come_from_the_tool_cache():
    """The cache's pairs of the called tool, an exact match first (toolcache.examples; tests/test_toolcache.py)."""
    assert EXAMPLES("price apple") == [("price milk", "2")] and EXAMPLES("pay 3") == [("pay 5", "4")]
    assert EXAMPLES("price milk") == [("price milk", "2")] and EXAMPLES("mul 2 , 3") == []
    cache = toolcache.build(LOGGED + [("price apple", "3"), ("price egg", "1")], toolcache.plain_call)
    assert toolcache.examples(cache, "price apple", 2) == [("price apple", "3"), ("price milk", "2")]
    assert toolcache.examples(cache, "price apple", 0) == []
    # examples sit in the rehearse prompt only: the rows of a run without them lack them
    bare = {k.replace(" example <act> price milk </act> <env> 2 </env>", "")
             .replace(" example <act> pay 5 </act> <env> 4 </env>", ""): v for k, v in SCRIPTS.items()}
    e, = sample_separate(PrefixScripted(TOK, bare), TOK, ["buy apple"])
    assert e["cause"] == "answer" and words(e["rehearsals"][0]["ids"]).startswith(
        "<bos> rehearse price item dialogue buy apple <act>")


def test_truncations_end_the_episode_with_their_cause():
    base = "buy apple <act> price apple </act> <env>"
    cases = {  # prompt: (script after the actor's first call, expected cause)
        "buy apple": ("3 3 3 3 3 3 3 3 3 3 3", "env_limit"),          # a rehearsal that never ends
        "buy milk": ("apple </env>", "bad_rehearsal"),                # not a response
        "buy egg": ("3 <act>", "bad_rehearsal"),                      # the rehearser writes a tag
    }
    scripts = {}
    for prompt, (rehearsal, _) in cases.items():
        item = prompt.split()[1]
        scripts[prompt] = f"<act> price {item} </act>"
        scripts[f"rehearse price item example <act> price milk </act> <env> 2 </env> "   # the cache's one price
                f"dialogue {base.replace('apple', item)}"] = rehearsal
    eps = sample(scripts, list(cases), settings={"max_env_tokens": 6})
    assert [e["cause"] for e in eps] == [c for _, c in cases.values()]
    assert not any(e["finished"] for e in eps)
    assert all(len(e["rehearsals"]) == 1 and e["responses"] == [] for e in eps)
    # the token limit: the copied response does not fit; the row is cut at max_tokens exactly
    long, = sample(SCRIPTS, ["buy apple"], settings={"max_tokens": 9})
    assert long["cause"] == "token_limit" and len(long["ids"]) == 9 and long["responses"] == []
    fits, = sample(SCRIPTS, ["buy apple"], settings={"max_tokens": 10})
    assert fits["cause"] == "token_limit" and fits["responses"] == ["3"]
    turn, = sample(SCRIPTS, ["buy apple"], settings={"max_turns": 1})
    assert turn["cause"] == "turn_limit" and len(turn["rehearsals"]) == 1


def test_frozen_simulator_writes_the_rehearse_rows_as_obs():
    actor = {k: v for k, v in SCRIPTS.items() if not k.startswith("rehearse")}
    simulator = {RH1: "3 </env>", RH2: "6 </env>"}
    e, = sample_separate(PrefixScripted(TOK, actor), TOK, ["buy apple"], "frozen", examples=EXAMPLES,
                         env_model=PrefixScripted(TOK, simulator))
    assert e["cause"] == "answer" and e["responses"] == ["3", "6"]
    assert [r["roles"][-2:] for r in e["rehearsals"]] == [[O, O], [O, O]]
    assert all(set(r["logprobs"]) == {0.0} for r in e["rehearsals"])


def test_rehearse_rows_logprobs_equal_a_teacher_forced_forward():
    """Rehearse rows of different prompt lengths, sampled together by the KV-cached sampler
    (left-padded prefixes): every sampled logprob equals a full forward over the finished row."""
    model = tiny_llama(TOK, seed=2, init_range=POSITION_INIT)
    actors = []
    for prompt, calls in (("buy apple", ["price apple"]), ("not pear buy 2 milk and egg", ["price milk"]),
                          ("cost 3 fish", ["price fish", "mul 3 , 9"])):
        e = envace.encode_episode(TOK, prompt, calls[:-1], world.replay(calls)[:-1])
        e["ids"] += TOK.convert_tokens_to_ids(["<act>"] + calls[-1].split() + ["</act>"])
        actors.append({**e, "calls": calls, "episode": len(actors)})
    tags = tag_ids(TOK)
    rows = [_rehearse_row(a, tags, TOK, EXAMPLES, world) for a in actors for _ in range(3)]
    assert len({len(r["ids"]) for r in rows}) == 3
    limits = {"max_turns": 6, "max_act_tokens": 8, "max_env_tokens": 6, "max_tokens": max(len(r["ids"]) for r in rows) + 8,
              "rehearse_check": None}
    sample_rows(model, TOK, rows, "rehearse", None, tags, limits, 1.0, 1.0, torch.Generator().manual_seed(0))
    assert_rehearse_logprobs_match_a_forward(model, rows, TOK.pad_token_id)


def test_actor_rows_keep_their_cache_across_rounds():
    """The actor rows are prefilled once: a row waiting for its response keeps its cache (taken out
    of its slot and put back) and is fed only the ids appended since (the copied response and the
    hand-off), in one forward. Every sampled logprob of the
    actor rows and of the rehearse rows still equals a full teacher-forced forward over the row."""
    model = Bigram(tiny_llama(TOK, seed=4, init_range=POSITION_INIT), TOK,
                   {"<act>": "price", "price": "apple", "apple": "</act>", "<env>": "3", "3": "</env>"}, bonus=12.0)
    calls = []
    model.register_forward_pre_hook(lambda m, args, kw: calls.append(
        (kw["cache"].get_seq_length() if kw.get("cache") is not None else None, kw["input_ids"].shape)),
        with_kwargs=True)
    prompts = ["buy apple", "buy apple", "not pear buy 2 milk and egg", "cost 3 fish"]
    eps = sample_separate(model, TOK, prompts, settings={"max_turns": 2, "max_tokens": 60},
                          generator=torch.Generator().manual_seed(1))
    assert [e["cause"] for e in eps] == ["turn_limit"] * 4 and [len(e["rehearsals"]) for e in eps] == [2] * 4
    assert all(e["responses"] == ["3", "3"] for e in eps) and not any("saved_kv" in e for e in eps)
    prefills = [shape for seen, shape in calls if seen == 0]
    # the 4 actor rows once (prompts shorter than kvcache.PLAIN_BELOW: the plain decoder, a row
    # each), then per call the 4 rehearse rows (the two "buy apple" rows ask the same: Decoder
    # prefills it once), never the actor rows again (7 prefills when every round re-prefilled them)
    assert [p[0] for p in prefills] == [4, 3, 3]
    # each resumption feeds the actors, in one forward, only the ids not in their cache: the
    # copied <env> 3 </env> and the forced <act> (the call's </act> went in before they waited)
    assert sum(1 for seen, shape in calls if seen and tuple(shape) == (4, 4)) == 2
    sampled = [(i, t) for i, e in enumerate(eps) for t in range(1, len(e["ids"])) if e["roles"][t] == A]
    assert len(sampled) >= 4 * 9
    assert assert_sampled_logprobs_match_a_forward(model, eps, TOK.pad_token_id) == len(sampled)
    assert_rehearse_logprobs_match_a_forward(model, [r for e in eps for r in e["rehearsals"]], TOK.pad_token_id)


def test_rows_that_call_at_different_steps_match_a_full_forward():
    """Actor rows that reach their calls at different steps (two calls planned, so forced at once;
    two sampled): each round's rehearse rows and the resumed actor rows (kept caches fed the copied
    response with the call's stop) still give every sampled logprob of a full teacher-forced
    forward over the finished rows; frozen: the actor rows' logprobs are the policy's own."""
    pairs = {"<act>": "price", "price": "apple", "apple": "</act>", "<env>": "3", "3": "</env>"}
    model = Bigram(tiny_llama(TOK, seed=4, init_range=POSITION_INIT), TOK, pairs, bonus=12.0)
    feeds = []
    model.register_forward_pre_hook(lambda m, args, kw: feeds.append(
        [" ".join(w for w in TOK.convert_ids_to_tokens(r) if w != "<pad>") for r in kw["input_ids"].tolist()]),
        with_kwargs=True)
    prompts = ["buy apple", "buy apple", "not pear buy 2 milk and egg", "cost 3 fish"]
    plans = [[("mul 2 , 4", "8")], None, None, [("pay 3", "6")]]     # planned calls: forced at once
    eps = sample_separate(model, TOK, prompts, settings={"max_turns": 2, "max_tokens": 60}, plans=plans,
                          generator=torch.Generator().manual_seed(1))
    assert [e["calls"] for e in eps] == [["mul 2 , 4", "price apple"], ["price apple"] * 2, ["price apple"] * 2,
                                         ["pay 3", "price apple"]]
    assert all(e["responses"] == ["3", "3"] and e["cause"] == "turn_limit" for e in eps)
    assert feeds[:2] == [["<bos> buy apple", "<bos> buy apple", "<bos> not pear buy 2 milk and egg",
                          "<bos> cost 3 fish"],      # the plain decoder: a row each (kvcache.PLAIN_BELOW)
                         ["<act>", "<act>"]]         # rows 0 and 3 paused at their planned calls at once
    # the first round's rehearse rows, then the actor rows resumed from their caches in one forward
    assert feeds[4][0].startswith("<bos> rehearse mul number , number dialogue buy apple <act> mul 2 , 4 </act>")
    assert feeds[6] == ["<act> mul 2 , 4 </act> <env> 3 </env>", "</act> <env> 3 </env>", "</act> <env> 3 </env>",
                        "<act> pay 3 </act> <env> 3 </env>"]
    assert sum(1 for f in feeds if f[0].startswith("<bos> buy apple")) == 1     # no actor prefilled twice
    acted = [(i, t) for i, e in enumerate(eps) for t in range(1, len(e["ids"])) if e["roles"][t] == A]
    sampled = [(i, t) for i, t in acted if eps[i]["logprobs"][t] != 0.0]
    # 3 acts of "price apple </act>" per row, less the planned first calls, forced (logprob 0)
    assert len(acted) == 4 * 9 - 2 * 3 + len("mul 2 , 4 </act>".split()) + len("pay 3 </act>".split())
    assert len(sampled) == 4 * 9 - 2 * 3
    assert assert_sampled_logprobs_match_a_forward(model, eps, TOK.pad_token_id) == len(sampled)
    assert_rehearse_logprobs_match_a_forward(model, [r for e in eps for r in e["rehearsals"]], TOK.pad_token_id)
    # frozen: a simulator that writes 7; the actor rows' logprobs are still the policy's own
    simulator = Bigram(tiny_llama(TOK, seed=5), TOK, {"<env>": "7", "7": "</env>"})
    eps = sample_separate(model, TOK, prompts, "frozen", env_model=simulator, settings={"max_turns": 2, "max_tokens": 60},
                          plans=plans, generator=torch.Generator().manual_seed(1))
    assert all(e["responses"] == ["7", "7"] and e["cause"] == "turn_limit" for e in eps)
    assert all(r["roles"][-2:] == [O, O] and set(r["logprobs"]) == {0.0} for e in eps for r in e["rehearsals"])
    sampled = [(i, t) for i, e in enumerate(eps) for t in range(1, len(e["ids"])) if e["logprobs"][t] != 0.0]
    assert len(sampled) == 4 * 9 - 2 * 3 and all(eps[i]["roles"][t] == A for i, t in sampled)
    assert assert_sampled_logprobs_match_a_forward(model, eps, TOK.pad_token_id) == len(sampled)


def test_advantage_groups_task_role_and_task():
    """Task 0, G = 2: episode a (reward 1, two rehearse rows), b (reward 0, one); task 1: c, d
    both 1 with one rehearse row each (all-equal). Rows: a, a.r1, a.r2, b, b.r1, c, c.r1, d, d.r1."""
    eps = [{"rehearsals": [{}, {}]}, {"rehearsals": [{}]}, {"rehearsals": [{}]}, {"rehearsals": [{}]}]
    rows, rewards, groups = training_rows(eps, [1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], "task_role")
    assert rows[0] is eps[0] and rows[1] is eps[0]["rehearsals"][0] and len(rows) == 9
    assert rewards == [1, 1, 1, 0, 0, 1, 1, 1, 1]
    assert groups == [0, 1, 1, 0, 1, 2, 3, 2, 3]
    adv, all_equal = group_advantages(rewards, groups)
    assert adv.tolist() == pytest.approx([1 / 2, 1 / 3, 1 / 3, -1 / 2, -2 / 3, 0, 0, 0, 0])
    assert all_equal == 2                                     # task 1's act and rehearse groups
    rows, rewards, groups = training_rows(eps, [1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], "task")
    adv, all_equal = group_advantages(rewards, groups)
    assert adv.tolist() == pytest.approx([2 / 5, 2 / 5, 2 / 5, -3 / 5, -3 / 5, 0, 0, 0, 0])
    assert all_equal == 1
    # inline rehearsal: one row per episode with both roles: the two groupings are the same
    inline = [{}, {}, {}, {}]
    for how in ("task_role", "task"):
        rows, rewards, groups = training_rows(inline, [1.0, 0.0, 1.0, 1.0], [0, 0, 1, 1], how)
        assert rows == inline and group_advantages(rewards, groups)[0].tolist() == [0.5, -0.5, 0, 0]


def test_batch_of_separate_rows_advantage_per_row_and_global_token_count():
    e, = sample(SCRIPTS, ["buy apple"])
    other, = sample({**SCRIPTS, "buy apple": "<act> answer 9 </act>"}, ["buy apple"])   # no calls
    rows, rewards, groups = training_rows([e, other], [1.0, 0.0], [0, 0], "task_role")
    assert len(rows) == 4 and groups == [0, 1, 1, 0]
    # make_batch splits the two episodes (one group of 2) into these rows itself (reward.training_rows)
    batch = train.make_batch([e, other], [1.0, 0.0], {**config.DEFAULTS, "group_size": 2}, TOK.pad_token_id)
    # 9 ACT targets + 2 + 2 REHEARSE targets in e's rows, 3 ACT targets in the other episode
    assert batch["n_tokens"] == 9 + 2 + 2 + 3
    adv, mask = batch["advantages"], batch["mask"]
    assert adv[0][mask[0]].tolist() == [0.5] * 9                    # act group: mean 1/2
    assert adv[1][mask[1]].tolist() == [0.0] * 2                    # rehearse group: all 1, mean 1
    assert adv[3][mask[3]].tolist() == [-0.5] * 3
    assert not mask[0][7] and not mask[0][8] and adv[0][7:9].abs().sum() == 0   # the copy: no loss


def test_warm_start_rows_are_the_rows_rl_samples():
    e, = sample(SCRIPTS, ["buy apple"])
    splits = {"logged": [{"prompt": "buy apple", "calls": ["price apple", "pay 3"], "responses": ["3", "6"],
                          "answer": "6"}]}
    cfg = {**config.DEFAULTS, "rehearsal_context": "separate", "snippet_repeats": 0}
    logged = [(t, t["responses"]) for t in splits["logged"]]

    def snippets_of(cfg):
        return world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"], cfg["coverage"])
    (group,) = separate.warm_start_sequences(TOK, logged, snippets_of(cfg), EXAMPLES)
    actor, r1, r2 = group["rows"]
    assert actor["ids"] == e["ids"] and actor["roles"] == e["roles"]
    assert r1["ids"] == e["rehearsals"][0]["ids"] and r1["roles"] == e["rehearsals"][0]["roles"]
    assert r2["ids"] == e["rehearsals"][1]["ids"] and r2["roles"] == e["rehearsals"][1]["roles"]
    for layout_cfg, roles in ((cfg, (ACT, REHEARSE)), (config.DEFAULTS, (ACT, REHEARSE, OBS))):   # separate: actor OBS is context
        fmt, setting = features.setup(layout_cfg, TOK, splits)
        assert fmt.warm_start_roles(setting) == roles
    # tool traffic: a group of rehearse rows per snippet, one per call
    cfg["snippet_repeats"] = 1
    groups = separate.warm_start_sequences(TOK, logged, snippets_of(cfg), EXAMPLES)[1:]
    snippets = world.tool_snippets(0, 1)
    assert len(groups) == len(snippets)
    for g, snippet in zip(groups, snippets):
        assert [r["call"] for r in g["rows"]] == snippet["calls"]
        assert all(r["roles"][-1] == REHEARSE and ACT not in r["roles"] for r in g["rows"])


def test_warm_start_draws_a_group_of_rows_as_one_sequence(monkeypatch):
    """Groups of 2 rows and 1 row and a plain row, sft_batch_size 2: each step collates the rows
    of two of the three (3 rows when the 2-row group is drawn, else 2)."""
    two_rows = [{"ids": [0, 7, 30], "roles": [P, A, A]}, {"ids": [0, 7], "roles": [P, R]}]
    seqs = [{"rows": two_rows}, {"rows": two_rows[:1]}, two_rows[1]]
    seen = []

    def spy(batch, pad_id):
        seen.append(len(batch))
        return collate(batch, pad_id)
    monkeypatch.setattr(train, "collate", spy)
    model = tiny_llama(TOK)
    cfg = {**config.DEFAULTS, "sft_steps": 6, "sft_batch_size": 2, "rehearsal_context": "separate"}
    train.warm_start(model, model, seqs, cfg, TOK.pad_token_id, roles=(ACT, REHEARSE))
    assert len(seen) == 6 and set(seen) == {2, 3}


class SeparateOracle(torch.nn.Module):
    """A fake LM whose argmax is the true next token in a separate rehearse row (its token 1 is
    'rehearse') and one too high on digits anywhere else: a world model that knows the dynamics
    only when asked in the separate context."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.digits = torch.tensor(TOK.convert_tokens_to_ids([str(d) for d in range(10)]))
        self.tag = TOK.convert_tokens_to_ids("rehearse")

    def forward(self, input_ids, **kw):
        target = torch.roll(input_ids, -1, dims=1)
        wrong = torch.where(torch.isin(target, self.digits[:-1]), target + 1, target)
        target = torch.where((input_ids[:, 1:2] == self.tag), target, wrong)
        return SimpleNamespace(logits=torch.nn.functional.one_hot(target, len(TOK)).float())


def test_would_rehearse_asks_in_the_separate_context():
    script = ("<act> price apple </act> <env> x x <act> pay 3 </act> <env> x x "
              "<act> pay 7 </act> <env> x x x <act> answer 6 </act>")
    real, = sample_episodes(ScriptedModel(TOK, {"buy apple": script}), TOK, ["buy apple"], "real")
    assert real["responses"] == ["3", "6", "error funds"]
    pairs = separate.would_rehearse_separate(SeparateOracle(), TOK, [real], EXAMPLES)
    assert pairs == [("price apple", True), ("pay 3", True), ("pay 7", True)]
    inline = honesty.would_rehearse_calls(SeparateOracle(), TOK, [real])
    assert inline == [("price apple", False), ("pay 3", False), ("pay 7", True)]
    rows = separate.rehearsal_rows(TOK, real, EXAMPLES)
    assert words(rows[1]["ids"]) == "<bos> " + RH2 + " 6 </env>"


def test_private_rehearsal_imagines_in_separate_rows():
    plans, used = rehearse.private_rehearsal_plans(PrefixScripted(TOK, SCRIPTS), TOK, ["buy apple"], 2,
                                                   sample=functools.partial(sample_separate, examples=EXAMPLES))
    assert plans == [[("price apple", "3"), ("pay 3", "6")]] and used == [2]


def test_grounding_needs_separate_context(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("grounding_examples: 2\n")
    with pytest.raises(config.ConfigError, match="grounding_examples .2. needs rehearsal_context: separate"):
        config.load_config(str(path))
    assert config.load_config(str(path), ["--rehearsal_context=separate"])["grounding_examples"] == 2
    assert train.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "grounding_examples" in err[0]
    with pytest.raises(config.ConfigError, match="advantage_groups"):
        config.load_config(str(path), ["--rehearsal_context=separate", "--advantage_groups=role"])
    # a toy model whose vocabulary lacks the rehearse prompt's words: one clear line
    with pytest.raises(config.ConfigError, match="lacks the rehearse prompt's words"):
        separate.check_vocabulary({**config.DEFAULTS, "rehearsal_context": "separate"},
                                  build_tokenizer(world.WORDS))


def test_train_run_with_separate_rows(tmp_path, monkeypatch):
    # a short warm start answers little right: reward by episode length parity, so that groups vary
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    cfg = tiny_cfg(tmp_path, rehearsal_context="separate", grounding_examples=2, rl_steps=2,
                   sft_steps=60, sft_batch_size=32, sft_lr=1e-2, tasks_per_step=4, group_size=4)
    asked = []                        # evaluation asks would-rehearse in separate rows

    def would_rehearse_separate(model, tokenizer, episodes, examples, world=world):
        asked.append((len(episodes), examples("price apple")))
        return []
    monkeypatch.setattr(separate, "would_rehearse_separate", would_rehearse_separate)   # format_plain_separate calls it
    assert train.run(cfg) == 0
    # the grounding examples, from the tool cache of the logged data then the snippets: price apple
    # itself (an exact match: the snippets cover every item), then the first other price call
    # logged (every price call is at distance 1: the first seen comes first)
    logged = world.make_splits(0, 40, 2, 40, 16)["logged"]
    prices = list(dict.fromkeys(c for t in logged for c in t["calls"] if c.startswith("price")))
    other = next(c for c in prices if c != "price apple")
    want = [("price apple", str(world.PRICES["apple"])), (other, str(world.PRICES[other.split()[1]]))]
    assert asked == [(16, want)] * 4        # before and after RL: its episodes, the expert's (coverage)
    out = cfg["out_dir"]
    lines = [json.loads(text) for text in open(os.path.join(out, "metrics.jsonl"))]
    assert [line["step"] for line in lines] == [1, 2]
    assert len(assert_ratio_one(lines)) == 2    # both steps updated, at ratio 1
    for line in lines:
        # each rehearse row trains at least one token; the actor rows hold copies of responses (OBS)
        assert 0 < line["rehearse_rows"] <= line["tokens_rehearse"] and 0 < line["tokens_obs"] <= line["tokens_rehearse"]
    result = json.load(open(os.path.join(out, "eval.json")))
    assert result["n_tasks"] == 16
    os.remove(os.path.join(out, "eval.json"))
    assert evaluate_cli.main(["--ckpt", out, "--n_test=8"]) == 0


def test_the_imagined_world_at_evaluation_rehearses_in_separate_rows():
    """honesty.imagined_world (collusion at evaluation) samples the way the model was trained: in
    separate rows with the grounding examples (the scripted model only knows those prefixes)."""
    task = {"prompt": "buy apple", "answer": "6", "family": "buy1", "calls": ["price apple", "pay 3"]}
    cfg = {**config.DEFAULTS, "rehearsal_context": "separate", "max_tokens": 96}
    m = honesty.imagined_world(PrefixScripted(TOK, SCRIPTS), TOK, [task], cfg,
                                sample=functools.partial(sample_separate, examples=EXAMPLES))
    assert m["imagined_success"] == 1.0 and m["imagined_fidelity_counts"] == {"lookup": [1, 1], "stateful": [1, 1]}
    assert m["collusion"]["calls"] == 2 and m["collusion"]["wrong"] == 0
