"""Speed: our KV-cached act/rehearse sampler against transformers' generate, and the update.

    python bench.py                                   # the demo model and batch (16 tasks x 8)
    python bench.py --ckpt out/small/ckpt             # a trained checkpoint: realistic episodes
    python bench.py --size 0.5b --device cuda         # a bigger model built from a config

In one run, on the same model, prompts and lengths, it times (median of --repeats after one
warm-up): our sampler in each env mode; transformers' `generate` driving the same interleaved
episodes the way most peers do (one generate call per act or rehearse segment, stopped at the
segment's end tag, the context re-fed each call); plain `generate` decoding the same number of
new tokens per row in one call (its best case, no state machine); the old-logprob forward; and
one training step. It prints tokens/s, the ratio to generate and peak memory, and writes JSON.
Random weights end episodes early (the actor soon writes a stray tag), so pass --ckpt of a
trained demo run for the demo's real episode lengths; without one, it uses out/small/ckpt if
that exists.
"""

import argparse
import json
import os
import resource
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import world
from envace import encode, tag_ids, token_logprobs
from checkpoint import build_tokenizer
from rollout import sample_episodes
from train import make_batch, rl_step
from config import DEFAULTS
from checkpoint import load_policy

SIZES = {  # name: (layers, width, heads, kv heads, mlp width); the larger two have Qwen2.5-0.5B and
    # Qwen3-1.7B shapes without their big vocabularies (the toy tokenizer has 54 words)
    "demo": (4, 128, 4, 4, 512),
    "0.5b": (24, 896, 14, 2, 4864),
    "1.7b": (28, 2048, 16, 8, 6144),
}


def timed(fn, repeats, device):
    """Median seconds of `repeats` calls after one warm-up, and fn's last result."""
    result = fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = fn()
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


def new_tokens(episodes):
    return sum(len(e["ids"]) - e["prompt_len"] for e in episodes)


@torch.no_grad()
def generate_episodes(model, tokenizer, prompts, env_mode, cfg, seed):
    """The same episodes built with transformers' generate, one call per segment (peers' way):
    the actor's segment stops at </act>, the rehearsal at </env>; forced tags and real responses
    are appended between calls, and each call re-feeds the whole context."""
    torch.manual_seed(seed)
    tags = tag_ids(tokenizer)
    device = next(model.parameters()).device
    rows = [
        {
            "ids": tags["bos"] + encode(tokenizer, p) + tags["act"],
            "state": world.new_state(),
            "phase": "act",
            "calls": 0,
        }
        for p in prompts
    ]
    for r in rows:
        r["prompt_len"] = len(r["ids"]) - len(tags["act"])
    while True:
        live = [r for r in rows if r["phase"] != "done" and len(r["ids"]) < cfg["max_tokens"]]
        if not live:
            break
        for phase, stop, limit in (
            ("act", tags["act_end"], cfg["max_act_tokens"]),
            ("env", tags["env_end"], cfg["max_env_tokens"]),
        ):
            group = [r for r in live if r["phase"] == phase]
            if not group:
                continue
            width = max(len(r["ids"]) for r in group)
            ids = torch.tensor(
                [[tags["pad"]] * (width - len(r["ids"])) + r["ids"] for r in group], device=device
            )
            mask = (
                torch.arange(width, device=device)[None]
                >= torch.tensor([width - len(r["ids"]) for r in group], device=device)[:, None]
            ).long()
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=cfg["temperature"],
                top_k=0,
                top_p=1.0,
                max_new_tokens=limit + 1,
                eos_token_id=stop,
                pad_token_id=tags["pad"],
            )
            for r, seq in zip(group, out[:, width:].tolist()):
                seq = seq[: seq.index(stop) + 1] if stop in seq else seq
                r["ids"] += seq
                if stop not in seq:
                    r["phase"] = "done"
                elif phase == "env":
                    r["ids"] += tags["act"]
                    r["phase"] = "act"
                else:
                    _after_act(r, tokenizer.decode(seq[:-1]), tags, tokenizer, env_mode, cfg)
    return rows


def _after_act(row, text, tags, tokenizer, env_mode, cfg):
    if world.parse_call(text) is None or row["calls"] >= cfg["max_turns"]:
        row["phase"] = "done"  # an answer, or a call that ends the episode
        return
    row["calls"] += 1
    row["ids"] += tags["env"]
    if env_mode == "real":
        row["ids"] += encode(tokenizer, world.step(row["state"], text)) + [tags["env_end"]] + tags["act"]
    else:
        row["phase"] = "env"


def figure(seconds, tokens, **extra):
    return {"seconds": seconds, "tokens": tokens, "tok_per_s": tokens / seconds, **extra}


def bench_sampling(model, tokenizer, prompts, cfg, repeats, device):
    """Our sampler and generate on the same episodes, then generate's one-call best case."""
    results, gen = {}, torch.Generator().manual_seed(0)
    for mode in ("rehearse", "real"):
        sec, eps = timed(
            lambda: sample_episodes(model, tokenizer, prompts, mode, generator=gen), repeats, device
        )
        results[f"sampler_{mode}"] = figure(sec, new_tokens(eps))
        sec, rows = timed(lambda: generate_episodes(model, tokenizer, prompts, mode, cfg, 0), repeats, device)
        results[f"generate_{mode}"] = figure(sec, new_tokens(rows))
    steps = max(len(e["ids"]) - e["prompt_len"] for e in eps)  # as many steps as our longest row
    tags = tag_ids(tokenizer)
    starts = [tags["bos"] + encode(tokenizer, p) for p in prompts]
    width = max(map(len, starts))
    ids = torch.tensor([[tags["pad"]] * (width - len(x)) + x for x in starts], device=device)
    sec, _ = timed(
        lambda: model.generate(
            input_ids=ids,
            attention_mask=(ids != tags["pad"]).long(),
            do_sample=True,
            top_k=0,
            max_new_tokens=steps,
            min_new_tokens=steps,
            pad_token_id=tags["pad"],
            eos_token_id=None,
        ),
        repeats,
        device,
    )
    results["generate_one_call"] = figure(sec, steps * len(prompts))
    return results, eps


def bench_update(model, tokenizer, episodes, cfg, group_size, repeats, device):
    """The old-logprob forward over the batch (what reuse_sampler_logprobs skips), one RL step."""
    rewards = [float(i % 2) for i in range(len(episodes))]  # every group mixed
    groups = [i // group_size for i in range(len(episodes))]
    batch = make_batch(episodes, rewards, groups, cfg, tokenizer.pad_token_id)
    n_tok = sum(batch["lengths"])
    sec, _ = timed(lambda: token_logprobs(model, batch["ids"].to(device)).sum().item(), repeats, device)
    results = {"old_logprob_forward": figure(sec, n_tok)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    sec, (sums, _) = timed(
        lambda: rl_step(model, model, opt, episodes, rewards, groups, cfg, tokenizer.pad_token_id),
        repeats,
        device,
    )
    results["train_step"] = figure(sec, n_tok, pad_frac=sums["pad_frac"])
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--ckpt",
        default=None,
        help="a trained checkpoint (default: out/small/ckpt if any; '' for random weights)",
    )
    parser.add_argument("--size", default="demo", choices=sorted(SIZES))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--group_size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default="bench.json")
    args = parser.parse_args(argv)
    cfg = {**DEFAULTS, "device": args.device}
    ckpt = args.ckpt  # "" asks for random weights
    if ckpt is None and args.size == "demo" and os.path.isdir("out/small/ckpt"):
        ckpt = "out/small/ckpt"
    if ckpt:
        model, tokenizer = load_policy(ckpt, args.device)
    else:
        tokenizer = build_tokenizer(world.WORDS)
        layers, width, heads, kv, mlp = SIZES[args.size]
        torch.manual_seed(0)
        model = LlamaForCausalLM(
            LlamaConfig(
                vocab_size=len(tokenizer),
                hidden_size=width,
                intermediate_size=mlp,
                num_hidden_layers=layers,
                num_attention_heads=heads,
                num_key_value_heads=kv,
                max_position_embeddings=256,
                tie_word_embeddings=True,
            )
        ).to(args.device)
    model.eval()
    cuda = args.device.startswith("cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    tasks = world.make_splits(0, 10, 0, 200, 10)["rl"][: args.tasks]
    prompts = [t["prompt"] for t in tasks for _ in range(args.group_size)]
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model {ckpt or args.size} ({n_params / 1e6:.2f}M parameters) on {args.device}, {len(prompts)} rows "
        f"({args.tasks} tasks x {args.group_size}), {torch.get_num_threads()} threads"
    )
    results = {
        "model": ckpt or args.size,
        "parameters": n_params,
        "device": args.device,
        "rows": len(prompts),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
    }
    with amp:
        sampling, episodes = bench_sampling(model, tokenizer, prompts, cfg, args.repeats, args.device)
        results.update(sampling)
        results.update(
            bench_update(model, tokenizer, episodes, cfg, args.group_size, args.repeats, args.device)
        )
    results["peak_memory_mb"] = (
        torch.cuda.max_memory_allocated() / 2**20
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    for mode in ("rehearse", "real"):
        results[f"ratio_{mode}"] = (
            results[f"sampler_{mode}"]["tok_per_s"] / results[f"generate_{mode}"]["tok_per_s"]
        )
    results["ratio_vs_one_call"] = (
        results["sampler_rehearse"]["tok_per_s"] / results["generate_one_call"]["tok_per_s"]
    )
    for k, v in results.items():
        if isinstance(v, dict):
            extra = f", padding {v['pad_frac']:.1%}" if "pad_frac" in v else ""
            ms = v["seconds"] * 1e3
            print(f"{k:20s} {v['tok_per_s']:9.0f} tok/s ({v['tokens']} tokens in {ms:.1f} ms{extra})")
    print(
        f"sampler / generate on the same episodes: rehearse {results['ratio_rehearse']:.2f}x, real "
        f"{results['ratio_real']:.2f}x; sampler (rehearse) / one generate call: "
        f"{results['ratio_vs_one_call']:.2f}x; peak memory {results['peak_memory_mb']:.0f} MB"
    )
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
