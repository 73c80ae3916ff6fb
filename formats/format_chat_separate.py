"""`format: chat` with `rehearsal_context: separate`: each rehearsal a row of its own in the model's
own template (worldmodel/chat_separate.py), the official code's layout: the rehearse prompt holds
the called tool's schema, up to grounding_examples real (call -> result) pairs and the dialogue so
far. In RL a task's own reference examples ground its rehearsals first, then the tool cache of
training traffic; in evaluation the cache only (worldmodel/toolcache.py: never a test task's own
results). What differs from the inline layout (formats/format_chat.py) is the sampler, the
warm-start rows and roles, and where the model is asked to rehearse; the rest is format_chat's.

    python train.py --config configs/smollm2-separate.yaml
"""
import dataclasses
import functools

from worldmodel import chat_separate, separate
from chat import multiturn
from formats import format_chat
from formats.format_chat import (by_kind, diagnostics, eval_extras, executes, imagined_world,  # the rest:
                                 inputs, reward, sample, step_extras)                           # format_chat's
from formats.format_plain_separate import rl_sample, warm_start_roles
from formats.setting import rl_sampler_for
from machinery.config import ConfigError


def setup(cfg, tokenizer, splits, device="cpu"):
    """format_chat's setting, the sampler separate.sample_separate with the chat rehearse prompt
    (chat_separate.separate_prompt, built per rehearsal): in evaluation grounded by the cache only,
    in RL by the task's own examples first (`own_examples`). Multi-turn tasks refuse this layout,
    naming the file that holds them."""
    for key, split in (("tasks_file", "rl"), ("test_file", "test"), ("logged_file", "logged")):
        if multiturn.multiturn(splits[split]):
            raise ConfigError(f"rehearsal_context: separate does not support multi-turn tasks, and {key} "
                              f"{cfg[key]} has them ('turns', or logged trajectories with several user turns): "
                              f"set rehearsal_context: inline (for SmolLM2: configs/smollm2.yaml, not "
                              f"configs/smollm2-separate.yaml)")
    setting = format_chat.setup(cfg, tokenizer, splits, device)
    prompt = functools.partial(chat_separate.separate_prompt, tokenizer, setting.k, cache=setting.cache)
    sampler, args = separate.sample_separate, {"rehearse_prompt": prompt}
    rl_sampler, rl_args = rl_sampler_for(cfg, sampler, {"rehearse_prompt": functools.partial(prompt, own_examples=True)})
    return dataclasses.replace(setting, sampler=sampler, sampler_args=args, rl_sampler=rl_sampler,
                               rl_sampler_args=rl_args)


def warm_start_sequences(setting):
    """A group of actor and rehearse rows per logged trajectory and RL task's reference example
    (chat_separate.separate_warm_start_sequences, k grounding examples: a row's own first, then the cache's)."""
    return chat_separate.separate_warm_start_sequences(setting.tokenizer, setting.tags, setting.logged,
                                                       setting.tasks, setting.k, setting.cache)


def would_rehearse(setting, model, tokenizer, tasks, episodes):
    """[(call, matched)]: asked in separate rehearse rows, k grounding examples from the tool cache
    only (chat_separate.would_rehearse_separate)."""
    return chat_separate.would_rehearse_separate(model, tokenizer, tasks, episodes, tags=setting.tags,
                                                 k=setting.k, cache=setting.cache)


def coverage(setting, model, tokenizer, tasks, pairs=None):
    """format_chat.gold_coverage, asked in separate rows."""
    return format_chat.gold_coverage(setting, model, tokenizer, tasks, pairs, would_rehearse)
