"""Features chosen once at setup: the task format and the rehearsal layout, as one module of plain functions.

    format: plain               the toy's tags and world (world.py, the demo)
            chat                the model's chat template, JSON tool calls, JSONL tasks
    rehearsal_context: inline   the response written in the actor's own row (rollout.py, the demo)
                       separate every rehearsal a row of its own (worldmodel/separate.py)
    world: uncertain, choice    the toy's experiment worlds (inline only)

                        inline                          separate
    format: plain       formats/format_plain.py         formats/format_plain_separate.py
    format: chat        formats/format_chat.py          formats/format_chat_separate.py
    world: uncertain    formats/format_uncertain.py
    world: choice       formats/format_choice.py

`setup(cfg, tokenizer, splits, device)` looks at these keys once and returns (fmt, setting): the
format module and its setting (formats/setting.py, a dataclass). Every format module defines the same functions with the
same signatures (INTERFACE; tests/test_layout.py checks it), each but setup taking the setting first;
evaluate.py calls them (`fmt.sample(setting, ...)`) and never branches on the format or the layout;
train.py's RL loop calls the sampler and reward `sampler_and_reward` chose (the toy with inline
rehearsal, the demo: rollout.sample_episodes and reward.task_reward themselves; another layout its
module's `rl_sample` and `reward` through `layout_sampler`), and the step's diagnostics
`step_diagnostics` chose (none in the demo). What each function does: formats/format_plain.py's docstring.
Here too: the splits (`build_tasks`) and the tiny model's vocabulary (`tiny_words`).
"""
import contextlib
import functools

from chat import setup as chat_setup
from formats import format_chat
from formats import format_chat_separate
from formats import format_choice
from formats import format_plain
from formats import format_plain_separate
from formats import format_uncertain
from worldmodel import separate
from formats import dynamic_sampling
from machinery import config, taskfiles
from machinery.distributed import gathered
import rollout
import world
from worlds import choice as world_choice
from worlds import uncertain as world_uncertain
from machinery.config import ConfigError

FORMATS = (format_plain, format_plain_separate, format_uncertain, format_choice, format_chat, format_chat_separate)
INTERFACE = ("setup", "inputs", "sample", "rl_sample", "reward", "warm_start_sequences", "warm_start_roles",
             "diagnostics", "executes", "would_rehearse", "by_kind", "coverage", "imagined_world",
             "step_extras", "eval_extras")


def check_prompt_lengths(cfg, tokenizer, model_config, tasks):
    """Every prompt of `tasks` leaves room for an episode in the model's context and in max_tokens
    (chat: chat_setup.check_chat_prompts, with the model's max_position_embeddings; then
    config.check_lengths): one line naming the longest prompt, both numbers and what to set."""
    if cfg["format"] == "chat":
        chat_setup.check_chat_prompts(cfg, tokenizer, tasks, getattr(model_config, "max_position_embeddings", None))
    config.check_lengths(cfg, tokenizer, model_config, tasks)


def build_tasks(cfg):
    """The splits: generated from the toy world (data_seed), or read from JSONL files where the
    config names them (chat: always files, chat_tasks.read_chat_jsonl). Every file line is checked
    here, before anything is built or trained."""
    if cfg["format"] == "chat":                  # a test file's first n_test tasks
        splits = chat_setup.chat_tasks(cfg)
        return held_out_validation({**splits, "test": splits["test"][:cfg["n_test"]]}, cfg["n_val"])
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
    return held_out_validation(splits, cfg["n_val"])


def held_out_validation(splits, n_val):
    """The last `n_val` RL tasks as the validation split ("val"), out of RL's: a recipe is chosen on
    them, never on the test split. ConfigError if that leaves no RL task."""
    if n_val and n_val >= len(splits["rl"]):
        raise ConfigError(f"n_val ({n_val}) takes every one of the {len(splits['rl'])} RL tasks: validation "
                          f"tasks are held out of RL's; lower n_val or give more RL tasks")
    kept = len(splits["rl"]) - n_val
    return {**splits, "rl": splits["rl"][:kept], "val": splits["rl"][kept:]}


def tiny_words(cfg):
    """The vocabulary of `model: tiny`: the toy world's words (and the separate prompt's, and
    world: choice's task and memory words)."""
    return (world.WORDS + (separate.SEPARATE_WORDS if cfg["rehearsal_context"] == "separate" else [])
            + (world_choice.NEW_WORDS if cfg.get("world") == "choice" else []))


def choose(cfg):
    """The format module for this cfg, chosen once (the table above): by format and
    rehearsal_context, or by world (uncertain, choice: the toy, inline)."""
    if cfg["world"] in ("uncertain", "choice"):
        return {"uncertain": format_uncertain, "choice": format_choice}[cfg["world"]]
    return {("plain", "inline"): format_plain, ("plain", "separate"): format_plain_separate,
            ("chat", "inline"): format_chat, ("chat", "separate"): format_chat_separate}[
        cfg["format"], cfg["rehearsal_context"]]


def setup(cfg, tokenizer, splits, device="cpu"):
    """(fmt, setting): the format module for this cfg (`choose`) and its setting (fmt.setup), which
    every call of the format takes first: fmt.inputs(setting, tasks, G)."""
    fmt = choose(cfg)
    return fmt, fmt.setup(cfg, tokenizer, splits, device)


def sampler_and_reward(fmt, setting, cfg, rl_tasks, amp, task_rng, simulator=None):
    """RL's sampler and reward, chosen once at setup, for train.py's loop: `sample(model,
    prompts=tasks, generator=...)` -> one episode per task given (each task group_size times), in
    env_mode's world (`simulator`: the frozen warm start that plays it in frozen mode), and
    `reward(episode, task)`. The toy with inline rehearsal (the demo) gets the paper's sampler
    itself, rollout.sample_episodes bound with its settings, and reward.task_reward; another layout
    its module's (`layout_sampler`, fmt.reward). Under bf16 autocast or FSDP the sampler runs inside
    both (`in_context`); max_sample_rounds > 1 wraps it in DAPO's dynamic sampling, which draws its
    extra rounds of tasks from `task_rng` (formats/dynamic_sampling.py)."""
    if fmt.rl_sample is format_plain.rl_sample and fmt.inputs is format_plain.inputs:    # the toy, inline
        sample = functools.partial(rollout.sample_episodes, tokenizer=setting.tokenizer, env_mode=setting.env_mode,
                                   world=setting.world, env_model=simulator,
                                   settings={**setting.sampling, "tags": setting.tags})
    else:
        sample = functools.partial(layout_sampler, fmt=fmt, setting=setting, simulator=simulator)
    # (format_plain.task_reward is reward.task_reward, the name the toy's evaluation reads too)
    reward = format_plain.task_reward if fmt.reward is format_plain.reward else functools.partial(fmt.reward, setting)
    if not isinstance(amp, contextlib.nullcontext) or cfg["fsdp"]:
        sample = functools.partial(in_context, sample=sample, amp=amp, simulator=simulator)
    if cfg["max_sample_rounds"] > 1:
        sample = functools.partial(dynamic_sampling.sample_until_varied, sample=sample, reward=reward,
                                   rl_tasks=rl_tasks, task_rng=task_rng, cfg=cfg)
    return sample, reward


def layout_sampler(model, prompts, generator, fmt, setting, simulator):
    """A layout's RL sampler with the demo's signature: `prompts` are the tasks, which the format
    turns into its sampler's inputs (fmt.inputs: prompt ids, a world per row, the tags)."""
    inputs, worlds, tags = fmt.inputs(setting, prompts, 1)
    return fmt.rl_sample(setting, model, setting.tokenizer, inputs, worlds, tags, simulator, generator)


def in_context(model, prompts, generator, sample, amp, simulator):
    """`sample` under the run's autocast (bf16) and, under FSDP, with the policy's and the
    simulator's weights gathered once for the whole sampling (distributed.gathered)."""
    with amp, gathered(model), gathered(simulator):
        return sample(model, prompts=prompts, generator=generator)


def step_diagnostics(fmt, setting, cfg, amp):
    """The RL step's diagnostics beside its metrics line, chosen once: None when there are none (the
    demo: replay_fidelity false, the toy world), else `diagnose(model, episodes, tasks)` -> {"replay":
    this rank's fidelity and collusion sums against a real replay of the rehearsed calls (fmt.diagnostics,
    when the policy or the frozen warm start played the world and replay_fidelity), "world": the
    world's own figures (fmt.step_extras: the uncertain world's truth probe)}. Nothing of it is trained."""
    replay = setting.rehearsed and cfg["replay_fidelity"]
    if not replay and fmt.step_extras is format_plain.step_extras:
        return None

    def diagnose(model, episodes, tasks):
        with amp, gathered(model):
            extras = fmt.step_extras(setting, model, episodes, tasks)
        return {"replay": fmt.diagnostics(setting, episodes, tasks) if replay else {}, "world": extras}
    return diagnose
