"""The setting: what a format module's functions read, built once by its `setup(cfg, tokenizer,
splits, device)` (formats/features.py picks the module). Typed, and no config inside: every
config key a function needs is read at setup into a field of its own.

    Setting           what every format has: who plays the world in RL, the sampler's settings,
                      the sampler chosen for the layout, the tags and the tool cache
    PlainSetting      the toy shop (formats/format_plain.py, format_plain_separate.py): its world,
                      logged episodes and tool snippets, the grounding examples (separate)
    UncertainSetting  world: uncertain (formats/format_uncertain.py): the stale items, and the
                      keys of its own figures
    ChoiceSetting     world: choice (formats/format_choice.py): the warm-start counts and rows
    ChatSetting       format: chat (formats/format_chat.py, format_chat_separate.py): the
                      template's tags, the RL tasks (their reference examples), the judge

The sampler is chosen here once, in two fields: `sampler` (with `sampler_args`) is the layout's,
used wherever the policy plays the world at evaluation; `rl_sampler` (with `rl_sampler_args`) is
RL's in the layouts whose rows are their own (separate, world: choice), the layout's when
env_mode's world is sampled (rehearse, frozen: the training arguments, e.g. a chat task's own
reference examples first) and the inline sampler when the real world or none answers
(`rl_sampler_for`). The inline formats leave it unset: their RL sampler is rollout.sample_episodes
(format_plain.rl_sample).
"""
import dataclasses
from typing import Any, Callable

import rehearse
import rollout
from envace import world_is_sampled
from rollout import sample_episodes


@dataclasses.dataclass(kw_only=True)
class Setting:
    env_mode: str                      # config env_mode: who answers the policy's calls in RL
    sampling: dict                     # RL's sampler settings: temperature, top_p, the limits, rehearse_check
    tokenizer: Any
    tags: dict | None                  # the hand-off ids (world: choice: None, the sampler's own)
    sampler: Callable                  # the layout's sampler (evaluation, private rehearsal, imagined world)
    sampler_args: dict
    rl_sampler: Callable | None = None     # RL's sampler in a layout of its own (rl_sampler_for; read by
    rl_sampler_args: dict | None = None    # format_plain_separate.rl_sample); inline: rollout.sample_episodes
    cache: dict | None = None          # the tool cache of training traffic (worldmodel/toolcache.py)

    @property
    def rehearsed(self):
        """Whether the policy or the frozen warm start plays the world in RL (envace.world_is_sampled)."""
        return world_is_sampled(self.env_mode)


@dataclasses.dataclass(kw_only=True)
class PlainSetting(Setting):
    world: Any                         # the world module: world.py's parse_call, step, replay
    logged: list                       # [(logged task, its responses)]
    snippets: list                     # the logged tool traffic outside tasks (world.tool_snippets)
    examples: Callable | None = None   # call -> grounding examples from the cache (separate layout)


@dataclasses.dataclass(kw_only=True)
class UncertainSetting(PlainSetting):
    uncertain: set                     # the items whose logs are stale
    probe_temperature: float           # config temperature: the truth probe's
    seed: int                          # config seed: the imagined world's generator at evaluation
    n_collusion: int                   # config n_collusion: tasks of the imagined world
    limits: dict                       # rollout.limits(cfg)


@dataclasses.dataclass(kw_only=True)
class ChoiceSetting(Setting):
    world: Any                         # worlds/choice.py
    counts: dict                       # call -> times in the warm-start data
    warm_start_rows: list              # world_choice.warm_start_sequences, built at setup


@dataclasses.dataclass(kw_only=True)
class ChatSetting(Setting):
    logged: list                       # logged trajectories (chat/tasks.py)
    tasks: list                        # the RL tasks: their reference examples
    k: int                             # config grounding_examples
    tool_timeout: float
    judge: Callable | None             # chat_reward's judge (config judge_model), or None


def loop_fields(cfg):
    """The fields every setting takes from the config: env_mode (whether its world is sampled,
    `Setting.rehearsed`, is derived from it) and RL's sampler settings."""
    return {"env_mode": cfg["env_mode"], "sampling": sampling_args(cfg)}


def sampling_args(cfg):
    """RL's sampler settings from the config (rollout.sample_episodes' `settings`): temperature,
    top_p, the limits (rollout.sampling) and the rehearsal guard (rehearse.check_rehearsal, or None)."""
    return rollout.sampling(cfg, rehearse_check=rehearse.check_rehearsal if cfg["rehearse_check"] else None)


def rl_sampler_for(cfg, sampler, rl_args):
    """(rl_sampler, rl_sampler_args): the layout's sampler with its training arguments when
    env_mode's world is sampled; the inline sampler with none when the real world (or none) answers."""
    return (sampler, rl_args) if world_is_sampled(cfg["env_mode"]) else (sample_episodes, {})
