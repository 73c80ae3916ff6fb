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
train.py and evaluate.py call them (`fmt.rl_sample(setting, ...)`) and never branch on the format
or the layout. What each function does: formats/format_plain.py's docstring.
Here too: the splits (`build_tasks`) and the tiny model's vocabulary (`tiny_words`).
"""
from chat import setup as chat_setup
from formats import format_chat
from formats import format_chat_separate
from formats import format_choice
from formats import format_plain
from formats import format_plain_separate
from formats import format_uncertain
from worldmodel import separate
from machinery import taskfiles
import world
from worlds import choice as world_choice
from worlds import uncertain as world_uncertain
from machinery.config import ConfigError

FORMATS = (format_plain, format_plain_separate, format_uncertain, format_choice, format_chat, format_chat_separate)
INTERFACE = ("setup", "inputs", "sample", "rl_sample", "reward", "warm_start_sequences", "warm_start_roles",
             "diagnostics", "executes", "would_rehearse", "by_kind", "coverage", "imagined_world",
             "step_extras", "eval_extras")


def build_tasks(cfg):
    """The splits: generated from the toy world (data_seed), or read from JSONL files where the
    config names them (chat: always files, chat_tasks.read_chat_jsonl). Every file line is checked
    here, before anything is built or trained."""
    if cfg["format"] == "chat":
        return held_out_validation(chat_setup.chat_tasks(cfg), cfg["n_val"])
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
