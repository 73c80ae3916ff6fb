"""What a `format: chat` run sets up from the chat files (formats/format_chat.py calls these).

The splits read and checked (`chat_tasks`: chat_tasks.read_chat_jsonl); the template's
hand-offs derived and checked (`chat_tags`: chat.chat_format, and multiturn.turn_tags when a task
has later user turns); every prompt checked to leave room for an episode (`check_chat_prompts`);
the limits checked against each task's ground truth (`gold_limits`: one warning line naming the
tasks no episode can win within max_turns, max_act_tokens, max_env_tokens and max_tokens);
per task its prompt ids, later turns and world, cached in the task (`episode_inputs`); the warm
start's rows (`warm_start_sequences`: logged trajectories and the tasks' examples; the separate
layout's are chat_separate.separate_warm_start_sequences); the expert's episodes that --coverage
asks about (`expert_episodes`); the judge (`load_judge`). It sits above chat/format.py, chat/tasks.py and
chat/multiturn.py, which it joins, so that imports run one way.

Simplified: a judge model is loaded once per path and kept for the process (`_JUDGES`).
"""
import json
import sys

import world as toy_world
from machinery import taskfiles
from chat.format import _call, _json, assemble, chat_format, has_executor, prompt_ids, task_world, toy_task_line
from chat.chat_reward import make_judge
from chat.tasks import check_task, read_chat_jsonl
from machinery.checkpoint import load_policy
from machinery.config import DEFAULTS, ConfigError
from envace import PROMPT, encode, world_is_sampled
from chat.templates import HERMES, format_call
from chat.multiturn import assemble_dialogue, multiturn, turn_ids, turn_tags
from chat.templates import TemplateError


def chat_tasks(cfg):
    """Chat JSONL splits (read_chat_jsonl): tasks_file for RL, test_file (default: the same
    file) for evaluation, logged_file (optional) for the warm start; tasks_file: toy, the toy
    world's splits as chat tasks (toy_chat_splits)."""
    if cfg["tasks_file"] == "toy":
        return toy_chat_splits(cfg)
    try:
        rl = read_chat_jsonl(cfg["tasks_file"], "tasks")
        test = read_chat_jsonl(cfg["test_file"], "tasks") if cfg["test_file"] else rl
        logged = read_chat_jsonl(cfg["logged_file"], "trajectories") if cfg["logged_file"] else []
    except taskfiles.DataError as e:
        raise ConfigError(str(e)) from None
    if cfg["env_mode"] == "real" and not all(has_executor(t) for t in rl):
        raise ConfigError(f"env_mode: real needs tasks a real environment executes ('env': 'toy' or "
                          f"'MODULE:CLASS', docs/tools.md); {cfg['tasks_file']} has tasks without one")
    return {"rl": rl, "test": test, "logged": logged}


def toy_chat_splits(cfg):
    """The toy world's splits (world.make_splits from data_seed, n_logged, n_new_logged,
    n_rl_tasks, n_test) as chat tasks, made in memory: the lines `python -m chat.format --export`
    writes (toy_task_line), checked as a file's lines are (check_task)."""
    splits = toy_world.make_splits(cfg["data_seed"], cfg["n_logged"], cfg["n_new_logged"], cfg["n_rl_tasks"],
                                   cfg["n_test"])
    return {name: [check_task(toy_task_line(t, name == "logged"), f"toy {name} task {i + 1}",
                              "trajectories" if name == "logged" else "tasks", ".")
                   for i, t in enumerate(splits[name])] for name in ("rl", "test", "logged")}


def chat_tags(tokenizer, think="keep", multiturn=False):
    """The hand-offs derived from the tokenizer's chat template (chat_format), checked; with
    multiturn (tasks with later user turns) also the answer -> next user turn one (turn_tags)."""
    try:
        tags = chat_format(tokenizer, think)
        return turn_tags(tokenizer, tags) if multiturn else tags
    except TemplateError as e:
        raise ConfigError(str(e)) from None


def check_chat_prompts(cfg, tokenizer, tasks, positions=None):
    """The template fits (chat_tags) and every task's rendered prompt, with its later user turns,
    leaves room for an episode in the model's context (`positions`: its max_position_embeddings, if
    given) and in max_tokens (config.check_prompt: one line naming the longest task)."""
    from machinery.config import check_prompt
    prompts, _ = episode_inputs(tokenizer, chat_tags(tokenizer, cfg["think"], multiturn(tasks)), tasks,
                                cfg["tool_timeout"])
    lengths = [len(p) + sum(map(len, t["turn_ids"])) for p, t in zip(prompts, tasks)]
    longest = max(range(len(tasks)), key=lambda i: lengths[i])
    check_prompt(cfg, lengths[longest], f"a task's prompt (messages + tools + later user turns) is {lengths[longest]} "
                                        f"tokens ({tasks[longest]['messages'][-1]['content'][:40]!r})",
                 tasks[longest].get("where", "the tasks"), positions)


def gold_limits(cfg, tokenizer, tags, tasks, rehearsed):
    """How many `tasks` no episode can win within the config's limits, from their ground truth:
    each task's gold calls (all user turns together) against max_turns; each call as the actor
    writes it (the template's call form and stop text) against max_act_tokens; with `rehearsed` (RL
    whose world the policy writes) each response the task's executor returns for the gold calls,
    as the rehearsing policy writes it, against max_env_tokens; the gold episode built the sampler's
    way (empty answers: a lower bound) against max_tokens. Tasks with no gold calls are not
    counted. ({limit: [tasks over it, the largest need]}, tasks over any limit); episode_inputs
    first (each task's ids and world)."""
    fmt = tags.get("format", HERMES)
    over, blocked = {key: [0, 0] for key in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}, 0
    for t in tasks:
        gold = t.get("gold_calls") or []
        turns = gold if gold and isinstance(gold[0], list) else [gold]
        calls = [c for turn in turns for c in turn]
        if not calls:
            continue
        responses = t["world"].replay([json.dumps(c) for c in calls]) if has_executor(t) else [""] * len(calls)
        needs = {"max_turns": len(calls),
                 "max_act_tokens": max(len(encode(tokenizer, format_call(c, fmt) + tags["act_pre"])) for c in calls),
                 "max_env_tokens": max(len(encode(tokenizer, tags.get("env_lead", "") + r + tags["env_pre"]))
                                       for r in responses) if rehearsed and has_executor(t) else 0,
                 "max_tokens": len(assemble_dialogue(tokenizer, tags, t["prompt_ids"], t["turn_ids"], calls, responses,
                                                     [k for k, turn in enumerate(turns) for _ in turn],
                                                     [""] * len(turns))["ids"])}
        for key, need in needs.items():
            over[key][0] += need > cfg[key]
            over[key][1] = max(over[key][1], need)
        blocked += any(need > cfg[key] for key, need in needs.items())
    return over, blocked


def warn_gold_limits(cfg, tokenizer, tags, tasks, name, rehearsed):
    """One warning line (stderr) when some of `tasks` (the split `name`) cannot be won within the
    limits (`gold_limits`), with the counts and what each limit would need; nothing when all can."""
    episode_inputs(tokenizer, tags, tasks, cfg["tool_timeout"])
    over, blocked = gold_limits(cfg, tokenizer, tags, tasks, rehearsed)
    what = {"max_turns": "more calls than", "max_act_tokens": "a call longer than",
            "max_env_tokens": "a response longer than", "max_tokens": "a gold episode longer than"}
    parts = [f"{n} {what[key]} {key} {cfg[key]} (up to {need})" for key, (n, need) in over.items() if n]
    if parts:
        print(f"warning: {name}: {blocked} of {len(tasks)} tasks cannot be won within the limits: "
              f"{'; '.join(parts)}; raise the limits to at least these", file=sys.stderr)
    return over, blocked


def episode_inputs(tokenizer, tags, tasks, tool_timeout=DEFAULTS["tool_timeout"]):
    """Per task: its prompt ids and its world (cached in the task dict)."""
    for t in tasks:
        if "prompt_ids" not in t:
            t["prompt_ids"] = prompt_ids(tokenizer, t["messages"], t["tools"], tags.get("template"))
            t["turn_ids"] = [turn_ids(tokenizer, tags, turn) for turn in t.get("turns", [])]
            t["world"] = task_world(t, tags, tool_timeout)
    return [t["prompt_ids"] for t in tasks], [t["world"] for t in tasks]


def warm_start_sequences(tokenizer, tags, logged, tasks):
    """Logged chat trajectories (calls and answer ACT, responses OBS) and every task's reference
    examples as one-call snippets (the call is context, role PROMPT; the result OBS is trained):
    the initial world model, as world.tool_snippets is for the toy."""
    seqs = [logged_sequence(tokenizer, tags, t) for t in logged]
    for t in tasks:
        prompt = prompt_ids(tokenizer, t["messages"], t["tools"], tags.get("template"))
        seqs += [assemble(tokenizer, tags, prompt, [call], [result], act_role=PROMPT)
                 for call, result in t.get("examples", [])]
    return [{"ids": s["ids"], "roles": s["roles"]} for s in seqs]


def logged_sequence(tokenizer, tags, t):
    """A logged trajectory's actor row: its calls and answers ACT, responses OBS, later user turns
    forced as the sampler forces them (turn_ids: glue TAG, user contents PROMPT)."""
    prompt = prompt_ids(tokenizer, t["messages"], t["tools"], tags.get("template"))
    return assemble_dialogue(tokenizer, tags, prompt, [turn_ids(tokenizer, tags, m) for m in t.get("turns", [])],
                             t["call_dicts"], t["responses"], t["call_turns"], t["answers"])


def expert_episodes(tokenizer, tags, tasks):
    """(tasks, episodes) of the gold calls of the tasks with an executor and flat gold_calls, each
    replayed on a fresh executor and assembled as a real episode (responses OBS): the expert's
    calls that --coverage asks the model to rehearse, as honesty.coverage_fidelity does for the toy."""
    chosen = [t for t in tasks if has_executor(t) and t.get("gold_calls")
              and all(isinstance(c, dict) for c in t["gold_calls"])]
    prompts, worlds = episode_inputs(tokenizer, tags, chosen)
    episodes = []
    for t, prompt, world in zip(chosen, prompts, worlds):
        calls = [_json(_call(c)) for c in t["gold_calls"]]
        responses = world.replay(calls)
        episodes.append({**assemble(tokenizer, tags, prompt, t["gold_calls"], responses), "calls": calls,
                         "responses": responses})
    return chosen, episodes


_JUDGES = {}


def load_judge(cfg, device):
    """chat_reward's judge from cfg judge_model (loaded once per path), or None."""
    if not cfg["judge_model"]:
        return None
    if cfg["judge_model"] not in _JUDGES:
        model, tokenizer = load_policy(cfg["judge_model"], device)
        _JUDGES[cfg["judge_model"]] = make_judge(model.eval(), tokenizer)
    return _JUDGES[cfg["judge_model"]]
