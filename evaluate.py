"""Evaluation in the REAL toy world: the only place the true dynamics are used.

The paper trains with rehearsal but reports success on real benchmarks; likewise here every
success figure is measured with the real world answering the policy's calls, never with the
policy's own rehearsals (an imagined success can rise while the real one does not). Besides
success, it reports how episodes ended (format errors), the mean number of calls, and the
rehearsal fidelity the model would have had if it had rehearsed those calls itself.

    python evaluate.py --ckpt out/small                 # the RL'd policy
    python evaluate.py --ckpt out/small/warmstart       # the warm start it came from

Writes <ckpt>/eval.json with at least {"success": float, "n_tasks": int}.
"""
import argparse
import json
import os
import sys

import torch

import rehearse
from reward import cause_counts, task_reward
from rollout import sample_episodes


def evaluate(model, tokenizer, tasks, cfg, batch_size=512, seed=0):
    """Run `tasks` in the real world (sampling per cfg eval_temperature/top_p) and measure."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    episodes = []
    for i in range(0, len(tasks), batch_size):
        episodes += sample_episodes(
            model, tokenizer, [t["prompt"] for t in tasks[i:i + batch_size]], "real",
            temperature=cfg["eval_temperature"], top_p=cfg["top_p"], max_turns=cfg["max_turns"],
            max_act_tokens=cfg["max_act_tokens"], max_env_tokens=cfg["max_env_tokens"],
            max_tokens=cfg["max_tokens"], generator=generator)
    rewards = [task_reward(e, t) for e, t in zip(episodes, tasks)]
    causes = cause_counts(episodes)
    fidelity = rehearse.would_rehearse(model, tokenizer, episodes)
    by_family = {}
    for t, r in zip(tasks, rewards):
        by_family.setdefault(t["family"], []).append(r)
    return {
        "success": sum(rewards) / len(tasks),
        "n_tasks": len(tasks),
        "format_errors": sum(n for c, n in causes.items() if c != "answer") / len(tasks),
        "causes": causes,
        "mean_calls": sum(len(e["calls"]) for e in episodes) / len(tasks),
        "fidelity": rehearse.rates(fidelity),
        "fidelity_counts": fidelity,
        "success_by_family": {f: sum(r) / len(r) for f, r in sorted(by_family.items())},
    }


def summary(m):
    """One line for the terminal."""
    fid = " ".join(f"{k} {v:.3f}" for k, v in m["fidelity"].items())
    return (f"success {m['success']:.3f} on {m['n_tasks']} tasks | format errors "
            f"{m['format_errors']:.3f} | mean calls {m['mean_calls']:.2f} | would-rehearse fidelity: {fid}")


def main(argv=None):
    from envace import find_checkpoint
    from train import ConfigError, build_tasks, load_config, load_policy, pick_device
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", required=True, help="a run folder of train.py, or a checkpoint in it")
    parser.add_argument("--n_test", type=int, default=None, help="evaluate on the first N test tasks")
    args, overrides = parser.parse_known_args(argv)
    try:
        # a run folder holds its latest checkpoint in ckpt/; warmstart/ is a checkpoint itself
        path = find_checkpoint(os.path.join(args.ckpt, "ckpt")) or find_checkpoint(args.ckpt)
        if path is None or not os.path.isfile(os.path.join(path, "config.yaml")):
            raise ConfigError(f"no checkpoint written by train.py in {args.ckpt}")
        cfg = load_config(os.path.join(path, "config.yaml"), overrides)
        model, tokenizer = load_policy(path, pick_device(cfg))
        tasks = build_tasks(cfg)["test"]
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = tasks[:args.n_test] if args.n_test else tasks
    metrics = evaluate(model, tokenizer, tasks, cfg, seed=cfg["seed"])
    print(summary(metrics))
    with open(os.path.join(args.ckpt, "eval.json"), "w") as f:
        json.dump(metrics, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
