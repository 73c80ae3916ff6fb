"""Features chosen once at setup: the task format and the rehearsal layout, as one small object.

    format: plain               the toy's tags and world (world.py, the demo)
            chat                the model's chat template, JSON tool calls, JSONL tasks (chat.py)
    rehearsal_context: inline   the response written in the actor's own row (rollout.py, the demo)
                       separate every rehearsal a row of its own (separate.py)

`setup(cfg, tokenizer, splits)` looks at these two keys once and returns a namespace of plain
functions; train.py and evaluate.py call them and never branch on the format or the layout:

    inputs(tasks, repeat)   (prompts, worlds, tags) for the sampler, each task `repeat` times
    sample                  the sampler when the policy rehearses (rollout.sample_episodes inline,
                            separate.sample_separate); real-world episodes are always inline
    rl_sample               RL's sampler, chosen by env_mode (`sample`, or inline rollout.sample_episodes
                            when the real world or none answers), with env_mode and the config's sampling
                            keys bound: called with the step's model, prompts, worlds, tags and generator
    reward(episode, task)   task success (reward.task_reward, or chat_reward.chat_reward)
    warm_start_sequences()  the logged data as rows of ids + roles; warm_start_roles: those trained
    diagnostics(episodes, tasks)   an RL step's rehearsal fidelity and collusion sums, against a
                            real replay (empty when no real world exists for the tasks); rl_diagnostics:
                            the same for rehearsed RL steps, {} for real / none ones
    executes(task)          whether a real executor runs the task at evaluation
    would_rehearse(model, tokenizer, tasks, episodes)   [(call, matched)]: would the model, greedy,
                            have rehearsed each real response of these real-world episodes?
    by_kind(pairs, tasks)   those per tool kind {kind: [matches, total]}
    coverage(model, tokenizer, tasks, pairs)   fidelity bucketed by warm-start coverage (plain:
                            on the expert's calls of `tasks`; chat: on `pairs`, or without them
                            on the gold calls of the tasks with an executor)
    honesty(model, tokenizer, tasks, cfg, generator)   imagined success and collusion
    step_extras(model, episodes, tasks)   extra figures for an RL step's metrics line (this rank's
                            episodes; {} unless the world adds some: world: uncertain)
    eval_extras(model, tasks, episodes, rewards)   extra figures for an evaluation ({} unless ...)

`world: uncertain` (world_uncertain.py: stale logs for some items) is the toy's plain features
with its own logged data and its per-subset measures (`uncertain_features`). `world: choice`
(world_choice.py: buy the cheapest of K items, one real call per task, private rehearsal by a
rehearsal memory) has its own tasks, logged data, reward and RL sampler (`choice_features`).
"""
import functools
import json
from collections import Counter
from types import SimpleNamespace

import torch

from chat import format as chat
from chat import honesty as chat_honesty
from chat import reward as chat_reward
from chat import separate as chat_separate
from chat import setup as chat_setup
from rehearsal import honesty
from chat import multiturn
import rehearse
from rehearsal import separate
from machinery import taskfiles
import world
from experiments import choice as world_choice
from experiments import uncertain as world_uncertain
from machinery.config import ConfigError
from envace import ACT, OBS, PROMPT, REHEARSE, encode_episode, tag_ids
from reward import task_reward
from rollout import sample_episodes


def build_tasks(cfg):
    """The splits: generated from the toy world (data_seed), or read from JSONL files where the
    config names them (chat: always files, chat_tasks.read_chat_jsonl). Every file line is checked
    here, before anything is built or trained."""
    if cfg["format"] == "chat":
        return chat_setup.chat_tasks(cfg)
    if cfg["world"] == "uncertain":
        splits = world_uncertain.make_splits(cfg)
    elif cfg["world"] == "choice":
        splits = world_choice.make_splits(cfg)
    else:
        splits = world.make_splits(cfg["data_seed"], cfg["n_logged"], cfg["n_new_logged"],
                                   cfg["n_rl_tasks"], cfg["n_test"], cfg["coverage"])
    try:
        for key, split, kind in (("tasks_file", "rl", "tasks"), ("test_file", "test", "tasks"),
                                 ("logged_file", "logged", "trajectories")):
            if cfg[key]:
                splits[split] = taskfiles.read_jsonl(cfg[key], kind)
    except taskfiles.DataError as e:
        raise ConfigError(str(e)) from None
    for t in splits["rl"] + splits["test"]:
        t.setdefault("family", "file")
    return splits


def tiny_words(cfg):
    """The vocabulary of `model: tiny`: the toy world's words (and the separate prompt's, and
    world: choice's task and memory words)."""
    return (world.WORDS + (separate.SEPARATE_WORDS if cfg["rehearsal_context"] == "separate" else [])
            + (world_choice.NEW_WORDS if cfg.get("world") == "choice" else []))


def setup(cfg, tokenizer, splits, device="cpu"):
    """The namespace of functions described in the module docstring, for this cfg."""
    if cfg["format"] == "chat":
        fx = chat_features(cfg, tokenizer, splits, device)
    elif cfg["world"] == "uncertain":
        fx = uncertain_features(cfg, tokenizer, splits)
    elif cfg["world"] == "choice":
        fx = choice_features(cfg, tokenizer, splits)
    else:
        fx = plain_features(cfg, tokenizer, splits)
    rehearsed = cfg["env_mode"] in ("rehearse", "frozen")    # the policy (or the frozen warm start) plays the world
    fx.rl_sample = functools.partial(fx.sample if rehearsed else sample_episodes,     # RL's sampler, chosen by
                                     env_mode=cfg["env_mode"], **sampling_args(cfg))  # env_mode, its config bound
    fx.rl_diagnostics = fx.diagnostics if rehearsed else no_extras  # rehearsals against a real replay
    return fx


def sampling_args(cfg):
    """The sampler's keyword arguments from the config (rollout.sample_episodes)."""
    args = {k: cfg[k] for k in ("temperature", "top_p", "max_turns", "max_act_tokens", "max_env_tokens",
                                "max_tokens")}
    return {**args, "rehearse_check": rehearse.check_rehearsal if cfg["rehearse_check"] else None}


def no_extras(*args):
    return {}


def plain_features(cfg, tokenizer, splits, world=world, snippets=None):
    """The toy's plain tags and world; inline or separate rehearsal rows. snippets: the logged
    tool traffic, if not world.tool_snippets' (a snippet may carry its logged "responses")."""
    if snippets is None:
        snippets = world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"], cfg["coverage"])
    logged = [(t, t.get("responses") or world.replay(t["calls"])) for t in splits["logged"]]
    counts = Counter([c for t, _ in logged for c in t["calls"]] + [c for s in snippets for c in s["calls"]])
    tags = tag_ids(tokenizer)                         # the toy's tags as ids, once
    fx = SimpleNamespace(
        inputs=lambda tasks, repeat=1: ([t["prompt"] for t in tasks for _ in range(repeat)], world, tags),
        executes=lambda task: True, reward=task_reward, step_extras=no_extras, eval_extras=no_extras,
        diagnostics=lambda episodes, tasks: {"fidelity": honesty.replay_fidelity(episodes, world),
                                             "collusion": honesty.collusion_counts(episodes, tasks, world)})
    if cfg["rehearsal_context"] == "inline":
        fx.sample, fx.warm_start_roles = sample_episodes, (ACT, REHEARSE, OBS)
        fx.warm_start_sequences = lambda: (
            [encode_episode(tokenizer, t["prompt"], t["calls"], responses, t["answer"]) for t, responses in logged]
            + [encode_episode(tokenizer, s["prompt"], s["calls"], s.get("responses") or world.replay(s["calls"]),
                              act_role=PROMPT) for s in snippets])
        would_rehearse = honesty.would_rehearse_calls
    else:
        separate.check_vocabulary(cfg, tokenizer)
        examples = separate.logged_examples(cfg, logged, snippets)
        fx.sample = functools.partial(separate.sample_separate, examples=examples)
        fx.warm_start_roles = (ACT, REHEARSE)     # the responses in actor rows are context only
        fx.warm_start_sequences = lambda: separate.warm_start_sequences(tokenizer, logged, snippets, examples)
        would_rehearse = functools.partial(separate.would_rehearse_separate, examples=examples)
    fx.would_rehearse = lambda model, tokenizer, tasks, episodes: would_rehearse(model, tokenizer, episodes)
    fx.by_kind = lambda pairs, tasks: honesty.by_kind(pairs, world)
    fx.coverage = lambda model, tokenizer, tasks, pairs=(): honesty.coverage_fidelity(   # the expert's calls
        model, tokenizer, tasks, counts, would_rehearse, world)
    fx.honesty = lambda model, tokenizer, tasks, cfg, generator: honesty.imagined_world(
        model, tokenizer, tasks, cfg, generator, world, sample=fx.sample)
    return fx


def chat_features(cfg, tokenizer, splits, device):
    """A chat model on chat JSONL tasks (chat.py); inline or separate rehearsal rows."""
    multi_turn = multiturn.multiturn(splits["rl"] + splits["test"] + splits["logged"])
    tags = chat_setup.chat_tags(tokenizer, cfg["think"], multi_turn)   # a template that does not fit: one line, here
    if multi_turn and cfg["rehearsal_context"] == "separate":
        raise ConfigError("rehearsal_context: separate does not support multi-turn tasks ('turns', or logged "
                          "trajectories with several user turns): use rehearsal_context: inline")
    if multi_turn and cfg["rehearsal_budget"]:
        raise ConfigError("rehearsal_budget > 0 (private rehearsal) does not support multi-turn tasks ('turns'): "
                          "its plans do not follow user turns; set rehearsal_budget: 0")
    chat_setup.check_chat_prompts(cfg, tokenizer, splits["rl"] + splits["test"])
    k = cfg["grounding_examples"]
    counts = Counter([c for t in splits["logged"] for c in t["calls"]]
                     + [json.dumps(c, ensure_ascii=False) for t in splits["rl"] for c, _ in t.get("examples", [])])

    def inputs(tasks, repeat=1):
        prompts, worlds = chat_setup.episode_inputs(tokenizer, tags, tasks, cfg["tool_timeout"])
        return [p for p in prompts for _ in range(repeat)], [w for w in worlds for _ in range(repeat)], tags

    fx = SimpleNamespace(inputs=inputs, executes=chat.has_executor, step_extras=no_extras, eval_extras=no_extras,
                         reward=functools.partial(chat_reward.chat_reward,
                                                  judge=chat_setup.load_judge(cfg, device)))
    fx.diagnostics = functools.partial(chat_honesty.diagnostics, reward=fx.reward)
    fx.honesty = lambda model, tokenizer, tasks, cfg, generator: chat_honesty.imagined_world(   # executor tasks
        model, tokenizer, tasks, cfg, generator, fx)
    if cfg["rehearsal_context"] == "inline":
        fx.sample, fx.warm_start_roles = sample_episodes, (ACT, REHEARSE, OBS)
        fx.warm_start_sequences = lambda: chat_setup.warm_start_sequences(
            tokenizer, tags, splits["logged"], splits["rl"])
        would_rehearse = functools.partial(chat_honesty.would_rehearse_inline, tags=tags)
    else:
        fx.sample = functools.partial(separate.sample_separate,
                                      rehearse_prompt=functools.partial(chat_separate.separate_prompt, tokenizer, k))
        fx.warm_start_roles = (ACT, REHEARSE)
        fx.warm_start_sequences = lambda: chat_separate.separate_warm_start_sequences(
            tokenizer, tags, splits["logged"], splits["rl"], k)
        would_rehearse = functools.partial(chat_separate.would_rehearse_separate, tags=tags, k=k)
    fx.would_rehearse, fx.by_kind = would_rehearse, chat_honesty.by_kind
    fx.coverage = lambda model, tokenizer, tasks, pairs=None: honesty.fidelity_by_coverage(   # None: gold calls
        would_rehearse(model, tokenizer, *chat_setup.expert_episodes(tokenizer, tags, tasks)) if pairs is None
        else pairs, counts)
    return fx


def uncertain_features(cfg, tokenizer, splits):
    """`world: uncertain` (world_uncertain.py): the toy's plain features on the stale logs, plus,
    per subset of items (uncertain / faithful), the world model's probability of the true price
    every RL step and evaluation, the RL batch's sampled price fidelity and collusion counts, and
    at evaluation the success per subset of test tasks and in an imagined world sampled at T = 1."""
    uncertain = world_uncertain.uncertain_set(cfg["data_seed"], cfg["uncertain_items"])
    fx = plain_features(cfg, tokenizer, splits, snippets=world_uncertain.tool_snippets(cfg))
    limits = {k: cfg[k] for k in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}

    def step_extras(model, episodes, tasks):
        extras = {"truth": world_uncertain.truth_probe(model, tokenizer, uncertain, cfg["temperature"])}
        if cfg["env_mode"] in ("rehearse", "frozen"):       # who played the world: policy or simulator
            extras["price_fidelity_subsets"] = world_uncertain.subset_fidelity(episodes, uncertain)
            extras["collusion_subsets"] = world_uncertain.collusion_by_subset(episodes, tasks, uncertain)
        return extras

    def eval_extras(model, tasks, episodes, rewards):
        imagined = sample_episodes(model, tokenizer, [t["prompt"] for t in tasks[:cfg["n_collusion"]]], "rehearse",
                                   world=world, temperature=1.0, generator=torch.Generator().manual_seed(cfg["seed"]),
                                   **limits)
        return {"truth": world_uncertain.truth_probe(model, tokenizer, uncertain, cfg["temperature"]),
                "success_by_subset": world_uncertain.success_by_subset(tasks, rewards, uncertain),
                "imagined_sampled": world_uncertain.success_by_subset(
                    tasks, [task_reward(e, t) for e, t in zip(imagined, tasks)], uncertain),
                "imagined_collusion_subsets": world_uncertain.collusion_by_subset(imagined, tasks, uncertain)}

    fx.step_extras, fx.eval_extras, fx.uncertain = step_extras, eval_extras, uncertain
    return fx


def choice_features(cfg, tokenizer, splits):
    """`world: choice` (world_choice.py): the sampler's prompts are the tasks' commit prompts with
    an empty memory (`... memory`: evaluate.py's real-world evaluation is N = 0); the reward is
    world_choice.choice_reward (the first act must be the right purchase); the warm start reads
    world_choice.warm_start_sequences (explore and memory-reading commit episodes, lookups); in
    rehearse and frozen RL `sample` is world_choice.sample_with_memory (the current policy
    imagines N = 0..memory_max episodes per row, the committed row reads their memory). Fidelity
    (the gate, would-rehearse, coverage) is read on the expert's lookups of the tasks, since a
    committed episode makes none; honesty is the imagined world on the explore prompts."""
    w = world_choice
    counts = Counter([c for t in splits["logged"] for c in t["calls"]] + [c for s in w.tool_snippets(cfg)
                                                                          for c in s["calls"]])
    fx = SimpleNamespace(
        inputs=lambda tasks, repeat=1: ([w.commit_prompt(t["prompt"], []) for t in tasks for _ in range(repeat)], w,
                                        None),
        executes=lambda task: True, reward=w.choice_reward, step_extras=no_extras, eval_extras=no_extras,
        warm_start_roles=(ACT, REHEARSE, OBS), warm_start_sequences=lambda: w.warm_start_sequences(tokenizer, splits, cfg),
        sample=functools.partial(w.sample_with_memory, memory_max=cfg["memory_max"],
                                 imagine_temperature=cfg["imagine_temperature"]),
        diagnostics=lambda episodes, tasks: {"fidelity": honesty.replay_fidelity(episodes, w),
                                             "collusion": honesty.collusion_counts(episodes, tasks, w)})
    fx.would_rehearse = lambda model, tokenizer, tasks, episodes: honesty.would_rehearse_calls(
        model, tokenizer, w.expert_episodes(tokenizer, tasks))
    fx.by_kind = lambda pairs, tasks: honesty.by_kind(pairs, w)
    fx.coverage = lambda model, tokenizer, tasks, pairs=(): honesty.fidelity_by_coverage(
        pairs or fx.would_rehearse(model, tokenizer, tasks, None), counts)
    fx.honesty = lambda model, tokenizer, tasks, cfg, generator: honesty.imagined_world(
        model, tokenizer, tasks, cfg, generator, w)
    return fx
