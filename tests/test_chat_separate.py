"""rehearsal_context separate with format chat: each rehearsal a row of its own, prompted in the
model's chat template (chat_separate.rehearse_prompt_ids). Roles and shifted masks of a chat actor row and
its rehearse rows, the result copied into the actor row as the template's tool response (OBS),
examples limited by grounding_examples, warm-start rows equal to the sampler's, would-rehearse
asked in the separate rows, and train.py / evaluate.py end to end on a tiny random Qwen2."""
import contextlib
import functools
import itertools
import json
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import Qwen2Config

from chat import format as chat
from chat import chat_reward
from worldmodel import chat_separate
from chat import setup as chat_setup
from chat import tasks as chat_tasks
from machinery import config, distributed, sharedprefix
from reporting import metrics
import envace
import evaluate
from scripts import evaluate_cli
from formats import features
from worldmodel import honesty
import reward
from worldmodel import separate, toolcache
import train
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, collate, loss_mask
from helpers import (POSITION_INIT, assert_ratio_one, assert_rehearse_logprobs_match_a_forward, assert_same_gradients,
                     chat_tokenizer, scripted_rows, tiny_qwen)
from rollout import sample_episodes, sample_rows
from worldmodel.separate import _chat_rehearse_row, sample_separate

chat_separate_warm_start = chat_separate.separate_warm_start_sequences
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOK = chat_tokenizer()
TAGS = chat.chat_format(TOK)
P, A, R, O, T = PROMPT, ACT, REHEARSE, OBS, TAG
PAY = {"type": "function", "function": {"name": "pay", "parameters": {
    "type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}}}
CALLS = [{"name": "pay", "arguments": {"amount": 3}}, {"name": "pay", "arguments": {"amount": 2}}]
SYSTEM_WORDS = "You play the tool 'pay', not the assistant."


def pay_task():
    """pay 3 (wallet 9 -> 6), pay 2 (-> 4), answer 4; two reference examples of pay."""
    return {"messages": [{"role": "user", "content": "pay 3 then 2"}], "tools": [PAY], "answer": "4",
            "gold_calls": CALLS, "env": "toy",
            "examples": [({"name": "pay", "arguments": {"amount": 1}}, "8"),
                         ({"name": "pay", "arguments": {"amount": 5}}, "4")]}


class PrefixScript(torch.nn.Module):
    """A fake causal LM keyed by a row's whole prefix: {prefix ids: continuation ids}. At the k-th
    position after its prefill a row gets all probability on continuation[k] (forced positions are
    the sampler's business). An actor row keeps its cache across sample_separate's rounds (its
    count of ids fed goes on); a rehearse row is prefilled anew. The row's identity is written into
    the KV cache, so it follows the sampler's cache copies and drops."""

    def __init__(self, scripts):
        super().__init__()
        self.config = Qwen2Config(vocab_size=len(TOK), hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.keys, self.scripts = list(scripts), list(scripts.values())

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        B, T = input_ids.shape
        real = attention_mask[:, -T:].bool()
        who, k = scripted_rows(input_ids, attention_mask, cache,
                               lambda b: self.keys.index(tuple(input_ids[b][real[b]].tolist())))
        logits = torch.full((B, T, len(TOK)), -1e4)
        for b, i in enumerate(who):
            logits[b, -1, self.scripts[i][min(k[b], len(self.scripts[i]) - 1)]] = 0.0
        return SimpleNamespace(logits=logits)


def scripts_for(task, k, responses=("6", "4"), answer="4"):
    """What the policy writes after each prefix of the episode CALLS -> responses -> answer."""
    prompt = chat.prompt_ids(TOK, task["messages"], task["tools"])
    actor = chat.assemble(TOK, TAGS, prompt, CALLS, list(responses), answer)["ids"]
    ends = [t + 1 for t, i in enumerate(actor) if i == TAGS["env_end"]]     # after each response
    scripts = {tuple(prompt): actor[len(prompt):]}
    for end in ends:
        scripts[tuple(actor[:end])] = actor[end:]
    for row in chat_separate.rehearse_rows(TOK, TAGS, task, CALLS, list(responses), k, own_examples=True):
        n = row["roles"].index(REHEARSE)
        scripts[tuple(row["ids"][:n])] = row["ids"][n:]
    return scripts


def rl_prompt(k):
    """RL's rehearse prompt: k grounding examples, the task's own first (no tool cache here)."""
    return functools.partial(chat_separate.separate_prompt, TOK, k, own_examples=True)


def sample(task, k=1, n=1, **kw):
    prompts, worlds = chat_setup.episode_inputs(TOK, TAGS, [task] * n)
    settings = {"tags": TAGS, "max_act_tokens": 40, "max_env_tokens": 8, "max_tokens": 300, **kw}
    return sample_separate(PrefixScript(scripts_for(task, k)), TOK, prompts, world=worlds,
                           rehearse_prompt=rl_prompt(k), settings=settings)


def mask_string(row):
    return "".join(str(int(m)) for m in loss_mask(collate([row], TOK.pad_token_id)[1])[0].tolist())


def runs(roles):
    out = []
    for r in roles:
        if out and out[-1][0] == r:
            out[-1][1] += 1
        else:
            out.append([r, 1])
    return [tuple(x) for x in out]


def text(ids):
    return TOK.decode(ids)


def test_chat_actor_row_and_its_rehearse_rows():
    """Actor row: n prompt tokens (the template's rendering of the user turn and the tool: 79 with
    the fixture's BPE) | <|im_start|> assistant Ċ (T) | the pay 3 call, 19 tokens + <|im_end|> (A) |
    Ċ <|im_start|> user Ċ <tool_response> Ċ (T) | 6 Ċ </tool_response> (O) | <|im_end|> Ċ <|im_start|>
    assistant Ċ (T) | pay 2, 20 (A) | 6 T | 4 Ċ </tool_response> (O) | 5 T | 4 <|im_end|> (A).
    Rehearse row 1: its prompt, then 6 <|im_end|> (R); row 2: its prompt (the dialogue holds the
    first call and its result), then 4 <|im_end|> (R)."""
    e, = sample(pay_task())
    assert e["cause"] == "answer" and e["answer"] == "4" and e["responses"] == ["6", "4"]
    assert e["calls"] == [json.dumps(c) for c in CALLS]
    prompt = TOK.encode(TOK.apply_chat_template(pay_task()["messages"], tools=[PAY], tokenize=False),
                        add_special_tokens=False)
    n = len(prompt)
    assert e["ids"][:n] == prompt
    assert runs(e["roles"]) == [(P, n), (T, 3), (A, 20), (T, 6), (O, 3), (T, 5), (A, 20), (T, 6), (O, 3),
                                (T, 5), (A, 2)]
    # target t is trained iff token t+1 is ACT or REHEARSE: the copied responses never are
    assert mask_string(e) == "0" * (n - 1) + "000" + "1" * 20 + "0" * 6 + "000" + "00000" + "1" * 20 + "0" * 6 + \
        "000" + "00000" + "11"
    # the actor row is the template's own rendering of the conversation, tool turns included
    messages = pay_task()["messages"]
    for call, result in zip(CALLS, ["6", "4"]):
        messages = messages + [{"role": "assistant", "content": "", "tool_calls": [{"function": call}]},
                               {"role": "tool", "content": result}]
    messages.append({"role": "assistant", "content": "4"})
    assert e["ids"] + TAGS["end"] == chat.prompt_ids(TOK, messages, [PAY])
    r1, r2 = e["rehearsals"]
    assert (r1["turn"], r2["turn"], r1["cause"], r1["responses"]) == (0, 1, "response", ["6"])
    for r in (r1, r2):                          # its prompt, then the result and the stop
        assert r["roles"] == [P] * (len(r["ids"]) - 2) + [R, R] and mask_string(r) == "0" * (len(r["ids"]) - 3) + "11"
    assert TOK.convert_ids_to_tokens(r1["ids"][-5:]) == ["<|im_start|>", "assistant", "Ċ", "6", "<|im_end|>"]
    assert TOK.convert_ids_to_tokens(r2["ids"][-2:]) == ["4", "<|im_end|>"]
    # the rehearse prompt: system (tool, schema, 1 example), user (dialogue, call); never in the actor row
    assert text(r1["ids"]).startswith("<|im_start|>system\n" + SYSTEM_WORDS)
    assert '\nExamples:\n{"arguments": {"amount": 1}, "result": "8"}<|im_end|>' in text(r1["ids"])
    assert ('{"role": "user", "content": "pay 3 then 2"}\n{"call": {"name": "pay", "arguments": {"amount": 3}}, '
            '"result": "6"}\nThe call:\n{"name": "pay", "arguments": {"amount": 2}}<|im_end|>\n'
            '<|im_start|>assistant\n4<|im_end|>') in text(r2["ids"])
    for word in (SYSTEM_WORDS, "Examples", "The dialogue so far", "The call"):
        assert word not in text(e["ids"])
    # the rehearsed result sits in the actor row as OBS only, as a tool response, no logprob
    for r, at in ((r1, n + 29), (r2, n + 63)):  # n + 3 + 20 + 6; + 3 + 5 + 20 + 6
        assert TOK.convert_ids_to_tokens(e["ids"][at:at + 3]) == [r["responses"][0], "Ċ", "</tool_response>"]
        assert e["roles"][at:at + 3] == [O] * 3 and e["logprobs"][at:at + 3] == [0.0] * 3
        assert text(e["ids"][at - 6:at]) == "\n<|im_start|>user\n<tool_response>\n"


def test_examples_are_limited_by_grounding_examples():
    task = pay_task()
    world = chat.task_world(task, TAGS)
    actor = {"calls": [json.dumps(CALLS[0])], "responses": []}
    shown = {k: text(rl_prompt(k)(actor, world)) for k in (0, 1, 2, 5)}
    assert "Examples" not in shown[0]
    # evaluation's prompt never reads the task's own examples: with no tool cache, none
    assert "Examples" not in text(chat_separate.separate_prompt(TOK, 2, actor, world))
    assert shown[1].count('"result": ') == 1 and '{"arguments": {"amount": 1}, "result": "8"}' in shown[1]
    assert shown[2].count('"result": ') == 2 and '{"arguments": {"amount": 5}, "result": "4"}' in shown[2]
    assert shown[5] == shown[2]                                 # the task has two
    mul = {"name": "mul", "arguments": {"a": 2, "b": 3}}
    assert chat_separate.task_examples({**task, "examples": task["examples"] + [(mul, "6")]}, "mul", 3) == [(mul, "6")]
    # sampled with k = 2, both examples are in each rehearse row
    e, = sample(task, k=2)
    assert e["cause"] == "answer" and all(text(r["ids"]).count('"result": ') >= 2 for r in e["rehearsals"])


def test_bad_rehearsal_and_frozen_simulator():
    task = pay_task()
    prompts, worlds = chat_setup.episode_inputs(TOK, TAGS, [task])
    scripts = scripts_for(task, 0)
    first = next(key for key, v in scripts.items() if TOK.convert_ids_to_tokens(v) == ["6", "<|im_end|>"])
    bad = {**scripts, first: chat.encode(TOK, "<tool_call>") + [TAGS["act_end"]]}     # writes a call back
    e, = sample_separate(PrefixScript(bad), TOK, prompts, world=worlds,
                         settings={"tags": TAGS, "max_act_tokens": 40, "max_env_tokens": 8, "max_tokens": 300})
    assert e["cause"] == "bad_rehearsal" and e["responses"] == [] and len(e["rehearsals"]) == 1
    e, = sample_separate(PrefixScript(scripts), TOK, prompts, "frozen", env_model=PrefixScript(scripts), world=worlds,
                         settings={"tags": TAGS, "max_act_tokens": 40, "max_env_tokens": 8, "max_tokens": 300})
    assert e["cause"] == "answer" and [r["roles"][-2:] for r in e["rehearsals"]] == [[O, O], [O, O]]


def test_warm_start_rows_are_the_rows_rl_samples():
    e, = sample(pay_task(), k=1)
    task = pay_task()
    logged = {"messages": task["messages"], "tools": task["tools"], "call_dicts": CALLS,
              "calls": [json.dumps(c) for c in CALLS],      # as chat_tasks.check_task writes a logged line
              "responses": ["6", "4"], "answer": "4", "examples": task["examples"]}
    cfg = {**config.DEFAULTS, "format": "chat", "rehearsal_context": "separate", "grounding_examples": 1,
           "max_tokens": 300}
    fmt, setting = features.setup(cfg, TOK, {"logged": [logged], "rl": [task], "test": [task]})
    groups = fmt.warm_start_sequences(setting)
    (actor, w1, w2), examples = groups[0]["rows"], groups[1]["rows"]
    assert actor["ids"] == e["ids"] and actor["roles"] == e["roles"]
    for w, r in ((w1, e["rehearsals"][0]), (w2, e["rehearsals"][1])):
        assert w["ids"] == r["ids"] and w["roles"] == r["roles"]
    assert fmt.warm_start_roles(setting) == (ACT, REHEARSE)        # the actor row's OBS: context only
    # the task's examples: a rehearse row each (empty dialogue, the example's call and result)
    assert [x["call"] for x in examples] == [json.dumps(c) for c, _ in task["examples"]]
    assert TOK.convert_ids_to_tokens(examples[0]["ids"][-2:]) == ["8", "<|im_end|>"]
    assert all(ACT not in x["roles"] and x["roles"][-2:] == [R, R] for x in examples)
    # logged lines may carry examples (a file round trip keeps them)
    line = {"messages": task["messages"] + [
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": CALLS[0]}]},
        {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}],
        "tools": [PAY], "examples": {"pay": [{"arguments": {"amount": 1}, "result": "8"}]}}
    assert chat_tasks.check_task(line, "x", "trajectories")["examples"] == task["examples"][:1]


class SeparateOracle(torch.nn.Module):
    """A fake LM whose argmax is the true next token in a separate rehearse row (it opens with
    the rehearse system text) and one too high on digits anywhere else."""

    def __init__(self):
        super().__init__()
        self.anchor = torch.nn.Parameter(torch.zeros(1))
        self.digits = torch.tensor(TOK.convert_tokens_to_ids([str(d) for d in range(10)]))
        self.mark = chat_separate.rehearse_prompt_ids(TOK, pay_task(), [], CALLS[0])[3]           # 'Y' of "You play"

    def forward(self, input_ids, **kw):
        target = torch.roll(input_ids, -1, dims=1)
        wrong = torch.where(torch.isin(target, self.digits[:-1]), target + 1, target)
        target = torch.where(input_ids[:, 3:4] == self.mark, target, wrong)
        return SimpleNamespace(logits=torch.nn.functional.one_hot(target, len(TOK)).float())


def test_would_rehearse_asks_in_the_separate_rows():
    task = pay_task()
    prompts, worlds = chat_setup.episode_inputs(TOK, TAGS, [task])
    scripts = scripts_for(task, 0, responses=("5", "9"))           # the policy's own guesses: wrong
    real, = sample_episodes(PrefixScript(scripts), TOK, prompts, "real", world=worlds,
                            settings={"tags": TAGS, "max_act_tokens": 40, "max_env_tokens": 8, "max_tokens": 300})
    assert real["responses"] == ["6", "4"] and real["cause"] == "answer"
    rows = chat_separate.rehearse_rows(TOK, TAGS, task, [json.loads(c) for c in real["calls"]], real["responses"], 1)
    assert honesty.would_rehearse_rows(SeparateOracle(), rows, TOK.pad_token_id) == \
        [(json.dumps(CALLS[0]), True), (json.dumps(CALLS[1]), True)]
    inline = honesty.would_rehearse_calls(SeparateOracle(), TOK, [real], env_end=TAGS["env_end"])
    assert inline == [(json.dumps(CALLS[0]), False), (json.dumps(CALLS[1]), False)]


def test_separate_warm_start_teaches_the_rows_the_sampler_then_writes():
    """A tiny random Qwen2 warm-started (150 steps) on one logged trajectory in separate rows
    samples that episode back in separate rows: its calls, its results rehearsed in the rehearse
    rows, row for row the warm start's ids and roles. An RL step then updates on those rows."""
    task = pay_task()
    cfg = {**config.DEFAULTS, "format": "chat", "rehearsal_context": "separate", "grounding_examples": 1,
           "sft_steps": 150, "sft_batch_size": 1, "sft_lr": 0.01, "micro_batch_tokens": 4096}
    logged = {"messages": task["messages"], "tools": task["tools"], "call_dicts": CALLS, "responses": ["6", "4"],
              "answer": "4", "examples": task["examples"]}
    (group,) = chat_separate.separate_warm_start_sequences(TOK, TAGS, [logged], [], cfg["grounding_examples"])
    model = tiny_qwen(TOK)
    train.warm_start(model, model, [group], cfg, TOK.pad_token_id, roles=(ACT, REHEARSE))
    prompts, worlds = chat_setup.episode_inputs(TOK, TAGS, [task] * 4)
    episodes = sample_separate(model, TOK, prompts, world=worlds, rehearse_prompt=rl_prompt(1),
                               settings={"tags": TAGS, "temperature": 0.3, "max_act_tokens": 30,
                                         "max_env_tokens": 6, "max_tokens": 300},
                               generator=torch.Generator().manual_seed(0))
    for e in episodes:
        assert e["cause"] == "answer" and e["answer"] == "4" and e["responses"] == ["6", "4"]
        for sampled, logged_row in zip([e] + e["rehearsals"], group["rows"]):
            assert sampled["ids"] == logged_row["ids"] and sampled["roles"] == logged_row["roles"]
    step_cfg = {**cfg, "temperature": 0.3, "group_size": 4}
    batch = train.make_batch(episodes, [1.0, 0.0, 1.0, 0.0], step_cfg, TOK.pad_token_id)
    assert len(batch["lengths"]) == 4 + 4 * 2 and int((batch["roles"][:, 1:] == REHEARSE).sum()) == 4 * 2 * 2
    stats = train.rl_step(model, model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, step_cfg,
                          contextlib.nullcontext())
    assert stats["status"] == "updated" and stats["rows_updated"] == 12


def test_chat_rehearse_rows_logprobs_equal_a_teacher_forced_forward():
    """Chat rehearse rows of different prompt lengths (0, 1 earlier calls) sampled together by the
    KV-cached sampler with a tiny random Qwen2: every sampled logprob equals a full forward."""
    model = tiny_qwen(TOK, seed=2, init_range=POSITION_INIT)
    task = pay_task()
    world = chat.task_world(task, TAGS)
    env_tags = chat_separate.rehearse_tags(TAGS)
    prompt = functools.partial(chat_separate.separate_prompt, TOK, 1)
    actors = [{"calls": [json.dumps(c) for c in CALLS[:n + 1]], "responses": ["6"][:n], "episode": n} for n in (0, 1)]
    rows = [_chat_rehearse_row(a, world, env_tags, prompt) for a in actors for _ in range(3)]
    assert len({len(r["ids"]) for r in rows}) == 2
    limits = {"max_turns": 6, "max_act_tokens": 8, "max_env_tokens": 6, "max_tokens": max(len(r["ids"]) for r in rows) + 8,
              "rehearse_check": None}
    sample_rows(model, TOK, rows, "rehearse", None, env_tags, limits, 1.0, 1.0, torch.Generator().manual_seed(0))
    assert_rehearse_logprobs_match_a_forward(model, rows, TOK.pad_token_id)


def test_rl_step_on_chat_separate_rows(monkeypatch):
    """Two episodes of one task: answer 4 (reward 1) and 5 (reward 0), two calls each. Rows
    (task_role): e1, e1.r1, e1.r2, e2, e2.r1, e2.r2 in groups 0 1 1 0 1 1; act mean 1/2, rehearse
    mean 1/2. Trained targets: 20 + 20 + 2 ACT per actor row, 2 REHEARSE per rehearse row. The
    old logprobs and the update run in micro-batches by tool: the actor rows, then pay's rows."""
    task = pay_task()
    e1, = sample(task)
    prompts, worlds = chat_setup.episode_inputs(TOK, TAGS, [task])
    e2, = sample_separate(PrefixScript(scripts_for(task, 1, answer="5")), TOK, prompts, world=worlds,
                          rehearse_prompt=rl_prompt(1),
                          settings={"tags": TAGS, "max_act_tokens": 40, "max_env_tokens": 8, "max_tokens": 300})
    rewards = [chat_reward.chat_reward(e, task) for e in (e1, e2)]
    assert rewards == [1.0, 0.0]
    rows, row_rewards, groups = reward.training_rows([e1, e2], rewards, [0, 0])
    assert groups == [0, 1, 1, 0, 1, 1] and row_rewards == [1, 1, 1, 0, 0, 0]
    cfg = {**config.DEFAULTS, "reuse_sampler_logprobs": False, "micro_batch_tokens": 4096, "group_size": 2}
    batch = train.make_batch([e1, e2], rewards, cfg, TOK.pad_token_id)      # (training_rows inside)
    assert batch["n_tokens"] == 2 * 42 + 4 * 2
    adv, mask = batch["advantages"], batch["mask"]
    assert [sorted(set(adv[i][mask[i]].tolist())) for i in range(6)] == [[0.5], [0.5], [0.5], [-0.5], [-0.5], [-0.5]]
    assert batch["tools"] == ["", "pay", "pay", "", "pay", "pay"]
    packed = []
    monkeypatch.setattr(train, "micro_batches", lambda *a: packed.append(envace.micro_batches(*a)) or packed[-1])
    model = tiny_qwen(TOK)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = train.rl_step(model, model, opt, batch, cfg, contextlib.nullcontext())
    assert packed == [[[0, 3], [2, 5, 1, 4]]]      # longest first: a second call's rows hold the first in their dialogue
    sums = {**stats, **metrics.step_sums([e1, e2], rewards, batch)}      # as the step's metrics line adds them
    assert stats["status"] == "updated" and sums["tokens_rehearse"] == 8 and sums["tokens_act"] == 84
    # ratio 1: loss = -(sum of A over trained tokens) / n_tokens = -(0.5 x (42 + 2 + 2) - 0.5 x (42 + 2 + 2)) / 92;
    # each ratio is 1 within LOGPROB_TOLERANCE (old recomputed, new from the update's forward), so the
    # loss is 0 within 0.5 x 1e-5 (a sign or a group wrong: 0.5 x 46 / 92 = 0.25)
    assert sums["tokens_obs"] == 12 and sums["rows_updated"] == 6 and sums["loss"] == pytest.approx(0.0, abs=5e-6)


def test_chat_evaluation_asks_would_rehearse_in_separate_rows(monkeypatch):
    task = pay_task()
    asked = []

    def spy(model, rows, pad_id, token_budget=4096):
        asked.extend(rows)
        return [(r["call"], r["turn"] == 0) for r in rows]
    monkeypatch.setattr(honesty, "would_rehearse_rows", spy)
    cfg = {**config.DEFAULTS, "format": "chat", "rehearsal_context": "separate", "grounding_examples": 2,
           "max_act_tokens": 40, "max_env_tokens": 8, "max_tokens": 300}
    fmt, setting = features.setup(cfg, TOK, {"logged": [], "rl": [task], "test": [task]})
    result = evaluate.evaluate(PrefixScript(scripts_for(task, 2)), TOK, [task], cfg, fmt, setting)
    assert result["success"] == 1.0 and result["fidelity_counts"] == {"stateful": [1, 2]}
    assert result["executed_tasks"] == 1 and result["rehearsed_tasks"] == 0
    # where the time went: each part once, wall seconds (their sizes are a benchmark's business)
    assert list(result["seconds"]) == ["episodes", "would_rehearse", "imagined_world", "extras"]
    assert all(v >= 0 for v in result["seconds"].values())
    # the tool cache: the RL task's examples, pay 1 -> 8, pay 5 -> 4 (this test task is that RL task)
    assert toolcache.examples(setting.cache, CALLS[0], 2) == task["examples"]
    want = chat_separate.rehearse_rows(TOK, TAGS, task, CALLS, ["6", "4"], 2, cache=setting.cache)
    # asked in those rows once: the answers give fidelity per kind and fidelity by warm-start
    # coverage (the task's examples are other calls: both calls seen 0 times), and by the cache
    assert [r["ids"] for r in asked] == [r["ids"] for r in want]
    assert result["fidelity_by_coverage"]["seen 0 times"] == [1, 2]
    assert result["cache_coverage"] == {"seen": 0, "unseen": 2, "rate": 0.0}
    assert result["fidelity_by_cache"] == {"seen": {}, "unseen": {"stateful": [1, 2]}}


def test_config_accepts_separate_chat(tmp_path, monkeypatch):
    tiny_qwen(TOK, tmp_path / "qwen")
    cfg = config.load_config(os.path.join(ROOT, "configs", "chat_tiny.yaml"),
                            [f"--model={tmp_path / 'qwen'}", "--rehearsal_context=separate", "--grounding_examples=1"])
    assert cfg["rehearsal_context"] == "separate" and cfg["format"] == "chat"
    asked = []                                               # the toy's words are not asked of a chat model
    monkeypatch.setattr(separate, "check_vocabulary", lambda *a: asked.append(a))
    fmt, setting = features.setup(cfg, TOK, {"logged": [], "rl": [pay_task()], "test": [pay_task()]})
    assert asked == []
    assert setting.sampler is separate.sample_separate
    prompt, rl = setting.sampler_args["rehearse_prompt"], setting.rl_sampler_args["rehearse_prompt"]
    assert prompt.func is chat_separate.separate_prompt and prompt.args == (TOK, 1)
    # evaluation's prompt: the tool cache only; RL's: the task's own examples first
    assert prompt.keywords == {"cache": setting.cache} and rl.keywords == {**prompt.keywords, "own_examples": True}
    plain = {**config.DEFAULTS, "rehearsal_context": "separate", "grounding_examples": 1}
    fmt, setting = features.setup(plain, TOK, {"logged": []})   # the toy's plain rehearse prompt: no chat builder
    assert asked == [(plain, TOK)]
    assert setting.sampler is separate.sample_separate and "rehearse_prompt" not in setting.sampler_args


def test_train_and_evaluate_with_separate_chat_rows(tmp_path, monkeypatch):
    # rewards 0, 1, 0, 1, ... in the order episodes are scored: a group's 2 samples always differ,
    # so every step updates whatever a random model writes
    calls = itertools.count()
    monkeypatch.setattr(chat_reward, "chat_reward", lambda e, t, judge=None: float(next(calls) % 2))
    asked = []
    would = honesty.would_rehearse_rows

    def spy(model, rows, pad_id, token_budget=4096):
        asked.append(len(rows))
        assert all(text(r["ids"]).startswith("<|im_start|>system\nYou play the tool") for r in rows)
        return would(model, rows, pad_id, token_budget)
    monkeypatch.setattr(honesty, "would_rehearse_rows", spy)
    sampled, built = [], []

    def sample_spy(*args, **kw):                              # RL samples in separate rows
        sampled.append((kw["settings"]["tags"]["act_end"], kw["rehearse_prompt"].args[1],
                        kw["rehearse_prompt"].keywords.get("own_examples", False)))
        return sample_separate(*args, **kw)
    monkeypatch.setattr(separate, "sample_separate", sample_spy)     # the format's setup reads it
    monkeypatch.setattr(chat_separate, "separate_warm_start_sequences",
                        lambda *a: built.append(a[4]) or chat_separate_warm_start(*a))   # k
    tiny_qwen(TOK, tmp_path / "qwen", init_range=POSITION_INIT)
    overrides = [f"--model={tmp_path / 'qwen'}", f"--out_dir={tmp_path / 'run'}", "--max_act_tokens=12",
                 "--max_tokens=640", "--lr=0.01", "--rehearsal_context=separate", "--grounding_examples=1",
                 "--temperature=2.0"]
    monkeypatch.chdir(ROOT)
    cfg = config.load_config(os.path.join(ROOT, "configs", "chat_tiny.yaml"), overrides)
    assert train.run(cfg) == 0
    out = cfg["out_dir"]
    lines = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:           # every episode samples at least its first token as the actor
        assert sum(m["causes"].values()) == 4 and m["tokens_act"] >= 4
    assert len(assert_ratio_one(lines)) == 2   # actor rows resumed from their kept caches, rehearse rows prefilled
    # the imagined world (format_chat.imagined_world: env toy executes) before RL, two RL steps (the
    # tasks' own examples first), the imagined world after RL (the tool cache only)
    assert sampled == [(TAGS["act_end"], 1, False), (TAGS["act_end"], 1, True), (TAGS["act_end"], 1, True),
                       (TAGS["act_end"], 1, False)] and built == [1]
    assert len(asked) == 2                     # before and after RL (coverage reuses the same answers)
    os.remove(os.path.join(out, "eval.json"))
    assert evaluate_cli.main(["--ckpt", out, "--n_test=3"]) == 0
    result = json.load(open(os.path.join(out, "eval.json")))
    assert result["n_tasks"] == 3 and result["executed_tasks"] == 3
    assert len(asked) == 3                     # and evaluate.py's


@pytest.mark.parametrize("bad", ["--rehearse_check=true", "--rehearsal_budget=2"])
def test_what_chat_still_refuses(tmp_path, bad):
    with pytest.raises(config.ConfigError):
        config.load_config(os.path.join(ROOT, "configs", "chat_tiny.yaml"), [f"--model={tmp_path}",
                                                                              "--rehearsal_context=separate", bad])


ASK = {"type": "function", "function": {"name": "ask", "parameters": {
    "type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}


def test_warm_start_micro_batches_run_a_tools_system_turn_once(monkeypatch):
    """Rehearse rows of two tools (pay, ask) beside an actor row, one warm-start step: every
    micro-batch holds one tool's rows (the actor row alone), the prefix that runs once is that
    tool's whole system turn (its name and schema), and the gradient is the one the same rows give
    in micro-batches by length alone (where pay's and ask's rows mix and share only the template's
    opening). The tool a rehearse row plays is carried by both row builders (warm start and RL)."""
    pay, ask = pay_task(), {**pay_task(), "tools": [ASK]}
    calls = [{"name": "ask", "arguments": {"item": w}} for w in ("jam", "tea", "milk")]
    rows = (chat_separate.rehearse_rows(TOK, TAGS, pay, CALLS, ["6", "4"], own_examples=True)
            + chat_separate.rehearse_rows(TOK, TAGS, ask, calls, ["2", "3", "5"]))
    assert [r["tool"] for r in rows] == ["pay", "pay", "ask", "ask", "ask"]
    actor = chat.assemble(TOK, TAGS, chat.prompt_ids(TOK, pay["messages"], pay["tools"]), CALLS, ["6", "4"], "4")
    e, = sample(pay_task(), k=1)
    assert [r["tool"] for r in e["rehearsals"]] == ["pay", "pay"]
    seqs = [{"rows": [{"ids": actor["ids"], "roles": actor["roles"]}] + rows}]
    cfg = {**config.DEFAULTS, "format": "chat", "rehearsal_context": "separate", "sft_steps": 1,
           "sft_batch_size": 1, "micro_batch_tokens": 4096}
    seen, grads = [], []

    def spy(model, ids, temperature, with_entropy, start, prefix):   # what lean_logprobs found and runs
        seen.append((ids.shape[0], prefix, TOK.decode(ids[0, :prefix])))
        return shared_logprobs(model, ids, temperature, with_entropy, start, prefix)

    class Recorder(torch.optim.SGD):      # lr 0: records the step's gradients, moves nothing
        def step(self, closure=None):
            grads.append({n: p.grad.clone() for n, p in model.named_parameters()})

    shared_logprobs = sharedprefix.token_logprobs
    monkeypatch.setattr(sharedprefix, "token_logprobs", spy)
    lean = train.chosen_logprobs(cfg)                                           # lean_logprobs: true
    monkeypatch.setattr(distributed, "adamw", lambda model, lr, cfg: Recorder(model.parameters(), lr=0.0))
    model = tiny_qwen(TOK)
    train.warm_start(model, model, seqs, cfg, TOK.pad_token_id, roles=(ACT, REHEARSE), logprobs=lean)
    assert [n for n, _, _ in seen] == [1, 3, 2]            # the actor row, ask's 3 rows, pay's 2 rows
    for (n, prefix, text), tool in zip(seen[1:], (ASK, PAY)):
        name = tool["function"]["name"]
        system = chat_separate.REHEARSE_SYSTEM.format(name=name, schema=chat._json(tool))
        assert system in text and prefix < min(len(r["ids"]) for r in rows if r["tool"] == name)
    by_length = envace.micro_batches
    monkeypatch.setattr(train, "micro_batches", lambda lengths, budget, groups=None: by_length(lengths, budget))
    seen.clear()
    train.warm_start(model, model, seqs, cfg, TOK.pad_token_id, roles=(ACT, REHEARSE), logprobs=lean)
    assert len(seen) == 1 and "You play the tool" not in seen[0][2]        # one micro-batch of all six rows
    assert_same_gradients(grads[0], grads[1])
