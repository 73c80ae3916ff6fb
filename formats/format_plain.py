"""The toy's plain format (the demo): world.py's tags and world, rehearsals inline or in separate rows.

Every format module defines the same functions with the same signatures (tests/test_layout.py
holds them to it), as the worlds share parse_call, step, replay:

    formats/format_plain.py       the toy shop (world.py), inline or separate rows: this file
    formats/format_uncertain.py   world: uncertain, the toy on stale logs, with its per-subset figures
    formats/format_choice.py      world: choice, commit prompts, the choice reward, rehearsal memory
    formats/format_chat.py        format: chat, a chat model on JSONL tool tasks (chat/format.py)

features.choose(cfg) picks the module once; its `setup(cfg, tokenizer, splits, device)` returns the
`setting`, a dict of what the other functions read (the tags, the logged data, the layout, the
sampler). train.py and evaluate.py call `fmt.inputs(setting, tasks, G)`, `fmt.rl_sample(setting, ...)`
and never branch on the format or the layout. A module that changes only some functions imports
the rest from this one, so each name is one `def`:

    inputs(setting, tasks, repeat)     (prompts, worlds, tags) for the sampler, each task `repeat` times
    sample(setting, model, tokenizer, prompts, mode, **kw)   the sampler when the policy plays the
                                       world, chosen at setup (setting["sampler"])
    rl_sample(setting, model, tokenizer, prompts, world, tags, env_model, generator)   RL's sampler:
                                       `sample`, or inline rollout.sample_episodes when the real
                                       world or none answers
    reward(setting, episode, task)     task success
    warm_start_sequences(setting)      the logged data as rows of ids + roles; warm_start_roles: those trained
    diagnostics(setting, episodes, tasks)     an RL step's rehearsal fidelity and collusion sums
                                       against a real replay; rl_diagnostics: {} unless the policy rehearsed
    executes(setting, task)            whether a real executor runs the task at evaluation
    would_rehearse(setting, model, tokenizer, tasks, episodes)   [(call, matched)]: would the model,
                                       greedy, have rehearsed each real response of these episodes?
    by_kind(setting, pairs, tasks)     those per tool kind {kind: [matches, total]}
    coverage(setting, model, tokenizer, tasks, pairs=None)       fidelity by warm-start coverage (the
                                       times each call is in the tool cache's training traffic)
    imagined_world(setting, model, tokenizer, tasks, cfg, generator)   imagined success, collusion
    step_extras(setting, model, episodes, tasks)        a world's own figures for an RL step ({} here)
    eval_extras(setting, model, tasks, episodes, rewards)   a world's own figures for an evaluation ({} here)
"""
import functools

from worldmodel import honesty
import rehearse
from worldmodel import separate, toolcache
import world
from envace import ACT, OBS, PROMPT, REHEARSE, encode_episode, tag_ids
from reward import task_reward
from rollout import sample_episodes


def setup(cfg, tokenizer, splits, device="cpu"):
    """The setting of the toy's plain format, the logged tool traffic being world.tool_snippets'."""
    return plain_setting(cfg, tokenizer, splits, world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"],
                                                                     cfg["coverage"]))


def plain_setting(cfg, tokenizer, splits, snippets):
    """The setting of the toy on `splits` and the logged tool traffic `snippets` (a snippet may
    carry its logged "responses"; else world.replay's): the tags as ids, the logged episodes with
    their responses, the tool cache of that training traffic (worldmodel/toolcache.py: the warm-start
    counts and the grounding source; never the test split), and the layout. inline: the sampler
    is rollout.sample_episodes; separate: separate.sample_separate with grounding_examples
    examples from the cache (toolcache.examples), in training and evaluation alike (a toy task
    has no reference examples of its own: "rl_sampler_args" is "sampler_args")."""
    logged = [(t, t.get("responses") or world.replay(t["calls"])) for t in splits["logged"]]
    traffic = [pair for t, responses in logged for pair in zip(t["calls"], responses)]
    traffic += [pair for s in snippets for pair in zip(s["calls"], s.get("responses") or world.replay(s["calls"]))]
    setting = {**loop_keys(cfg), "world": world, "tokenizer": tokenizer, "tags": tag_ids(tokenizer),
               "logged": logged, "snippets": snippets, "cache": toolcache.build(traffic, toolcache.plain_call),
               "examples": None, "sampler": sample_episodes, "sampler_args": {}}
    if setting["separate"]:
        separate.check_vocabulary(cfg, tokenizer)
        setting["examples"] = functools.partial(toolcache.examples, setting["cache"], k=cfg["grounding_examples"])
        setting.update(sampler=separate.sample_separate, sampler_args={"examples": setting["examples"]})
    setting["rl_sampler_args"] = setting["sampler_args"]
    return setting


def loop_keys(cfg):
    """The keys every format's setting holds for the functions they share: who plays the world
    in RL (env_mode; `rehearsed`: the policy or the frozen warm start), the sampler's config keys
    (`sampling_args`), and whether rehearsals have rows of their own (rehearsal_context separate)."""
    return {"env_mode": cfg["env_mode"], "rehearsed": cfg["env_mode"] in ("rehearse", "frozen"),
            "sampling": sampling_args(cfg), "separate": cfg["rehearsal_context"] == "separate"}


def sampling_args(cfg):
    """The sampler's keyword arguments from the config (rollout.sample_episodes)."""
    args = {k: cfg[k] for k in ("temperature", "top_p", "max_turns", "max_act_tokens", "max_env_tokens",
                                "max_tokens")}
    return {**args, "rehearse_check": rehearse.check_rehearsal if cfg["rehearse_check"] else None}


def inputs(setting, tasks, repeat=1):
    """(prompts, worlds, tags) for the sampler: each task's prompt `repeat` times, the toy world, its tags."""
    return [t["prompt"] for t in tasks for _ in range(repeat)], setting["world"], setting["tags"]


def sample(setting, model, tokenizer, prompts, mode, **kw):
    """Evaluation's sampler when the policy plays the world (tasks with no executor, private
    rehearsal, the imagined world), chosen at setup: setting["sampler"] with
    setting["sampler_args"]: inline rollout.sample_episodes, separate.sample_separate (grounding
    examples from the tool cache only, or the chat format's rehearse prompt), or world: choice's
    world_choice.sample_with_memory."""
    return setting["sampler"](model, tokenizer, prompts, mode, **setting["sampler_args"], **kw)


def rl_sample(setting, model, tokenizer, prompts, world, tags, env_model, generator):
    """RL's sampler, with env_mode and the config's sampling keys from setup: setting["sampler"]
    with the training arguments setting["rl_sampler_args"] (chat: a task's own reference examples
    ground its rehearsals first) when the policy (or the frozen warm start, `env_model`) plays the
    world, inline rollout.sample_episodes when the real world (or none) answers. world, tags: from `inputs`."""
    kw = {"world": world, "tags": tags, "env_model": env_model, "generator": generator, **setting["sampling"]}
    if setting["rehearsed"]:
        # a setting without training arguments of its own (world: choice) samples as evaluation does
        args = setting.get("rl_sampler_args", setting["sampler_args"])
        return setting["sampler"](model, tokenizer, prompts, setting["env_mode"], **args, **kw)
    return sample_episodes(model, tokenizer, prompts, setting["env_mode"], **kw)


def reward(setting, episode, task):
    """Task success (reward.task_reward)."""
    return task_reward(episode, task)


def warm_start_sequences(setting):
    """The logged data as rows of ids + roles: inline, an episode per logged task (calls and answer
    ACT, responses OBS) and per tool snippet (calls PROMPT, responses OBS); separate, a group of
    rows per logged episode or snippet (separate.warm_start_sequences)."""
    tokenizer, logged, snippets = setting["tokenizer"], setting["logged"], setting["snippets"]
    if setting["separate"]:
        return separate.warm_start_sequences(tokenizer, logged, snippets, setting["examples"])
    return ([encode_episode(tokenizer, t["prompt"], t["calls"], responses, t["answer"]) for t, responses in logged]
            + [encode_episode(tokenizer, s["prompt"], s["calls"], s.get("responses") or setting["world"].replay(
                s["calls"]), act_role=PROMPT) for s in snippets])


def warm_start_roles(setting):
    """The roles the warm start trains: ACT, REHEARSE and the logged responses OBS (the initial
    world model); separate rows train ACT and REHEARSE (an actor row's responses are context)."""
    return (ACT, REHEARSE) if setting["separate"] else (ACT, REHEARSE, OBS)


def diagnostics(setting, episodes, tasks):
    """Rehearsal fidelity per tool kind and collusion counts of rehearsed episodes, against a real replay."""
    return {"fidelity": honesty.replay_fidelity(episodes, setting["world"]),
            "collusion": honesty.collusion_counts(episodes, tasks, setting["world"])}


def rl_diagnostics(setting, episodes, tasks):
    """An RL step's `diagnostics` when the policy (or the frozen warm start) played the world; {} for real / none."""
    return diagnostics(setting, episodes, tasks) if setting["rehearsed"] else {}


def executes(setting, task):
    """Whether a real executor runs the task at evaluation: the toy world runs every task."""
    return True


def would_rehearse(setting, model, tokenizer, tasks, episodes):
    """[(call, matched)] over real-world episodes: would the model, greedy, have rehearsed each real
    response? Asked where it rehearses: in the actor's row (honesty.would_rehearse_calls), or in
    separate rows with the tool cache's grounding examples (separate.would_rehearse_separate)."""
    if setting["separate"]:
        return separate.would_rehearse_separate(model, tokenizer, episodes, examples=setting["examples"])
    return honesty.would_rehearse_calls(model, tokenizer, episodes)


def by_kind(setting, pairs, tasks):
    """[(call, matched)] -> {tool kind: [matches, total]} (honesty.by_kind)."""
    return honesty.by_kind(pairs, setting["world"])


def coverage(setting, model, tokenizer, tasks, pairs=None):
    """Would-rehearse fidelity bucketed by how often each call was in the warm-start data (the tool
    cache's traffic: "seen 0 times" is the cache's unseen), on the EXPERT's calls of `tasks`
    (honesty.expert_episodes; `pairs` is not read): a policy that never calls an unseen item would hide it."""
    expert = honesty.expert_episodes(tokenizer, tasks, setting["world"])
    pairs = would_rehearse(setting, model, tokenizer, tasks, expert)
    return honesty.fidelity_by_coverage(pairs, toolcache.counts_of(setting["cache"], [c for c, _ in pairs]))


def imagined_world(setting, model, tokenizer, tasks, cfg, generator):
    """Imagined success and collusion (honesty.imagined_world), sampled in the model's layout."""
    return honesty.imagined_world(model, tokenizer, tasks, cfg, generator, setting["world"],
                                  sample=setting["sampler"], **setting["sampler_args"])


def step_extras(setting, model, episodes, tasks):
    """A world's own figures for an RL step's metrics line: none in the toy world."""
    return {}


def eval_extras(setting, model, tasks, episodes, rewards):
    """A world's own figures for an evaluation: none in the toy world."""
    return {}
