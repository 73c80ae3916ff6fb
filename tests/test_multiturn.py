"""Multi-turn dialogues in the chat format: the answer -> next user turn hand-off derived from the
template and checked, the sampler forcing the next user turn (roles, masks, logprobs, call_turns,
answers), sampled ids never re-tokenized, per-turn gold-call rewards, task-file checks, the warm
start on multi-turn logged trajectories, and train.py / evaluate.py end to end on a tiny Qwen2."""
import itertools
import json
import os

import pytest
import torch

from chat import format as chat
from chat import chat_reward
from chat import setup as chat_setup
from chat import tasks as chat_tasks
from machinery import config
import evaluate
from scripts import evaluate_cli
from formats import features
from formats import format_chat
from chat import multiturn
import train
from envace import ACT, OBS, PROMPT, REHEARSE, TAG, loss_mask
from helpers import CHAT_TEMPLATE, POSITION_INIT, assert_ratio_one, chat_tokenizer, tiny_qwen
from rollout import sample_episodes
from test_chat import Script  # the scripted fake LM (ids fed after the prompt, scripted_rows)

TOK = chat_tokenizer()
PRICE = {"type": "function", "function": {"name": "price", "parameters": {
    "type": "object", "properties": {"item": {"type": "string"}}, "required": ["item"]}}}
PAY = {"type": "function", "function": {"name": "pay", "parameters": {
    "type": "object", "properties": {"amount": {"type": "integer"}}, "required": ["amount"]}}}
PRICE_APPLE = {"name": "price", "arguments": {"item": "apple"}}
PAY_3 = {"name": "pay", "arguments": {"amount": 3}}
LINE = {"messages": [{"role": "user", "content": "price apple"}], "tools": [PRICE, PAY], "turns": ["pay 3"],
        "answer": "6", "gold_calls": [[PRICE_APPLE], [PAY_3]], "env": "toy"}
P, T, A, R, O = PROMPT, TAG, ACT, REHEARSE, OBS


def ids(tokens):
    return TOK.convert_tokens_to_ids(tokens)


def task(**kw):
    return chat_tasks.check_task({**LINE, **kw}, "line 1", "tasks")


# the prompt: the template's rendering of the first user turn and the tools (its length, 121 with
# the fixture's BPE, is the tokenizer's business); then the episode, token by token, as the tiny
# template renders it:
N_PROMPT = len(TOK.encode(TOK.apply_chat_template(LINE["messages"], tools=LINE["tools"], tokenize=False),
                          add_special_tokens=False))
# price apple -> 3, answer (written as the bytes a p p l e: not the canonical 'apple' token),
# user turn "pay 3", pay 3 -> 6, answer 6
CALL_PRICE = ["<tool_call>", "Ċ", '{"', "name", '":', 'Ġ"', "price", '",', 'Ġ"', "arguments", '":', 'Ġ{"', "item",
              '":', 'Ġ"', "apple", '"}}', "Ċ", "</tool_call>", "<|im_end|>"]
CALL_PAY = ["<tool_call>", "Ċ", '{"', "name", '":', 'Ġ"', "pay", '",', 'Ġ"', "arguments", '":', 'Ġ{"', "amount",
            '":', "Ġ", "3", "}}", "Ċ", "</tool_call>", "<|im_end|>"]
EPISODE = [(["<|im_start|>", "assistant", "Ċ"], T), (CALL_PRICE, A),
           (["Ċ", "<|im_start|>", "user", "Ċ", "<tool_response>", "Ċ"], T), (["3", "Ċ", "</tool_response>"], R),
           (["<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"], T), (["a", "p", "p", "l", "e", "<|im_end|>"], A),
           (["Ċ", "<|im_start|>", "user", "Ċ"], T), (["pay", "Ġ", "3"], P),
           (["<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"], T), (CALL_PAY, A),
           (["Ċ", "<|im_start|>", "user", "Ċ", "<tool_response>", "Ċ"], T), (["6", "Ċ", "</tool_response>"], R),
           (["<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"], T), (["6", "<|im_end|>"], A)]


def sample(t, env_mode="rehearse", script_tokens=None, n=1, **limits):
    tags = chat_setup.chat_tags(TOK, multiturn=True)
    prompts, worlds = chat_setup.episode_inputs(TOK, tags, [t] * n)
    script = ids([tok for segment, _ in (script_tokens or EPISODE) for tok in segment])
    settings = {"tags": tags, "max_act_tokens": 40, "max_env_tokens": 8, "max_tokens": 400, **limits}
    return tags, prompts[0], sample_episodes(Script(script), TOK, prompts, env_mode, world=worlds, settings=settings)


# ----------------------------------------------------------------------------- the template

def test_the_answer_to_user_hand_off_is_derived_from_the_template():
    tags = chat_setup.chat_tags(TOK, multiturn=True)
    assert tags["turn_pre"] == "\n<|im_start|>user\n" and tags["turn_post"] == "<|im_end|>\n<|im_start|>assistant\n"
    assert tags["turn_sep"] == "<|im_end|>\n<|im_start|>user\n"
    assert (tags["turn_stop_pre"], tags["turn_stop"]) == ("", 2)          # the actor's own stop <|im_end|>
    # a turn of two user messages: glue TAG, contents PROMPT, tokenized as one text
    pairs = multiturn.turn_ids(TOK, tags, [{"role": "user", "content": "pay 3"}, {"role": "user", "content": "buy"}])
    assert pairs == list(zip(ids(["Ċ", "<|im_start|>", "user", "Ċ", "pay", "Ġ", "3", "<|im_end|>", "Ċ",
                                  "<|im_start|>", "user", "Ċ", "buy", "<|im_end|>", "Ċ", "<|im_start|>",
                                  "assistant", "Ċ"]),
                             [T] * 4 + [P] * 3 + [T] * 5 + [P] + [T] * 5))


# user turns after an answer that followed a tool call rendered with a marker the sampler's
# hand-off (derived from answers with no tool call before them) does not have
AFTER_TOOLS = CHAT_TEMPLATE.replace(
    "'<|im_start|>' + message.role + '\\n' + message.content",
    "'<|im_start|>' + message.role + '\\n' + ('(again) ' if message.role == 'user' and loop.index0 > 2 "
    "and messages[loop.index0 - 2].role == 'tool' else '') + message.content")


def test_a_template_that_renders_user_turns_differently_after_an_answer_fails_the_check():
    bad = chat_tokenizer(AFTER_TOOLS)
    chat_setup.chat_tags(bad)                          # single-turn runs are not concerned
    with pytest.raises(config.ConfigError) as e:
        chat_setup.chat_tags(bad, multiturn=True)
    message = str(e.value)
    assert "\n" not in message and "multi-turn dialogues: in user turn 2" in message
    assert "token 215 is 'A' in the sampler's assembly but '(' in the template's own rendering" in message
    # numbering user turns: the hand-off depends on the turn
    numbered = CHAT_TEMPLATE.replace("'<|im_start|>' + message.role + '\\n' + message.content",
                                     "'<|im_start|>' + message.role + ((loop.index|string) if message.role == 'user' else '') + '\\n' + message.content")
    with pytest.raises(chat.TemplateError, match="hand-off answer->user depends on the turn"):
        multiturn.turn_tags(chat_tokenizer(numbered), chat.chat_format(chat_tokenizer(numbered)))


# ----------------------------------------------------------------------------- the sampler

def test_roles_masks_and_forced_turn_of_a_two_turn_episode():
    tags, prompt, episodes = sample(task())
    e = episodes[0]
    assert prompt == TOK.encode(TOK.apply_chat_template(LINE["messages"], tools=LINE["tools"], tokenize=False),
                                add_special_tokens=False)
    want_ids = prompt + ids([tok for segment, _ in EPISODE for tok in segment])
    want_roles = [P] * N_PROMPT + [role for segment, role in EPISODE for _ in segment]
    assert e["ids"] == want_ids and e["roles"] == want_roles and len(e["ids"]) == N_PROMPT + 91
    assert e["cause"] == "answer" and e["finished"] and e["answer"] == "6"
    assert e["answers"] == ["apple", "6"] and e["call_turns"] == [0, 1]
    assert e["calls"] == [json.dumps(PRICE_APPLE), json.dumps(PAY_3)] and e["responses"] == ["3", "6"]
    # the forced user turn: glue TAG, content PROMPT, logprob 0 (the script is certain, so every
    # logprob is 0 here: the roles say which tokens were forced)
    turn = slice(N_PROMPT + 3 + 20 + 6 + 3 + 5 + 6, N_PROMPT + 3 + 20 + 6 + 3 + 5 + 6 + 12)
    assert [TOK.convert_ids_to_tokens(i) for i in e["ids"][turn]] == [
        "Ċ", "<|im_start|>", "user", "Ċ", "pay", "Ġ", "3", "<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]
    assert e["roles"][turn] == [T] * 4 + [P] * 3 + [T] * 5 and set(e["logprobs"][turn]) == {0.0}
    assert all(e["logprobs"][i] == 0.0 for i, r in enumerate(e["roles"]) if r in (P, T))
    # the shifted loss mask: position t is trained iff token t+1 is ACT or REHEARSE
    mask = "".join(str(int(m)) for m in loss_mask(torch.tensor([e["roles"]]))[0].tolist())
    assert mask[:N_PROMPT - 1] == "0" * (N_PROMPT - 1) and len(mask) == N_PROMPT + 91 - 1
    assert mask[N_PROMPT - 1:] == ("000" + "1" * 20 + "0" * 6 + "111" + "0" * 5 + "1" * 6 + "0" * 4 + "000" + "0" * 5
                          + "1" * 20 + "0" * 6 + "111" + "0" * 5 + "11")
    # the sequence is the template's own rendering of the conversation (without the final "\n"),
    # except that the answer keeps its sampled bytes a p p l e: never re-tokenized into 'apple'
    messages = [LINE["messages"][0], {"role": "assistant", "content": "", "tool_calls": [{"function": PRICE_APPLE}]},
                {"role": "tool", "content": "3"}, {"role": "assistant", "content": "apple"},
                {"role": "user", "content": "pay 3"},
                {"role": "assistant", "content": "", "tool_calls": [{"function": PAY_3}]},
                {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]
    rendered = chat.prompt_ids(TOK, messages, [PRICE, PAY])
    apple = N_PROMPT + 3 + 20 + 6 + 3 + 5
    assert rendered[apple] == ids(["apple"])[0] and e["ids"][apple:apple + 5] == ids(list("apple"))
    assert e["ids"][:apple] + e["ids"][apple + 5:] + tags["end"] == rendered[:apple] + rendered[apple + 1:]
    assert chat_reward.chat_reward(e, task()) == 1.0


def test_real_mode_runs_both_turns_in_one_toy_world_and_max_turns_counts_all_calls():
    # the script rehearses '5' and '7': the toy world says 3 (price apple) and 6 (9 - 3), forced as OBS
    script = [(s, r) if s[0] not in ("3", "6") or r != R else ([{"3": "5", "6": "7"}[s[0]]] + s[1:], r)
              for s, r in EPISODE]
    _, _, episodes = sample(task(), "real", script, n=2)
    for e in episodes:
        assert e["responses"] == ["3", "6"] and e["cause"] == "answer" and e["call_turns"] == [0, 1]
        assert e["roles"].count(O) == 6 and e["roles"].count(R) == 0
    _, _, [e] = sample(task(), "rehearse", max_turns=1)          # the second call, in turn 2, is one too many
    assert e["cause"] == "turn_limit" and e["answers"] == ["apple"] and e["answer"] is None
    assert e["calls"] == [json.dumps(PRICE_APPLE)] and e["call_turns"] == [0]
    _, _, [e] = sample(task(), "rehearse", max_tokens=N_PROMPT + 50)  # max_tokens bounds the whole sequence
    assert e["cause"] == "token_limit" and len(e["ids"]) == N_PROMPT + 50 and e["answers"] == ["apple"]
    assert chat_reward.chat_reward(e, task()) == 0.0


def test_a_single_turn_episode_records_call_turns_0_and_its_one_answer():
    t = task(turns=[], gold_calls=[PRICE_APPLE])
    script = EPISODE[:5] + [(["3", "<|im_end|>"], A)]
    _, _, [e] = sample(t, "rehearse", script)
    assert e["cause"] == "answer" and e["answers"] == ["3"] == [e["answer"]] and e["call_turns"] == [0]
    assert "turns" not in t and t["turn_ids"] == []


# ----------------------------------------------------------------------------- rewards

def test_gold_calls_per_turn_are_matched_turn_by_turn():
    calls = [json.dumps(PRICE_APPLE), json.dumps(PAY_3)]
    e = {"cause": "answer", "answer": "6", "answers": ["3", "6"], "calls": calls, "responses": ["3", "6"],
         "call_turns": [0, 1]}
    t = task()
    assert chat_reward.chat_reward(e, t) == 1.0
    assert chat_reward.chat_reward({**e, "call_turns": [0, 0]}, t) == 0.0      # both calls in turn 1
    assert chat_reward.chat_reward({**e, "call_turns": [1, 1]}, t) == 0.0
    assert chat_reward.chat_reward({**e, "answer": "7"}, t) == 0.0             # the final answer counts
    assert chat_reward.chat_reward({**e, "answers": ["9", "6"]}, t) == 1.0     # an earlier answer does not
    flat = task(gold_calls=[PRICE_APPLE, PAY_3])                               # flat: all calls, any turn
    assert chat_reward.chat_reward({**e, "call_turns": [0, 0]}, flat) == 1.0
    both = task(gold_calls=[[], [PAY_3, PRICE_APPLE]], call_order="any")
    assert chat_reward.chat_reward({**e, "call_turns": [1, 1]}, both) == 1.0
    assert chat_reward.chat_reward(e, both) == 0.0
    assert chat_reward.chat_reward({**e, "call_turns": [1, 1]}, {**both, "call_order": "exact"}) == 0.0


def test_the_judge_reads_every_user_turn_and_answer(monkeypatch):
    seen = []
    monkeypatch.setattr(chat_reward, "judge_yes_probability", lambda model, tokenizer, prompts: seen.extend(prompts) or [1.0])
    e = {"cause": "answer", "answer": "6", "answers": ["3", "6"], "calls": ["c1", "c2"],
         "responses": ["3", "6"], "call_turns": [0, 1]}
    chat_reward.make_judge(None, TOK)(e, {**task(), "checklist": ["ok?"]})
    assert "call: c1\nresult: 3\nanswer: 3\nuser: pay 3\ncall: c2\nresult: 6\nanswer: 6\n" in seen[0]


def test_evaluation_of_a_two_turn_task_without_an_executor():
    """evaluate.evaluate on a task no executor runs: the policy (scripted) rehearses both turns;
    success by the per-turn gold calls and the final answer."""
    t = {k: v for k, v in task().items() if k != "env"}
    cfg = {**config.DEFAULTS, "format": "chat", "max_act_tokens": 40, "max_tokens": 400}
    fmt, setting = features.setup(cfg, TOK, {"logged": [], "rl": [t], "test": [t]})
    script = Script(ids([tok for segment, _ in EPISODE for tok in segment]))
    result = evaluate.evaluate(script, TOK, [t], cfg, fmt, setting)
    assert result["causes"] == {"answer": 1} and result["success"] == 1.0 and result["mean_calls"] == 2.0
    assert result["rehearsed_tasks"] == 1 and result["executed_tasks"] == 0


# ----------------------------------------------------------------------------- task files

@pytest.mark.parametrize("change, problem", [
    ({"turns": "pay 3"}, "'turns' must be a list of user turns"),
    ({"turns": [3]}, "turn 1 of 'turns' must be a string or a non-empty list of user messages, got 3"),
    ({"turns": [[]]}, "turn 1 of 'turns' must be a string or a non-empty list"),
    ({"turns": ["a", [{"role": "assistant", "content": "x"}]]},
     "turn 2 of 'turns', message 1: expected {\"role\": \"user\", \"content\": \"...\"}"),
    ({"turns": [[{"role": "user", "content": None}]]}, "turn 1 of 'turns', message 1: expected"),
    ({"gold_calls": [[PRICE_APPLE]]}, "'gold_calls' has 1 turns but the task has 2 user turns (the opening and 1 in"),
    ({"turns": [], "gold_calls": [[PRICE_APPLE], [PAY_3]]}, "'gold_calls' has 2 turns but the task has 1 user turns"),
    ({"gold_calls": [PRICE_APPLE, [PAY_3]]}, "a list of calls or a list of turns (lists of calls), not a mix"),
    ({"gold_calls": [[PRICE_APPLE], [{"name": "pay", "arguments": {"amount": "3"}}]]},
     "gold call 1 of turn 2 pay: arguments.amount must be integer, got \"3\""),
    ({"gold_calls": [[], [{"name": "tip", "arguments": {}}]]}, "gold call 1 of turn 2 names tool 'tip'"),
])
def test_task_file_errors_of_multi_turn_tasks_are_one_line(change, problem):
    with pytest.raises(chat_tasks.DataError) as e:
        task(**change)
    assert str(e.value).startswith("line 1: ") and problem in str(e.value) and "\n" not in str(e.value)


def trajectory(*later):
    """A logged two-turn conversation line: price apple -> 3, answer 3, user pay 3, pay 3 -> 6, answer 6."""
    call = lambda c: {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c}]}
    messages = [LINE["messages"][0], call(PRICE_APPLE), {"role": "tool", "content": "3"},
                {"role": "assistant", "content": "3"}, {"role": "user", "content": "pay 3"}, call(PAY_3),
                {"role": "tool", "content": "6"}, {"role": "assistant", "content": "6"}]
    return {"messages": list(later) or messages, "tools": [PRICE, PAY]}


def test_multi_turn_logged_trajectories_are_read_and_checked():
    t = chat_tasks.check_task(trajectory(), "line 1", "trajectories")
    assert t["call_dicts"] == [PRICE_APPLE, PAY_3] and t["responses"] == ["3", "6"] and t["answer"] == "6"
    assert t["call_turns"] == [0, 1] and t["answers"] == ["3", "6"]
    assert t["turns"] == [[{"role": "user", "content": "pay 3"}]] and t["messages"] == LINE["messages"]
    good = trajectory()["messages"]
    for messages, problem in (
            (good[:3] + good[4:], "message 3 after the opening: a user message may only follow the assistant's answer"),
            (good[:5], "a logged trajectory needs at least one assistant turn"),
            (good[:7] + [good[4]], "message 7 after the opening: a user message may only follow the assistant's"),
    ):
        with pytest.raises(chat_tasks.DataError, match=problem.replace("(", r"\(")):
            chat_tasks.check_task(trajectory(*messages), "line 1", "trajectories")


def test_the_warm_start_trains_multi_turn_trajectories_with_the_forced_turns():
    """Calls and answers ACT, responses OBS, the later user turn PROMPT (its glue TAG): the ids are
    the template's own rendering of the logged conversation."""
    logged = chat_tasks.check_task(trajectory(), "line 1", "trajectories")
    tags = chat_setup.chat_tags(TOK, multiturn=True)
    [seq] = chat_setup.warm_start_sequences(TOK, tags, [logged], [])
    assert seq["ids"] + tags["end"] == chat.prompt_ids(TOK, trajectory()["messages"], [PRICE, PAY])
    want = [role for segment, role in EPISODE[:5] for _ in segment] + [A, A] + [role for segment, role in EPISODE[6:]
                                                                              for _ in segment]
    assert seq["roles"] == [P] * N_PROMPT + [O if r == R else r for r in want]


def test_separate_rehearsal_and_private_rehearsal_refuse_multi_turn_tasks():
    splits = {"rl": [task()], "test": [task()], "logged": []}
    base = {**config.DEFAULTS, "format": "chat", "max_tokens": 400}
    with pytest.raises(config.ConfigError, match="rehearsal_context: separate does not support multi-turn"):
        features.setup({**base, "rehearsal_context": "separate"}, TOK, splits)
    with pytest.raises(config.ConfigError, match="rehearsal_budget > 0 .private rehearsal. does not support"):
        features.setup({**base, "rehearsal_budget": 2}, TOK, splits)
    features.setup(base, TOK, splits)


# ----------------------------------------------------------------------------- end to end

def test_warm_start_rl_and_evaluation_on_two_turn_tasks(tmp_path, monkeypatch):
    """3 two-turn toy tasks (price ITEM, then `pay P`) and their logged conversations: the warm
    start, two RL steps and the real-world evaluation through train.py on a random tiny Qwen2."""
    prices = {"apple": 3, "milk": 2, "tea": 4}
    tasks, logged = [], []
    for item, p in prices.items():
        line = {**LINE, "messages": [{"role": "user", "content": f"price {item}"}], "turns": [f"pay {p}"],
                "answer": str(9 - p), "gold_calls": [[{"name": "price", "arguments": {"item": item}}],
                                                     [{"name": "pay", "arguments": {"amount": p}}]]}
        tasks.append(line)
        call = lambda c: {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": c}]}
        logged.append({"tools": [PRICE, PAY], "messages": line["messages"] + [
            call(line["gold_calls"][0][0]), {"role": "tool", "content": str(p)}, {"role": "assistant", "content": str(p)},
            {"role": "user", "content": f"pay {p}"}, call(line["gold_calls"][1][0]),
            {"role": "tool", "content": str(9 - p)}, {"role": "assistant", "content": str(9 - p)}]})
    for name, rows in (("tasks.jsonl", tasks), ("logged.jsonl", logged)):
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    tiny_qwen(TOK, tmp_path / "qwen", init_range=POSITION_INIT)
    # rewards 0, 1, 0, 1, ... in the order episodes are scored: a group's 2 samples always differ,
    # so every step updates whatever a random model writes
    calls = itertools.count()
    monkeypatch.setattr(chat_reward, "chat_reward", lambda e, t, judge=None: float(next(calls) % 2))
    cfg = {**config.DEFAULTS, "format": "chat", "model": str(tmp_path / "qwen"), "out_dir": str(tmp_path / "run"),
           "tasks_file": str(tmp_path / "tasks.jsonl"), "logged_file": str(tmp_path / "logged.jsonl"),
           "sft_steps": 3, "sft_batch_size": 3, "sft_lr": 1e-3, "rl_steps": 2, "tasks_per_step": 2, "group_size": 2,
           "lr": 1e-2, "max_act_tokens": 24, "max_env_tokens": 6, "max_tokens": 300, "micro_batch_tokens": 2048,
           "min_fidelity": 0.0, "temperature": 2.0, "n_test": 3, "n_collusion": 0}
    seen = []
    build = format_chat.warm_start_sequences

    def warm_start_sequences(setting):       # keep the warm-start rows train.py builds
        return seen.extend(build(setting)) or seen
    monkeypatch.setattr(format_chat, "warm_start_sequences", warm_start_sequences)
    assert train.run(cfg) == 0
    # the warm start trained the three two-turn conversations: each with a PROMPT user turn and two
    # answers: PROMPT = its first user turn's prompt (the template's rendering) + 'pay P' (pay Ġ P)
    prompts = [len(TOK.encode(TOK.apply_chat_template(t["messages"], tools=t["tools"], tokenize=False),
                              add_special_tokens=False)) for t in tasks]
    assert sorted(s["roles"].count(P) for s in seen) == sorted(n + 3 for n in prompts)
    assert all(sum(1 for a, b in zip(s["roles"], s["roles"][1:]) if (a, b) == (T, P)) == 1 for s in seen)
    lines = [json.loads(text) for text in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in lines] == [1, 2] and all(sum(m["causes"].values()) == 4 for m in lines)
    # ratio 1 on every updated step: the sampler's logprobs, taken with the forced user turns fed
    # as runs in the KV cache, are those of the update's full forward
    assert len(assert_ratio_one(lines)) == 2
    result = json.load(open(tmp_path / "run" / "eval.json"))
    assert result["n_tasks"] == 3 == result["executed_tasks"] == sum(result["causes"].values())
    os.rename(tmp_path / "run" / "eval.json", tmp_path / "run" / "train_eval.json")
    assert evaluate_cli.main(["--ckpt", str(tmp_path / "run"), "--n_test=3"]) == 0
    again = json.load(open(tmp_path / "run" / "eval.json"))
    assert again["n_tasks"] == 3 and again["causes"] == result["causes"]       # greedy: the same episodes
