"""`world: uncertain` (worlds/uncertain.py: stale logs for some items): the toy's plain format
(formats/format_plain.py) on the stale logs, with its own figures per subset of items (uncertain /
faithful): every RL step and evaluation the world model's probability of the true price, the RL
batch's sampled price fidelity and collusion counts, and at evaluation the success per subset of
test tasks and in an imagined world sampled at T = 1. Same functions as every format module."""
import torch

from formats import format_plain
import world
from worlds import uncertain as world_uncertain
from formats.format_plain import (by_kind, coverage, diagnostics, executes, imagined_world,  # the rest: the
                                  inputs, reward, rl_sample, sample, warm_start_roles,        # plain format's
                                  warm_start_sequences, would_rehearse)
from formats.setting import UncertainSetting
import rollout
from rollout import sample_episodes


def setup(cfg, tokenizer, splits, device="cpu"):
    """format_plain's setting on the stale logged traffic (world_uncertain.tool_snippets), with the
    uncertain items and the config keys of its figures (the truth probe's temperature; the imagined
    world's seed, tasks and limits)."""
    return format_plain.plain_setting(cfg, tokenizer, splits, world_uncertain.tool_snippets(cfg),
                                      kind=UncertainSetting,
                                      uncertain=world_uncertain.uncertain_set(cfg["data_seed"], cfg["uncertain_items"]),
                                      probe_temperature=cfg["temperature"], seed=cfg["seed"],
                                      n_collusion=cfg["n_collusion"], limits=rollout.limits(cfg))


def step_extras(setting, model, episodes, tasks):
    """The truth probe per subset; when the policy (or the frozen warm start) played the world, the
    batch's sampled price fidelity and collusion counts per subset too."""
    uncertain = setting.uncertain
    extras = {"truth": world_uncertain.truth_probe(model, setting.tokenizer, uncertain, setting.probe_temperature)}
    if setting.rehearsed:
        extras["price_fidelity_subsets"] = world_uncertain.subset_fidelity(episodes, uncertain)
        extras["collusion_subsets"] = world_uncertain.collusion_by_subset(episodes, tasks, uncertain)
    return extras


def eval_extras(setting, model, tasks, episodes, rewards):
    """The truth probe, success per subset of test tasks, and an imagined world on the first
    n_collusion test tasks sampled at T = 1 (seeded by cfg seed): its success and collusion per subset."""
    tokenizer, uncertain = setting.tokenizer, setting.uncertain
    imagined = sample_episodes(model, tokenizer, [t["prompt"] for t in tasks[:setting.n_collusion]], "rehearse",
                               world=world, settings={**setting.limits, "temperature": 1.0},
                               generator=torch.Generator().manual_seed(setting.seed))
    return {"truth": world_uncertain.truth_probe(model, tokenizer, uncertain, setting.probe_temperature),
            "success_by_subset": world_uncertain.success_by_subset(tasks, rewards, uncertain),
            "imagined_sampled": world_uncertain.success_by_subset(
                tasks, [reward(setting, e, t) for e, t in zip(imagined, tasks)], uncertain),
            "imagined_collusion_subsets": world_uncertain.collusion_by_subset(imagined, tasks, uncertain)}
