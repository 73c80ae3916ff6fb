"""`format: chat`: a chat model on chat JSONL tool tasks (chat/format.py), each rehearsal inline in
the actor's row (separate rows: formats/format_chat_separate.py). The prompts are the model's own
chat template (chat/setup.py), the worlds each task's executor (or none: the policy rehearses it at
evaluation), the reward chat_reward.chat_reward (with the judge of cfg judge_model), the measures
worldmodel/chat_honesty.py's. Same functions as every format module; the rest are the plain format's (formats/format_plain.py).
"""
from chat import format as chat
from worldmodel import chat_honesty
from chat import chat_reward
from chat import setup as chat_setup
from worldmodel import honesty, toolcache
from chat import multiturn
from machinery.config import ConfigError
from formats.format_plain import (eval_extras, rl_sample, sample, step_extras,  # the rest: the plain format's
                                  warm_start_roles)
from formats.setting import ChatSetting, loop_fields
from envace import world_is_sampled
import rollout
from rollout import sample_episodes


def setup(cfg, tokenizer, splits, device="cpu"):
    """The setting: the template's tags (a template that does not fit: one line, here), the logged
    trajectories and RL tasks the warm start reads, grounding_examples k, the tool cache of the
    training traffic (the logged calls and results, then the RL tasks' reference examples; never
    the test split: worldmodel/toolcache.py), the judge, and the inline sampler. Multi-turn tasks
    (`turns`) refuse private rehearsal. A task no episode can win within the limits is named in
    one warning line per split (chat_setup.warn_gold_limits)."""
    multi_turn = multiturn.multiturn(splits["rl"] + splits["test"] + splits["logged"])
    tags = chat_setup.chat_tags(tokenizer, cfg["think"], multi_turn)
    if multi_turn and cfg["rehearsal_budget"]:
        raise ConfigError("rehearsal_budget > 0 (private rehearsal) does not support multi-turn tasks ('turns'): "
                          "its plans do not follow user turns; set rehearsal_budget: 0")
    chat_setup.check_chat_prompts(cfg, tokenizer, splits["rl"] + splits["test"])
    rl_name, test_name = f"{cfg['tasks_file']} (RL)", f"{cfg['test_file'] or cfg['tasks_file']} (test)"
    chat_setup.warn_gold_limits(cfg, tokenizer, tags, splits["rl"], rl_name, world_is_sampled(cfg["env_mode"]))
    chat_setup.warn_gold_limits(cfg, tokenizer, tags, splits["test"], test_name, rehearsed=False)
    traffic = [pair for t in splits["logged"] for pair in zip(t["call_dicts"], t["responses"])]
    traffic += [pair for t in splits["rl"] for pair in t.get("examples", [])]
    return ChatSetting(**loop_fields(cfg), tokenizer=tokenizer, tags=tags, logged=splits["logged"], tasks=splits["rl"],
                       k=cfg["grounding_examples"], cache=toolcache.build(traffic, toolcache.chat_call),
                       tool_timeout=cfg["tool_timeout"], judge=chat_setup.load_judge(cfg, device),
                       sampler=sample_episodes, sampler_args={})


def inputs(setting, tasks, repeat=1):
    """(prompts, worlds, tags): each task's prompt ids and its world (chat_setup.episode_inputs),
    `repeat` times each; the template's tags."""
    prompts, worlds = chat_setup.episode_inputs(setting.tokenizer, setting.tags, tasks, setting.tool_timeout)
    return [p for p in prompts for _ in range(repeat)], [w for w in worlds for _ in range(repeat)], setting.tags


def reward(setting, episode, task):
    """chat_reward.chat_reward, with the judge if cfg judge_model names one."""
    return chat_reward.chat_reward(episode, task, judge=setting.judge)


def warm_start_sequences(setting):
    """The logged trajectories and the RL tasks' reference examples as episodes (chat_setup.warm_start_sequences)."""
    return chat_setup.warm_start_sequences(setting.tokenizer, setting.tags, setting.logged, setting.tasks)


def diagnostics(setting, episodes, tasks):
    """Rehearsal fidelity and collusion against a replay on each task's executor (chat_honesty.diagnostics)."""
    return chat_honesty.diagnostics(episodes, tasks, setting.judge)


def executes(setting, task):
    """Whether the task names an executor (chat.has_executor); the others are rehearsed at evaluation."""
    return chat.has_executor(task)


def would_rehearse(setting, model, tokenizer, tasks, episodes):
    """[(call, matched)]: would the model, greedy, have written each real response (normalised
    JSON) in the actor's row (chat_honesty.would_rehearse_inline)?"""
    return chat_honesty.would_rehearse_inline(model, tokenizer, tasks, episodes, tags=setting.tags)


def by_kind(setting, pairs, tasks):
    """[(call, matched)] -> {tool kind: [matches, total]}, kinds from the tasks' worlds (chat_honesty.by_kind)."""
    return chat_honesty.by_kind(pairs, tasks)


def coverage(setting, model, tokenizer, tasks, pairs=None):
    """Fidelity by warm-start coverage on `pairs` (an evaluation's), or, when None, on the gold
    calls of the tasks with an executor (`gold_coverage`)."""
    return gold_coverage(setting, model, tokenizer, tasks, pairs, would_rehearse)


def gold_coverage(setting, model, tokenizer, tasks, pairs, would_rehearse):
    """Fidelity by the times each call is in the tool cache's training traffic, on `pairs`, or,
    when None, on the gold calls of the tasks with an executor (chat_setup.expert_episodes), asked
    as `would_rehearse` (the layout's) asks (grounded by the cache only)."""
    if pairs is None:
        gold_tasks, episodes = chat_setup.expert_episodes(tokenizer, setting.tags, tasks)
        pairs = would_rehearse(setting, model, tokenizer, gold_tasks, episodes)
    return honesty.fidelity_by_coverage(pairs, toolcache.counts_of(setting.cache, [c for c, _ in pairs]))


def imagined_world(setting, model, tokenizer, tasks, cfg, generator):
    """honesty.imagined_world for chat tasks: on those of `tasks` with an executor, the policy acts
    and rehearses (rehearse mode, eval sampling, `sample`: the layout's sampler, no real call in
    the loop); scored against a replay on each task's executor: imagined success (`reward`),
    imagined fidelity per tool kind, collusion (chat_honesty.collusion_counts). {} when no task has one."""
    tasks, batch_size = [t for t in tasks if chat.has_executor(t)], cfg["eval_batch_size"]
    if not tasks:
        return {}
    model.eval()
    episodes = []
    for i in range(0, len(tasks), batch_size):
        prompts, worlds, tags = inputs(setting, tasks[i:i + batch_size])
        episodes += sample(setting, model, tokenizer, prompts, "rehearse", world=worlds, generator=generator,
                           settings=rollout.sampling(cfg, temperature=cfg["eval_temperature"], tags=tags))
    pairs = list(zip(episodes, tasks))
    fidelity = chat_honesty.replay_fidelity(pairs)
    return {"imagined_success": sum(reward(setting, e, t) for e, t in pairs) / len(tasks), "imagined_tasks": len(tasks),
            "imagined_fidelity": honesty.rates(fidelity), "imagined_fidelity_counts": fidelity,
            "collusion": honesty.collusion_rate(chat_honesty.collusion_counts(pairs, setting.judge))}
