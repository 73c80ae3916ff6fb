"""`world: choice` (worlds/choice.py: buy the cheapest of K items, one real call per task, private
rehearsal by a rehearsal memory). The sampler's prompts are the tasks' commit prompts with an
empty memory (`... memory`: evaluate.py's real-world evaluation is N = 0); the reward is
world_choice.choice_reward (the first act must be the right purchase); the warm start reads
world_choice.warm_start_sequences (explore and memory-reading commit episodes, lookups); in
rehearse and frozen RL the sampler is world_choice.sample_with_memory (the current policy imagines
N = 0..memory_max episodes per row, the committed row reads their memory). Fidelity (the gate,
would-rehearse, coverage) is read on the expert's lookups of the tasks, since a committed episode
makes none; the imagined world is sampled on the explore prompts. Same functions as every format
module; the rest are the plain format's (formats/format_plain.py)."""
from collections import Counter

from worldmodel import honesty
from worlds import choice as world_choice
from formats.format_plain import (by_kind, diagnostics, eval_extras, executes,  # the rest: the
                                  sample, step_extras, warm_start_roles)        # plain format's
from formats.format_plain_separate import rl_sample                          # the layout's sampler in RL
from formats.setting import ChoiceSetting, loop_fields, rl_sampler_for


def setup(cfg, tokenizer, splits, device="cpu"):
    """The setting: this world, the warm-start counts of each call (logged tasks and lookup
    snippets), the warm-start rows (world_choice.warm_start_sequences, built here from the config),
    and the sampler with its memory (in RL when the world is sampled; else the inline one)."""
    counts = Counter([c for t in splits["logged"] for c in t["calls"]]
                     + [c for s in world_choice.tool_snippets(cfg) for c in s["calls"]])
    sampler = world_choice.sample_with_memory
    args = {"memory_max": cfg["memory_max"], "imagine_temperature": cfg["imagine_temperature"]}
    rl_sampler, rl_args = rl_sampler_for(cfg, sampler, args)
    return ChoiceSetting(**loop_fields(cfg), world=world_choice, tokenizer=tokenizer, tags=None, counts=counts,
                         warm_start_rows=world_choice.warm_start_sequences(tokenizer, splits, cfg),
                         sampler=sampler, sampler_args=args, rl_sampler=rl_sampler, rl_sampler_args=rl_args)


def inputs(setting, tasks, repeat=1):
    """(prompts, worlds, tags): each task's commit prompt with an empty memory, `repeat` times; this world."""
    return [world_choice.commit_prompt(t["prompt"], []) for t in tasks for _ in range(repeat)], world_choice, None


def reward(setting, episode, task):
    """world_choice.choice_reward: 1 iff the first act bought the cheapest item."""
    return world_choice.choice_reward(episode, task)


def warm_start_sequences(setting):
    """world_choice.warm_start_sequences (built at setup): explore and commit episodes of the
    logged tasks, lookups."""
    return setting.warm_start_rows


def would_rehearse(setting, model, tokenizer, tasks, episodes):
    """[(call, matched)] on the expert's lookups of `tasks` (world_choice.expert_episodes); the
    `episodes` (committed: no lookups) are not read."""
    return honesty.would_rehearse_calls(model, tokenizer, world_choice.expert_episodes(tokenizer, tasks))


def coverage(setting, model, tokenizer, tasks, pairs=None):
    """Fidelity by warm-start coverage on `pairs`, or when there are none on the expert's lookups."""
    return honesty.fidelity_by_coverage(pairs or would_rehearse(setting, model, tokenizer, tasks, None),
                                        setting.counts)


def imagined_world(setting, model, tokenizer, tasks, cfg, generator):
    """honesty.imagined_world on the explore prompts, in this world (inline sampling, no memory)."""
    return honesty.imagined_world(model, tokenizer, tasks, cfg, generator, world_choice)
