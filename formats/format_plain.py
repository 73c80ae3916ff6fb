"""The toy's plain format (the demo): world.py's tags and world, each rehearsal inline in the actor's row.

Every format module defines the same functions with the same signatures (tests/test_layout.py
holds them to it), as the worlds share parse_call, step, replay. One module per format and
rehearsal layout:

    formats/format_plain.py            the toy shop (world.py), rehearsals inline: this file
    formats/format_plain_separate.py   the toy shop, each rehearsal a row of its own
    formats/format_uncertain.py        world: uncertain, the toy on stale logs, with its per-subset figures
    formats/format_choice.py           world: choice, commit prompts, the choice reward, rehearsal memory
    formats/format_chat.py             format: chat, a chat model on JSONL tool tasks (chat/format.py), inline
    formats/format_chat_separate.py    format: chat, each rehearsal a row of its own

features.choose(cfg) picks the module once; its `setup(cfg, tokenizer, splits, device)` returns the
`setting` (formats/setting.py: a dataclass of what the other functions read: the tags, the logged
data, the samplers). train.py and evaluate.py call `fmt.inputs(setting, tasks, G)`,
`fmt.rl_sample(setting, ...)` and never branch on the format or the layout, and no function here
branches on them either. A module that changes only some functions imports the rest from
another, so each name is one `def`:

    inputs(setting, tasks, repeat)     (prompts, worlds, tags) for the sampler, each task `repeat` times
    sample(setting, model, tokenizer, prompts, mode, **kw)   the layout's sampler, when the policy
                                       plays the world (setting.sampler, chosen at setup)
    rl_sample(setting, model, tokenizer, prompts, world, tags, env_model, generator)   RL's sampler
                                       (here rollout.sample_episodes itself; a separate layout's is
                                       setting.rl_sampler: its own, or the inline one when the real
                                       world or none answers)
    reward(setting, episode, task)     task success
    warm_start_sequences(setting)      the logged data as rows of ids + roles; warm_start_roles: those trained
    diagnostics(setting, episodes, tasks)     an RL step's rehearsal fidelity and collusion sums
                                       against a real replay (train.py asks when the world was sampled)
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
from worldmodel import honesty, toolcache
import world
from envace import ACT, OBS, PROMPT, REHEARSE, encode_episode, tag_ids
from formats.setting import PlainSetting, loop_fields
from reward import task_reward
from rollout import sample_episodes


def setup(cfg, tokenizer, splits, device="cpu"):
    """The setting of the toy's plain format, the logged tool traffic being world.tool_snippets'."""
    return plain_setting(cfg, tokenizer, splits, world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"],
                                                                     cfg["coverage"]))


def plain_setting(cfg, tokenizer, splits, snippets, kind=PlainSetting, **fields):
    """The setting (a `kind`: PlainSetting or a world's own, with its own `fields`) of the toy on
    `splits` and the logged tool traffic `snippets` (a snippet may carry its logged "responses";
    else world.replay's): the tags as ids, the logged episodes with their responses, the tool cache
    of that training traffic (worldmodel/toolcache.py: the warm-start counts, and the separate
    layout's grounding source; never the test split), and the inline sampler,
    rollout.sample_episodes, for evaluation (RL calls it in rl_sample)."""
    logged = [(t, t.get("responses") or world.replay(t["calls"])) for t in splits["logged"]]
    traffic = [pair for t, responses in logged for pair in zip(t["calls"], responses)]
    traffic += [pair for s in snippets for pair in zip(s["calls"], s.get("responses") or world.replay(s["calls"]))]
    return kind(**loop_fields(cfg), world=world, tokenizer=tokenizer, tags=tag_ids(tokenizer), logged=logged,
                snippets=snippets, cache=toolcache.build(traffic, toolcache.plain_call), sampler=sample_episodes,
                sampler_args={}, **fields)


def inputs(setting, tasks, repeat=1):
    """(prompts, worlds, tags) for the sampler: each task's prompt `repeat` times, the toy world, its tags."""
    return [t["prompt"] for t in tasks for _ in range(repeat)], setting.world, setting.tags


def sample(setting, model, tokenizer, prompts, mode, **kw):
    """Evaluation's sampler when the policy plays the world (tasks with no executor, private
    rehearsal, the imagined world), chosen at setup: setting.sampler with setting.sampler_args
    (inline rollout.sample_episodes, separate.sample_separate grounded by the tool cache only, or
    world: choice's world_choice.sample_with_memory). `kw`: the sampler's world, env_model,
    settings (rollout.SAMPLING), generator, plans."""
    return setting.sampler(model, tokenizer, prompts, mode, **setting.sampler_args, **kw)


def rl_sample(setting, model, tokenizer, prompts, world, tags, env_model, generator):
    """RL's sampler: rollout.sample_episodes, rehearsals inline, in the config's env_mode (who answers
    the calls: the policy, the real world, the frozen warm start `env_model`, or none) with the
    config's sampling keys (setting.sampling, with `tags`). world, tags: from `inputs`. (A layout
    with rows of its own, format_plain_separate.rl_sample, calls the sampler chosen at setup.)"""
    return sample_episodes(model, tokenizer, prompts, setting.env_mode, world=world, env_model=env_model,
                           generator=generator, settings={**setting.sampling, "tags": tags})


def reward(setting, episode, task):
    """Task success (reward.task_reward)."""
    return task_reward(episode, task)


def warm_start_sequences(setting):
    """The logged data as rows of ids + roles: an episode per logged task (calls and answer ACT,
    responses OBS) and per tool snippet (calls PROMPT, responses OBS)."""
    return ([encode_episode(setting.tokenizer, t["prompt"], t["calls"], responses, t["answer"])
             for t, responses in setting.logged]
            + [encode_episode(setting.tokenizer, s["prompt"], s["calls"],
                              s.get("responses") or setting.world.replay(s["calls"]), act_role=PROMPT)
               for s in setting.snippets])


def warm_start_roles(setting):
    """The roles the warm start trains: ACT, REHEARSE and the logged responses OBS (the initial world model)."""
    return (ACT, REHEARSE, OBS)


def diagnostics(setting, episodes, tasks):
    """Rehearsal fidelity per tool kind and collusion counts of rehearsed episodes, against a real replay."""
    return {"fidelity": honesty.replay_fidelity(episodes, setting.world),
            "collusion": honesty.collusion_counts(episodes, tasks, setting.world)}


def executes(setting, task):
    """Whether a real executor runs the task at evaluation: the toy world runs every task."""
    return True


def would_rehearse(setting, model, tokenizer, tasks, episodes):
    """[(call, matched)] over real-world episodes: would the model, greedy, have rehearsed each real
    response in the actor's row (honesty.would_rehearse_calls)?"""
    return honesty.would_rehearse_calls(model, tokenizer, episodes)


def by_kind(setting, pairs, tasks):
    """[(call, matched)] -> {tool kind: [matches, total]} (honesty.by_kind)."""
    return honesty.by_kind(pairs, setting.world)


def coverage(setting, model, tokenizer, tasks, pairs=None):
    """Would-rehearse fidelity bucketed by how often each call was in the warm-start data, on the
    EXPERT's calls of `tasks` (`expert_coverage`; `pairs` is not read)."""
    return expert_coverage(setting, model, tokenizer, tasks, would_rehearse)


def expert_coverage(setting, model, tokenizer, tasks, would_rehearse):
    """Fidelity by the times each call is in the tool cache's traffic ("seen 0 times" is the
    cache's unseen), `would_rehearse` (the layout's) asked on the EXPERT's calls of `tasks`
    (honesty.expert_episodes): a policy that never calls an unseen item would hide it."""
    expert = honesty.expert_episodes(tokenizer, tasks, setting.world)
    pairs = would_rehearse(setting, model, tokenizer, tasks, expert)
    return honesty.fidelity_by_coverage(pairs, toolcache.counts_of(setting.cache, [c for c, _ in pairs]))


def imagined_world(setting, model, tokenizer, tasks, cfg, generator):
    """Imagined success and collusion (honesty.imagined_world), sampled in the model's layout."""
    return honesty.imagined_world(model, tokenizer, tasks, cfg, generator, setting.world,
                                  sample=setting.sampler, **setting.sampler_args)


def step_extras(setting, model, episodes, tasks):
    """A world's own figures for an RL step's metrics line: none in the toy world."""
    return {}


def eval_extras(setting, model, tasks, episodes, rewards):
    """A world's own figures for an evaluation: none in the toy world."""
    return {}
