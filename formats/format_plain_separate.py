"""The toy's plain format with `rehearsal_context: separate`: each rehearsal a row of its own
(worldmodel/separate.py, the official code's layout), grounded by up to grounding_examples
examples from the tool cache of training traffic (worldmodel/toolcache.py), in training and
evaluation alike. What differs from the inline layout (formats/format_plain.py) is the sampler,
the warm-start rows and roles, and where the model is asked to rehearse; the rest is plain's.

    python train.py --config configs/separate.yaml
"""
import dataclasses
import functools

from worldmodel import separate, toolcache
from envace import ACT, REHEARSE
from formats import format_plain
from formats.setting import rl_sampler_for
from formats.format_plain import (by_kind, diagnostics, eval_extras, executes, imagined_world,  # the rest:
                                  inputs, reward, sample, step_extras)                            # plain's


def setup(cfg, tokenizer, splits, device="cpu"):
    """format_plain's setting, the sampler separate.sample_separate and its grounding: `examples`
    (toolcache.examples over the cache, k = grounding_examples). The rehearse prompt's words must
    be in the vocabulary (separate.check_vocabulary)."""
    separate.check_vocabulary(cfg, tokenizer)
    setting = format_plain.setup(cfg, tokenizer, splits)
    examples = functools.partial(toolcache.examples, setting.cache, k=cfg["grounding_examples"])
    sampler, args = separate.sample_separate, {"examples": examples}
    rl_sampler, rl_args = rl_sampler_for(cfg, sampler, args)        # a toy task has no examples of its own
    return dataclasses.replace(setting, examples=examples, sampler=sampler, sampler_args=args,
                               rl_sampler=rl_sampler, rl_sampler_args=rl_args)


def rl_sample(setting, model, tokenizer, prompts, world, tags, env_model, generator):
    """RL's sampler, chosen at setup (formats/setting.rl_sampler_for) with env_mode and the
    config's sampling keys (setting.sampling, its `settings`, with `tags`): the layout's with its
    training arguments when the policy (or the frozen warm start, `env_model`) plays the world,
    inline rollout.sample_episodes when the real world (or none) answers. world, tags: from `inputs`.
    The layouts whose sampler is not the inline one (world: choice, chat's separate layout) share it."""
    return setting.rl_sampler(model, tokenizer, prompts, setting.env_mode, **setting.rl_sampler_args, world=world,
                              env_model=env_model, generator=generator, settings={**setting.sampling, "tags": tags})


def warm_start_sequences(setting):
    """A group of rows per logged episode or snippet: its actor row and a grounded rehearse row per
    call (separate.warm_start_sequences)."""
    return separate.warm_start_sequences(setting.tokenizer, setting.logged, setting.snippets, setting.examples)


def warm_start_roles(setting):
    """Separate rows train ACT and REHEARSE (an actor row's responses are context)."""
    return (ACT, REHEARSE)


def would_rehearse(setting, model, tokenizer, tasks, episodes):
    """[(call, matched)]: asked in separate rows with the tool cache's grounding examples
    (separate.would_rehearse_separate)."""
    return separate.would_rehearse_separate(model, tokenizer, episodes, examples=setting.examples)


def coverage(setting, model, tokenizer, tasks, pairs=None):
    """format_plain.expert_coverage, asked in separate rows."""
    return format_plain.expert_coverage(setting, model, tokenizer, tasks, would_rehearse)
