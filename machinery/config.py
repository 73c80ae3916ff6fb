"""Config: every key, its default and type; a config file is flat YAML of these keys.

    python train.py --config small.yaml --rl_steps=20      # any key as --key=value

`load_config` reads DEFAULTS <- the YAML file (and its bases) <- the overrides and checks every
value (type, range, choices); a mistake is a ConfigError: one line naming the key (and the file,
for a base), exit code 2. A key given twice in one file is such a mistake (YAML would keep the
last one silently). Settings that could never train are refused as well: group_size 1 with RL
steps here; splits smaller than a step, a prompt longer than max_tokens, max_tokens past the
model's positions in train.run (`check_splits`, `check_lengths`), and an out_dir that already
holds a checkpoint unless --resume or --overwrite says what to do with it (`check_out_dir`).

A config file may start from another one, as nanoGPT's config files start from train.py's
globals, and then hold only what differs:

    base: ../small.yaml        # a path relative to the folder of THIS file
    env_mode: real

means: the resolved config of ../small.yaml, then this file's keys on top. Bases chain
(a.yaml -> b.yaml -> small.yaml); a cycle is an error. `base` is not a config key: it never
appears in the returned dict (so the resolved config a run saves as out_dir/config.yaml stands on
its own), and it cannot be given as an override. The checks across keys (n_embd / n_head, the
keys format: chat needs, ...) apply to the final config only: a base need not run by itself.
"""
import argparse
import difflib
import math
import os

import yaml

from envace import ENV_MODES


# Every config key, its default, and therefore its type. First the keys of the paper's path (the
# toy world, warm start, RL with rehearsal, evaluation), then each extension's keys under a heading.
DEFAULTS = {
    "out_dir": "out/run", "seed": 1, "device": "auto", "bf16": True, "save_every": 50,
    # threads: torch's intra-op threads per process (0: torch's default, one per core); set once at setup
    "threads": 0,
    # model: "tiny" builds a small Llama from n_layer/n_embd/n_head; else a path or hub name
    "model": "tiny", "n_layer": 4, "n_embd": 128, "n_head": 4,
    # data: tasks from the toy world (world.py), generated from data_seed
    "data_seed": 0, "n_logged": 3000, "n_new_logged": 20, "n_rl_tasks": 4000, "n_test": 500,
    "snippet_repeats": 20, "coverage": 1.0,
    # world: toy (world.py, the demo) | uncertain (worlds/uncertain.py: the logs of uncertain_items
    # items stale with probability stale_rate, a world the policy must learn from reward)
    "world": "toy", "uncertain_items": 8, "stale_rate": 0.65,
    # | choice (worlds/choice.py: buy the cheapest of choice_items items (choice_kind items) or of
    # choice_items options `Q ITEM` (costs: Q * price), one real call per task;
    # the committed episode reads a rehearsal memory of 0..memory_max imagined episodes; the
    # warm start's synthetic imagined prices are wrong with probability memory_noise)
    "choice_items": 3, "choice_kind": "items", "memory_max": 4, "memory_noise": 0.15,
    # warm start
    "sft_steps": 600, "sft_batch_size": 64, "sft_lr": 1e-3,
    # RL
    "env_mode": "rehearse", "rl_steps": 200, "tasks_per_step": 16, "group_size": 8,
    # DAPO's dynamic sampling: a step draws up to max_sample_rounds rounds of tasks_per_step tasks and
    # updates on the first tasks_per_step groups whose rewards vary (1: one round, every group)
    "max_sample_rounds": 1,
    "lr": 1e-4, "weight_decay": 0.01, "grad_clip": 1.0, "ppo_epochs": 1,
    "micro_batch_tokens": 512, "reuse_sampler_logprobs": True,
    # share_prefix: the ids every row of a micro-batch starts with (a chat system prompt with its tool
    # schemas) run once in the logprob passes and the update, the rows' suffixes on their keys/values
    "share_prefix": True,
    # lean_logprobs: the warm start's and the update's logprobs from machinery/sharedprefix.py (the
    # shared prefix once, the LM head in chunks: the same numbers in less memory); false: the plain
    # definition, envace.token_logprobs (the demo: at its size the lean pass saves nothing)
    "lean_logprobs": True,
    "eps_low": 0.2, "eps_high": 0.2, "dual_clip": 3.0, "kl_coef": 0.0,
    "act_coef": 1.0, "rehearse_coef": 1.0, "scale_std": False,
    # sampling
    "temperature": 1.0, "top_p": 1.0, "max_turns": 6, "max_act_tokens": 8, "max_env_tokens": 6,
    "max_tokens": 96,
    # evaluation; min_fidelity is the gate (rehearse/frozen RL needs every tool kind this faithful);
    # eval_batch_size: test tasks sampled at once (their KV cache is the evaluation's memory)
    "eval_temperature": 0.0, "eval_every": 0, "min_fidelity": 0.95, "eval_batch_size": 512,
    # replay_fidelity: each RL step's rehearsed calls replayed in the real world for the fidelity and
    # collusion figures of metrics.jsonl (a diagnostic: no real response enters the loss)
    "replay_fidelity": True,
    # collusion at evaluation: imagined (rehearse-mode) episodes on the first n_collusion test tasks
    "n_collusion": 200,
    # n_val: validation tasks, the last n_val RL tasks held out of RL; > 0: the evaluations every
    # eval_every steps (the last included) run on them (val_success), the test split only before and after RL
    "n_val": 0,
    # test-time private rehearsal in evaluation (rehearse.py): imagined episodes per task
    "rehearsal_budget": 0, "rehearsal_mode": "parallel", "imagine_temperature": 1.0,

    # --- chat format (chat/format.py)
    # format: plain (the toy's tags) | chat (the model's chat template, JSON tool calls;
    # tasks_file etc. then hold chat JSONL); judge_model: a causal LM scoring task checklists
    "format": "plain", "judge_model": "",
    # a task's own executor (env "MODULE:CLASS", chat/executor.py): a tool call running longer than
    # tool_timeout seconds is an error response
    "tool_timeout": 10.0,
    # think (Qwen3-style templates): keep (the actor's think text stays in the sequence, as
    # sampled) | disable (the template's own switch, enable_thinking false: its empty block is forced)
    "think": "keep",
    # optional JSONL files replacing the generated splits (plain: taskfiles.read_jsonl; chat: chat
    # JSONL, tasks_file required; tasks_file: toy = the toy world's splits as chat tasks, made in
    # memory from data_seed, n_logged, n_new_logged, n_rl_tasks, n_test: chat/setup.py)
    "tasks_file": "", "test_file": "", "logged_file": "",
    # a Jinja file replacing the tokenizer's chat template (models whose own template has no tools:
    # chat/chatml_tools.jinja for ChatML models such as SmolLM2); saved with every checkpoint
    "chat_template": "",
    # --- rehearsal layout (worldmodel/separate.py)
    # where rehearsals are written: inline (in the actor's own sequence) or separate (a row of
    # their own, prompt: tool signature, grounding_examples examples from the tool cache of training
    # traffic (worldmodel/toolcache.py; chat training: the task's own examples first), dialogue, call);
    # advantage baselines per (task, role) or per task (the same thing with inline rehearsal)
    "rehearsal_context": "inline", "advantage_groups": "task_role", "grounding_examples": 0,
    # --- guards against world-model drift
    # KL to the warm start on REHEARSE tokens (kl_coef is the one on ACT tokens); a form check on
    # every rehearsed response (rehearse.check_rehearsal)
    "kl_rehearse_coef": 0.0, "rehearse_check": False,
    # --- big models (machinery/distributed.py)
    # model_init random = the architecture of `model` with random weights (a smoke test of a real
    # size); gradient_checkpointing recomputes layers in backward; fsdp shards under torchrun
    "model_init": "pretrained", "gradient_checkpointing": False, "fsdp": False,
    # bf16 autocast on the CPU too (bf16 is CUDA's); logprobs and the loss stay fp32
    "cpu_bf16": False,
}


CHOICES = {"env_mode": ENV_MODES, "device": ("auto", "cpu", "cuda"),
           "format": ("plain", "chat"), "model_init": ("pretrained", "random"),
           "rehearsal_mode": ("parallel", "sequential"), "rehearsal_context": ("inline", "separate"),
           "advantage_groups": ("task_role", "task"), "think": ("keep", "disable"),
           "world": ("toy", "uncertain", "choice"), "choice_kind": ("items", "costs")}


POSITIVE = {"n_layer", "n_embd", "n_head", "n_logged", "n_rl_tasks", "n_test", "sft_batch_size",
            "tasks_per_step", "group_size", "max_sample_rounds", "ppo_epochs", "micro_batch_tokens", "max_turns",
            "max_act_tokens", "max_env_tokens", "max_tokens", "temperature", "lr", "sft_lr", "tool_timeout",
            "eval_batch_size"}


NON_NEGATIVE = {"seed", "data_seed", "n_new_logged", "snippet_repeats", "sft_steps", "rl_steps", "save_every", "threads",
                "weight_decay", "grad_clip", "eps_low", "eps_high", "kl_coef", "act_coef",
                "rehearse_coef", "eval_temperature", "eval_every", "min_fidelity", "rehearsal_budget",
                "imagine_temperature", "kl_rehearse_coef", "n_collusion", "grounding_examples",
                "uncertain_items", "memory_max", "n_val"}


UNIT = {"coverage", "top_p", "min_fidelity", "stale_rate", "memory_noise"}   # in (0, 1] (min_fidelity, stale_rate,
                                                                          # memory_noise: [0, 1])


class ConfigError(Exception):
    """A user mistake in a config, override, path or data file: one line, exit code 2."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the scripts' command lines, a mistake in one as one line: a ConfigError (the
    caller prints `error: ...`, exit 2) in place of argparse's usage block and its exit."""

    def error(self, message):
        raise ConfigError(f"{message} (--help lists the options)")


def check_value(key, value):
    """Type and range of one config value; returns it (ints are accepted for float keys)."""
    if key not in DEFAULTS:
        close = difflib.get_close_matches(str(key), DEFAULTS, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise ConfigError(f"unknown config key '{key}'{hint}; keys are: {', '.join(DEFAULTS)}")
    want = type(DEFAULTS[key])
    if want is float and type(value) is str:
        try:
            value = float(value)             # YAML 1.1 reads 1e-4 (no dot) as a string
        except ValueError:
            pass
    if want is float and type(value) is int:
        value = float(value)
    if want is float and type(value) is float and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
    if type(value) is not want:
        raise ConfigError(f"config key '{key}' must be {want.__name__}, got {value!r}")
    if key in CHOICES and value not in CHOICES[key]:
        raise ConfigError(f"config key '{key}' must be one of {CHOICES[key]}, got {value!r}")
    if key in POSITIVE and value <= 0 or key in NON_NEGATIVE and value < 0:
        raise ConfigError(f"config key '{key}' must be {'> 0' if key in POSITIVE else '>= 0'}, got {value!r}")
    if key in UNIT and not 0 <= value <= 1 or key in ("coverage", "top_p") and value == 0:
        raise ConfigError(f"config key '{key}' must be in (0, 1], got {value!r}")
    if key == "dual_clip" and value <= 1:
        raise ConfigError(f"config key 'dual_clip' must be > 1 (the official value is 3), got {value!r}")
    return value


class DuplicateKey(Exception):
    """A mapping that gives a key twice: the key and the lines (1-based) of both."""


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a mapping giving a key twice (SafeLoader keeps the last)."""

    def construct_mapping(self, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":       # `<<: *anchor` may override keys
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                if key in seen:
                    raise DuplicateKey(key, seen[key] + 1, key_node.start_mark.line + 1)
                seen[key] = key_node.start_mark.line
            except TypeError:                                   # unhashable: SafeLoader's own error
                continue
        return super().construct_mapping(node, deep)


def read_file(path, named_by=None, chain=()):
    """The checked keys of one config file with its bases resolved under them (no DEFAULTS).
    `named_by`: the file whose `base:` names this one; `chain`: the (path, real path) of each
    file already being read, for the cycle check."""
    if not os.path.isfile(path):
        if named_by is not None:
            raise ConfigError(f"base file not found: {path} (the base of {named_by})")
        raise ConfigError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            loaded = yaml.load(f, Loader=UniqueKeyLoader)
    except DuplicateKey as e:
        key, first, again = e.args
        base = f" (the base of {named_by})" if named_by is not None else ""
        raise ConfigError(f"key '{key}' is given twice in {path}{base}: at lines {first} and {again}; "
                          f"keep one") from None
    except yaml.YAMLError as e:
        line = getattr(getattr(e, "problem_mark", None), "line", None)
        where = f" at line {line + 1}" if line is not None else ""
        raise ConfigError(f"invalid YAML in {path}{where}: {getattr(e, 'problem', e)}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path} is not UTF-8 text (byte {e.start})") from None
    loaded = {} if loaded is None else loaded      # an empty file is an empty config
    if not isinstance(loaded, dict):
        raise ConfigError(f"{path} must be a flat mapping of key: value")
    chain = chain + ((path, os.path.realpath(path)),)
    cfg = {}
    if "base" in loaded:
        base = loaded.pop("base")
        if type(base) is not str or not base:
            raise ConfigError(f"'base' in {path} must be the path of another config file, got {base!r}")
        base_path = os.path.normpath(os.path.join(os.path.dirname(path), base))
        if os.path.realpath(base_path) in [real for _, real in chain]:
            raise ConfigError(f"a cycle of bases: {' -> '.join(p for p, _ in chain)} -> {base_path}")
        cfg.update(read_file(base_path, path, chain))
    for key, value in loaded.items():
        try:
            cfg[key] = check_value(key, value)
        except ConfigError as e:
            if named_by is None:
                raise
            raise ConfigError(f"in {path} (the base of {named_by}): {e}") from None
    return cfg


def load_config(path, overrides=()):
    """DEFAULTS <- the YAML file (its bases first) <- `--key=value` overrides, every value checked."""
    cfg = dict(DEFAULTS)
    cfg.update(read_file(path))
    for arg in overrides:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"cannot read argument '{arg}': overrides are --key=value")
        key, text = arg[2:].split("=", 1)
        if key == "base":
            raise ConfigError(f"'{arg}': base is not an override; write `base: FILE` in a config file")
        try:          # a text key takes the text as written: --logged_file= is "", --out_dir=2024 a name
            value = text if isinstance(DEFAULTS.get(key), str) or not text else yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        cfg[key] = check_value(key, value)
    if cfg["n_embd"] % cfg["n_head"]:
        raise ConfigError(f"n_embd ({cfg['n_embd']}) must be divisible by n_head ({cfg['n_head']})")
    if cfg["grounding_examples"] and cfg["rehearsal_context"] == "inline":
        raise ConfigError(f"grounding_examples ({cfg['grounding_examples']}) needs rehearsal_context: "
                          f"separate: inline, the actor would read the examples in its own context")
    if cfg["group_size"] == 1 and cfg["rl_steps"]:
        raise ConfigError(f"group_size 1 cannot train: a group of one episode is its own baseline "
                          f"(A = R - mean(group) = 0), so none of the {cfg['rl_steps']} RL steps could "
                          f"update; use group_size >= 2, or rl_steps: 0 for a warm start only")
    check_format(cfg)
    if cfg["world"] == "uncertain" and (cfg["format"] != "plain" or cfg["rehearsal_context"] != "inline"
                                        or cfg["uncertain_items"] > 24):
        raise ConfigError(f"world: uncertain is the toy shop with stale logs: it needs format: plain, "
                          f"rehearsal_context: inline and uncertain_items <= 24 (the catalogue), got "
                          f"{cfg['format']}, {cfg['rehearsal_context']}, {cfg['uncertain_items']}")
    check_choice(cfg)
    return cfg


def check_choice(cfg):
    """What `world: choice` (worlds/choice.py) can run: the plain format, inline rehearsal, its own
    generated tasks, 2 to 4 items per task, and its own private rehearsal (the memory sweep of
    worlds/choice.py), not evaluate.py's vote."""
    if cfg["world"] != "choice":
        return
    if cfg["format"] != "plain" or cfg["rehearsal_context"] != "inline":
        raise ConfigError(f"world: choice needs format: plain and rehearsal_context: inline, got "
                          f"{cfg['format']}, {cfg['rehearsal_context']}")
    if not 2 <= cfg["choice_items"] <= 4:
        raise ConfigError(f"config key 'choice_items' must be 2, 3 or 4 (items per task), got {cfg['choice_items']}")
    files = [k for k in ("tasks_file", "test_file", "logged_file") if cfg[k]]
    if files:
        raise ConfigError(f"world: choice generates its own tasks: remove {', '.join(files)}")
    if cfg["rehearsal_budget"]:
        raise ConfigError("world: choice measures private rehearsal with its rehearsal memory "
                          "(python -m scripts.choice_sweep --ckpt RUN), not evaluate.py's vote: set rehearsal_budget: 0")


def check_splits(cfg, splits):
    """The task splits fit the config (train.run, before any model is built): each RL step
    samples tasks_per_step distinct RL tasks, and evaluation needs test tasks."""
    if cfg["rl_steps"] and len(splits["rl"]) < cfg["tasks_per_step"]:
        source = cfg["tasks_file"] or f"n_rl_tasks {cfg['n_rl_tasks']}"
        raise ConfigError(f"tasks_per_step ({cfg['tasks_per_step']}) is more than the {len(splits['rl'])} RL "
                          f"tasks ({source}): a step samples that many distinct tasks; lower "
                          f"tasks_per_step or give more tasks")
    if not splits["test"]:
        raise ConfigError(f"the test split is empty ({cfg['test_file'] or cfg['tasks_file'] or 'n_test'}): "
                          f"nothing to evaluate the run on")


def check_lengths(cfg, tokenizer, model_config, tasks):
    """max_tokens against the model and the prompts (train.run, right after the model is built):
    (format: plain; chat prompts are checked by chat_setup.check_chat_prompts) the longest prompt of
    `tasks`, encoded as the sampler encodes it (<bos> + the prompt's tokens), against the model's
    context and max_tokens (`check_prompt`), then max_tokens no more than the model's
    max_position_embeddings."""
    positions = getattr(model_config, "max_position_embeddings", None)
    if cfg["format"] == "plain" and tasks:
        from envace import encode, tag_ids
        bos = len(tag_ids(tokenizer)["bos"])
        length, longest = max((bos + len(encode(tokenizer, t["prompt"])), i) for i, t in enumerate(tasks))
        check_prompt(cfg, length, f"a task's prompt is {length} tokens with its <bos> "
                                  f"({tasks[longest]['prompt'][:40]!r})", "the tasks", positions)
    if positions is not None and cfg["max_tokens"] > positions:
        raise ConfigError(f"max_tokens ({cfg['max_tokens']}) is more than the model's max_position_embeddings "
                          f"({positions}): lower max_tokens to at most {positions}")


def check_prompt(cfg, length, what, where, positions=None):
    """The longest prompt of a run's tasks, `length` tokens (`what`: a sentence naming it; `where`:
    its task file and line, or "the tasks"), against the model's context (`positions`: its
    max_position_embeddings; None: not known) and max_tokens. An episode needs room after its
    prompt for one call and its response (max_act_tokens + max_env_tokens). A prompt of the
    model's context or more is a ConfigError saying so with the context the tasks need, whatever
    max_tokens is; one of max_tokens or more, a ConfigError saying what max_tokens to set (with
    `positions`: at least the prompt + that room, at most the model's context)."""
    room = cfg["max_act_tokens"] + cfg["max_env_tokens"]
    if positions is not None and length >= positions:
        raise ConfigError(f"{where}: the longest prompt is {length:,} tokens but the model ({cfg['model']}) has a "
                          f"context of {positions:,} (max_position_embeddings): these tasks need a model with a "
                          f"context of at least {length + room:,} tokens (the prompt + max_act_tokens + "
                          f"max_env_tokens, room for one call and its response); use a model with a longer "
                          f"context, or tasks with shorter prompts")
    if length >= cfg["max_tokens"]:
        advice = "" if positions is None else (f"; set max_tokens to at least {min(length + room, positions)} "
                                               f"and at most {positions} (the model's max_position_embeddings)")
        raise ConfigError(f"max_tokens ({cfg['max_tokens']}) leaves no room for an episode: {what}{advice}")


def check_format(cfg):
    """The keys `format: chat` needs, and those it cannot use."""
    if cfg["format"] == "plain":
        for key in ("judge_model", "chat_template"):
            if cfg[key]:
                raise ConfigError(f"{key} is for chat models: it needs format: chat")
        return
    if cfg["chat_template"] and not os.path.isfile(cfg["chat_template"]):
        raise ConfigError(f"chat_template: no file {cfg['chat_template']} (a Jinja chat template, e.g. "
                          f"chat/chatml_tools.jinja)")
    if cfg["tasks_file"] == "toy" and (cfg["test_file"] or cfg["logged_file"]):
        raise ConfigError("tasks_file: toy makes every split from the toy world: remove test_file and logged_file")
    if cfg["model"] == "tiny":
        raise ConfigError("format: chat needs model: a local path or hub name whose tokenizer has a chat template")
    if not cfg["tasks_file"]:
        raise ConfigError("format: chat needs tasks_file: a chat JSONL task file (see chat/tasks.py)")
    if cfg["rehearsal_budget"]:
        raise ConfigError("test-time private rehearsal (rehearsal_budget) is not built for format: chat")
    if cfg["rehearse_check"]:
        raise ConfigError("rehearse_check knows the toy world's response forms: it needs format: plain")


def command_line(argv, flags=("--resume", "--overwrite", "--debug")):
    """train.py's argv -> (config path, the --key=value overrides, {flag: given}). ConfigError for
    a --config without a path, and for --resume with --overwrite (one continues, one starts over)."""
    given = {f: f in argv for f in flags}
    argv = [a for a in argv if a not in flags]
    i = next((i for i, a in enumerate(argv) if a == "--config" or a.startswith("--config=")), None)
    flag = argv.pop(i) if i is not None else "--config="
    path = flag.split("=", 1)[1] if "=" in flag else (argv.pop(i) if i < len(argv) else "")
    if not path:
        raise ConfigError("--config needs a path, e.g. --config small.yaml")
    if given.get("--resume") and given.get("--overwrite"):
        raise ConfigError("--resume continues out_dir's checkpoint, --overwrite starts it over: give one")
    return path, argv, given
