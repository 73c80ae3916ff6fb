"""Why a `world: uncertain` run's episodes fail, and which items its actor looked up (docs/uncertain.md).

    python -m scripts.uncertain_report --failures RUN [--split rl]   # failures per family x distractor position
    python -m scripts.uncertain_report --lookups RESULTS             # lookups.json per finished run (scripts/compare.py reads it)

Both run the checkpoint greedily in the REAL world, as evaluate.py does; worlds/uncertain.py holds
the rules they apply (failure_kind, failure_table, copy_counts, looked_up). A file of its own so
that the world variant stays below formats/features.py (this one loads runs through it).
"""
import glob
import json
import os
import sys

from machinery.config import ArgumentParser, ConfigError, load_config


def failures(folder, split="test", n=500):
    """A run folder (its latest checkpoint) or a checkpoint, greedy in the REAL world on the first
    n tasks of `split`: the markdown lines of failure_table per family x distractor position, and
    copy_counts per subset. `rl` reads the RL tasks (to diagnose without the test set)."""
    if not os.path.exists(folder):      # said before the imports below (torch, the model code: seconds)
        raise ConfigError(f"no checkpoint written by train.py in {folder}")
    import torch
    from formats import features
    from machinery.checkpoint import find_checkpoint, load_policy
    import rollout
    from rollout import sample_episodes
    from worlds.uncertain import copy_counts, failure_table, uncertain_set
    path = find_checkpoint(os.path.join(folder, "ckpt")) or find_checkpoint(folder)
    if path is None or not os.path.isfile(os.path.join(path, "config.yaml")):
        raise ConfigError(f"no checkpoint written by train.py in {folder}")
    cfg = load_config(os.path.join(path, "config.yaml"))
    model, tokenizer = load_policy(path, "cpu")
    model.eval()
    splits = features.build_tasks(cfg)
    fmt, setting = features.setup(cfg, tokenizer, splits, "cpu")
    tasks = splits[split][:n]
    prompts, worlds, tags = fmt.inputs(setting, tasks)
    episodes = sample_episodes(model, tokenizer, prompts, "real", world=worlds,
                               settings=rollout.sampling(cfg, temperature=0.0, top_p=1.0, tags=tags),
                               generator=torch.Generator().manual_seed(0))
    table = failure_table(tasks, episodes)
    kinds = ["distractor", "other item", "not copied", "no answer", "other"]
    lines = [f"{path}, {split} tasks 1-{len(tasks)}, real world, greedy: success "
             f"{sum(c['success'] for c in table.values()) / len(tasks):.3f}", "",
             "| family | distractor | tasks | success | " + " | ".join(kinds) + " |", "|---" * (4 + len(kinds)) + "|"]
    for (family, position), c in sorted(table.items()):
        lines.append(f"| {family} | {position} | {c['tasks']} | {c['success'] / c['tasks']:.3f} | "
                     + " | ".join(str(c.get(k, 0)) for k in kinds) + " |")
    copied = copy_counts(episodes, uncertain_set(cfg["data_seed"], cfg["uncertain_items"]))
    lines += ["", "after a real `price ITEM` response, the next action carries it: " + ", ".join(
        f"{sub} items {k} / {m}" for sub, (k, m) in copied.items())]
    return "\n".join(lines)


def write_lookups(results):
    """For every finished run under results/<arm>/<seed> (eval.json and a checkpoint): the test
    tasks again in the REAL world, greedy (as evaluate.py: the same episodes), and
    <run>/lookups.json = {"looked_up": [per test task], "strict": [success and looked_up]}, the
    input of scripts/compare.py's lookup table (one already there is kept). Returns the folders written."""
    import torch
    from formats import features
    from machinery.checkpoint import find_checkpoint, load_policy, write_file
    from reward import task_reward
    import rollout
    from rollout import sample_episodes
    from worlds.uncertain import looked_up
    written = []
    for folder in sorted(glob.glob(os.path.join(results, "*", "*", "eval.json"))):
        folder = os.path.dirname(folder)
        if os.path.isfile(os.path.join(folder, "lookups.json")):       # written before: kept
            continue
        path = find_checkpoint(os.path.join(folder, "ckpt")) or find_checkpoint(os.path.join(folder, "warmstart"))
        if path is None:
            continue
        cfg = load_config(os.path.join(path, "config.yaml"))
        model, tokenizer = load_policy(path, "cpu")
        model.eval()
        splits = features.build_tasks(cfg)
        tasks, (fmt, setting) = splits["test"], features.setup(cfg, tokenizer, splits, "cpu")
        prompts, worlds, tags = fmt.inputs(setting, tasks)
        episodes = sample_episodes(model, tokenizer, prompts, "real", world=worlds,
                                   settings=rollout.sampling(cfg, temperature=0.0, top_p=1.0, tags=tags),
                                   generator=torch.Generator().manual_seed(cfg["seed"]))
        seen = [looked_up(e, t) for e, t in zip(episodes, tasks)]
        strict = [int(task_reward(e, t)) * k for e, t, k in zip(episodes, tasks, seen)]
        write_file(os.path.join(folder, "lookups.json"), json.dumps({"looked_up": seen, "strict": strict}))   # whole
        written.append(folder)
    return written


def main(argv=None):
    """python -m scripts.uncertain_report --failures RUN [--split S] [--n N] | --lookups RESULTS ->
    exit status: 0 printed (and written); 2 a bad option or path, checked before any model is
    loaded, or a refused write: one line."""
    parser = ArgumentParser(description="why a world: uncertain run's episodes fail (real world, greedy)")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--failures", metavar="RUN", help="a run folder of train.py, or a checkpoint")
    group.add_argument("--lookups", metavar="RESULTS", help="lookups.json for every finished run under RESULTS")
    parser.add_argument("--split", choices=("test", "rl"), default=None, help="--failures: the tasks (default test)")
    parser.add_argument("--n", type=int, default=None, help="--failures: the first N tasks (default 500)")
    try:
        args = parser.parse_args(argv)            # (--help prints and exits 0 here)
        if args.lookups is not None:
            given = [f"--{k}" for k in ("split", "n") if getattr(args, k) is not None]
            if given:
                raise ConfigError(f"--lookups runs every finished run's test tasks; it takes no {', '.join(given)}")
            if not os.path.isdir(args.lookups):
                raise ConfigError(f"--lookups {args.lookups}: no such folder")
            if not glob.glob(os.path.join(glob.escape(args.lookups), "*", "*", "eval.json")):
                raise ConfigError(f"--lookups {args.lookups}: no finished run in it (<arm>/<seed>/eval.json)")
            print("\n".join(f"{folder}/lookups.json" for folder in write_lookups(args.lookups)))
        else:
            if args.n is not None and args.n < 1:
                raise ConfigError(f"--n must be at least 1, got {args.n}")
            print(failures(args.failures, args.split or "test", 500 if args.n is None else args.n))
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
