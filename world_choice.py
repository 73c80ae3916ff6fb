"""`world: choice`: a task family where private rehearsal can pay (issue 15 part 2, claim 4).

The paper's claim (4): imagining N episodes before the one real execution adds success at a
moderate budget. On the toy demo it cannot show: the errors left are decisions imagination does
not expose. Here an imagined outcome tells the actor something it did not know when it chose, and
real calls are not free:

    task          choice_kind costs (configs/choice.yaml): `cheapest 3 fig 5 apple`: buy the item
                  of the cheaper of `choice_items` (2) options `Q ITEM`, Q of ITEM costing
                  Q * price (12 vs 15: fig); costs distinct, so one item is right.
                  choice_kind items (the control, configs/choice_items.yaml): `cheapest fig
                  apple milk`, the cheapest of 3 items (prices distinct)
    the world     `price ITEM` -> its price (or `error item`), `mul A , B` -> A * B, as in world.py
                  (no wallet); `buy ITEM` is the purchase: the act that ends the episode (read
                  like `answer`: the answer is ITEM)
    the budget    ONE real call per task, the purchase: the episode's first real action decides
                  it. Success iff the episode's first act is `buy CHEAPEST` (`choice_reward`); a
                  real lookup before it spends the budget and the episode scores 0, even if it
                  buys right afterwards (rollout.py is not edited: the reward enforces it)
    imagination   the same world model that the warm start taught every price and product (the
                  logged tool traffic covers `price ITEM` for all 24 items and `mul A , B` for
                  all one-digit pairs), so imagined calls are free and mostly right: an imagined
                  episode on the bare task prompt prices each option (and multiplies), rehearsing
                  each response, and buys the cheapest of what it imagined

Two prompts per task, so that the one policy knows whether it imagines or commits:

    explore    `cheapest 3 fig 5 apple`                  imagined episodes (rehearse mode):
               price fig / 4, mul 3 , 4 / 12, price apple / 3, mul 5 , 3 / 15, buy fig
               (the expert when calls are free)
    commit     `cheapest 3 fig 5 apple memory ...`       the committed real episode: its prompt
               carries the REHEARSAL MEMORY (rehearsal_memory.memory_text) of the N imagined
               episodes, `memory` alone at N = 0; the expert buys the cheapest at once

At N = 0 the actor must pick in one forward from what its weights hold (two memorised prices,
each multiplied by its quantity, then compared, with nothing written out); with a memory it can
copy what its imagination found: `memory tried price fig got 4 mul 3 , 4 got 12 price apple got 3
mul 5 , 3 got 15 answer fig good`. (In the items control the one-forward choice is already right:
0.996 at N = 0 after the warm start.)

How the actor learns to read a memory (the warm start, `warm_start_sequences`): every logged
task gives an explore episode (the expert's K lookups and purchase; ACT and OBS trained) and a
commit episode whose prompt carries a memory of k = 0..memory_max imagined episodes (k uniform),
target `buy CHEAPEST` (ACT). Those imagined episodes are SYNTHETIC (`imagined_episode`): an
imperfect imaginer whose each imagined price is wrong with probability memory_noise (its product
follows it), which stops before its purchase with probability memory_noise (unfinished), and
which buys the cheapest of what it imagined; each self-assessed by rehearsal_memory.self_assess.
Then RL (features.py: `choice_features`, rehearse mode, no real world): for each episode N is drawn uniformly from
0..memory_max, the CURRENT policy imagines N episodes and the committed episode reads their
memory; its reward is the choice's.

Splits (`make_splits`): test tasks are held-out SETS (of options `Q ITEM`, or of items): no test
set is ever in a logged or RL task (in any order), so the N = 0 actor cannot recall the answer of
a set it has seen.

The measurement (`memory_sweep`, `python world_choice.py --ckpt RUN`): success at N = 0, 1, 2, 4
imagined episodes, then ONE committed real episode; the imagined episodes never call the real
world (a counting world proves it: tests/test_world_choice.py), so every setting makes the same
real calls per task. Parallel: N independent imagined episodes; sequential: one at a time,
stopping once two imagined episodes judged `good` agree on the item (or N are spent). For the
policy as its own rehearser and for its warm start playing the world in imagination (frozen).
`--diagnose` classes imagined episodes (right, unfinished, a wrong response, a wrong purchase).
Measured (docs/imagination.md, one seed): with two options a memory did not raise success over
N = 0 (0.970): the imagined world was right, the imagined actor's comparison of the costs was not
better; with three options (0.752 at N = 0) four imagined episodes pooled did (0.794, sequential).

Simplified: the memory the warm start reads is synthetic, not sampled from a first warm start;
RL trains the committed episode only (the imagined ones are context, not in the update).
"""
import argparse
import itertools
import json
import os
import random
import sys
from types import SimpleNamespace

import torch

import rehearsal_memory
import world
from envace import ACT, PROMPT, TAG, encode, encode_episode, tag_ids
from rollout import sample_episodes

TOOL_KINDS = {"price": "lookup", "mul": "compute"}
ERROR_WORDS = world.ERROR_WORDS
NEW_WORDS = ["cheapest"] + [w for w in rehearsal_memory.MEMORY_WORDS if w not in world.WORDS]
WORDS = world.WORDS + NEW_WORDS
BUDGETS = (0, 1, 2, 4)
QUANTITIES = world.QUANTITIES               # 2..9


# ----------------------------------------------------------------------------- the world

def parse_call(text):
    """`price ITEM` -> ("price", (ITEM,)), `mul A , B` -> ("mul", (A, B)) as world.parse_call;
    anything else (a payment among them) -> None."""
    call = world.parse_call(text)
    return call if call and call[0] in TOOL_KINDS else None


def read_act(text):
    """The actor's text -> ("answer", ITEM) for the purchase `buy ITEM` (it ends the episode),
    ("call", 'price ITEM') for a lookup, else ("bad_call", None)."""
    w = world.join_digits(text)
    if len(w) == 2 and w[0] == "buy" and w[1] in world.PRICES:
        return "answer", w[1]
    if parse_call(text) is None:
        return "bad_call", None
    return "call", " ".join(w)


def next_turn(answered):
    return None


def new_state():
    return {}


def step(state, call_text):
    """A real call: world.step's answer to a lookup or a product (neither touches a wallet);
    `error call` for anything else."""
    return world.step(world.new_state(), call_text) if parse_call(call_text) else "error call"


response_form = world.response_form


def replay(calls):
    return [step(new_state(), c) for c in calls]


parse_response = world.parse_response


def counting_world():
    """This world with every real call counted in its `.real_calls` (tests: imagination makes none)."""
    counted = SimpleNamespace(real_calls=0, parse_call=parse_call, read_act=read_act, next_turn=next_turn,
                              new_state=new_state, parse_response=parse_response, response_form=response_form,
                              replay=replay, TOOL_KINDS=TOOL_KINDS, ERROR_WORDS=ERROR_WORDS)

    def counted_step(state, call_text):
        counted.real_calls += 1
        return step(state, call_text)
    counted.step = counted_step
    return counted


# ----------------------------------------------------------------------------- tasks

def choice_task(items, quantities=None):
    """The task of buying the cheapest of `items` (in prompt order), or with `quantities` (choice:
    costs) the cheapest of the options `Q ITEM` (Q of ITEM cost Q * price): prompt (explore form),
    answer (the item of the cheapest option), the expert's calls when calls are free (`calls`:
    per option `price ITEM`, then `mul Q , P` for a quantity), family "choice"."""
    quantities = quantities or [None] * len(items)
    options = [f"{q} {i}" if q else i for q, i in zip(quantities, items)]
    calls = []
    for q, i in zip(quantities, items):
        calls += [f"price {i}"] + ([f"mul {q} , {world.PRICES[i]}"] if q else [])
    totals = [(q or 1) * world.PRICES[i] for q, i in zip(quantities, items)]
    return {"prompt": "cheapest " + " ".join(options), "answer": items[totals.index(min(totals))],
            "calls": calls, "family": "choice", "items": list(items),
            "quantities": [q for q in quantities if q] or None}


def item_sets(k):
    """Every set of k catalogue items with k distinct prices, sorted (3: 1574 sets of 2024)."""
    return [s for s in itertools.combinations(sorted(world.ITEMS), k) if len({world.PRICES[i] for i in s}) == k]


def option_sets(k):
    """choice: costs: every set of k options (Q 2..9, ITEM) of k different items whose costs Q * price
    are distinct, sorted, as tuples of (Q, ITEM)."""
    options = [(q, i) for q in QUANTITIES for i in sorted(world.ITEMS)]
    return [s for s in itertools.combinations(options, k)
            if len({i for _, i in s}) == k and len({q * world.PRICES[i] for q, i in s}) == k]


def make_splits(cfg):
    """test: n_test distinct item sets (choice: costs: option sets), each in one random order; rl
    (n_rl_tasks) and logged (n_logged): random orders of the OTHER sets, drawn with replacement.
    RNG data_seed + 6."""
    from config import ConfigError
    rng = random.Random(cfg["data_seed"] + 6)
    costs = cfg["choice_kind"] == "costs"
    sets = option_sets(cfg["choice_items"]) if costs else item_sets(cfg["choice_items"])
    rng.shuffle(sets)
    if cfg["n_test"] >= len(sets):
        raise ConfigError(f"n_test ({cfg['n_test']}) must be less than the {len(sets)} item sets of "
                          f"choice_items {cfg['choice_items']}: test sets are held out from training")
    test, rest = sets[:cfg["n_test"]], sets[cfg["n_test"]:]

    def shuffled(s):
        s = list(s)
        rng.shuffle(s)
        return choice_task([i for _, i in s], [q for q, _ in s]) if costs else choice_task(s)
    splits = {"test": [shuffled(s) for s in test]}
    splits["rl"] = [shuffled(rng.choice(rest)) for _ in range(cfg["n_rl_tasks"])]
    splits["logged"] = [shuffled(rng.choice(rest)) for _ in range(cfg["n_logged"])]
    return splits


def choice_reward(episode, task):
    """1.0 iff the episode's first act was `buy CHEAPEST`: it ended at a purchase, of the right
    item, with no lookup before it (a real lookup spent the one real call: 0)."""
    return float(episode["cause"] == "answer" and episode["answer"] == task["answer"] and not episode["calls"])


# ----------------------------------------------------------------------------- memories

def commit_prompt(task_prompt, imagined):
    """The committed episode's prompt: the task, then the memory of its imagined episodes
    (rehearsal_memory.memory_text), or `memory` alone when none was imagined (N = 0)."""
    return rehearsal_memory.memory_prompt(task_prompt, imagined) if imagined else f"{task_prompt} memory"


def task_prompt_of(prompt):
    """The task (explore) prompt of a commit prompt: what precedes its ` memory`."""
    return prompt.split(" memory", 1)[0]


def imagined_episode(rng, task, noise):
    """One SYNTHETIC imagined episode of `task` (the logged memories of the warm start): with
    probability `noise` it stops after 0..C-1 of the expert's C calls (unfinished); each imagined
    price is the true one, or with probability `noise` another price 1..9, and a `mul Q , P` (in
    choice: costs) multiplies the imagined price; a finished episode buys the item of the cheapest
    imagined option (the first on a tie). The fields of rollout.sample_episodes' episodes that
    rehearsal_memory reads: calls, responses, answer, finished, cause."""
    items, quantities = task["items"], task.get("quantities") or [None] * len(task["items"])
    n_calls = len(task["calls"])
    made = rng.randrange(n_calls) if rng.random() < noise else n_calls
    calls, responses, totals = [], [], []
    for q, item in zip(quantities, items):
        true = world.PRICES[item]
        price = rng.choice([p for p in range(1, 10) if p != true]) if rng.random() < noise else true
        calls += [f"price {item}"] + ([f"mul {q} , {price}"] if q else [])
        responses += [str(price)] + ([str(q * price)] if q else [])
        totals.append((q or 1) * price)
    finished = made == n_calls
    return {"calls": calls[:made], "responses": responses[:made],
            "answer": items[totals.index(min(totals))] if finished else None,
            "finished": finished, "cause": "answer" if finished else "bad_call"}


def encode_choice(tokenizer, prompt, calls, responses, item, act_role=ACT):
    """ids and roles of an episode of this world, as the sampler builds them: the prompt (PROMPT:
    a memory in it is context, never trained), each call and its logged response (OBS), then
    `<act> buy ITEM </act>`."""
    episode = encode_episode(tokenizer, prompt, calls, responses, act_role=act_role)
    tags = tag_ids(tokenizer)
    purchase = encode(tokenizer, f"buy {item}") + [tags["act_end"]]
    return {"ids": episode["ids"] + tags["act"] + purchase,
            "roles": episode["roles"] + [TAG] * len(tags["act"]) + [act_role] * len(purchase)}


def logged_memory(rng, task, cfg):
    """The imagined episodes of a logged commit episode: k uniform in 0..memory_max, synthetic."""
    return [imagined_episode(rng, task, cfg["memory_noise"]) for _ in range(rng.randint(0, cfg["memory_max"]))]


def tool_snippets(cfg):
    """Logged tool traffic (the world model's): every item's `price ITEM` (and in choice: costs every
    `mul A , B` of one-digit factors), snippet_repeats times, behind 0-2 other lookups and, half
    the time, after an unrelated task prompt. RNG data_seed + 7."""
    rng = random.Random(cfg["data_seed"] + 7)
    targets = [f"price {i}" for i in world.ITEMS]
    if cfg["choice_kind"] == "costs":
        targets += [f"mul {a} , {b}" for a in range(1, 10) for b in range(1, 10)]
    snippets = []
    for _ in range(cfg["snippet_repeats"]):
        for target in targets:
            lead = [f"price {rng.choice(world.ITEMS)}" for _ in range(rng.randint(0, 2))]
            prompt = choice_task(rng.sample(world.ITEMS, cfg["choice_items"]))["prompt"] if rng.random() < 0.5 else ""
            snippets.append({"prompt": prompt, "calls": lead + [target]})
    rng.shuffle(snippets)
    return snippets


def warm_start_sequences(tokenizer, splits, cfg):
    """The warm start's rows: per logged task its explore episode and its commit episode (a
    synthetic memory, `logged_memory`; RNG data_seed + 8), then the lookup snippets (calls PROMPT)."""
    rng = random.Random(cfg["data_seed"] + 8)
    rows = []
    for t in splits["logged"]:
        rows.append(encode_choice(tokenizer, t["prompt"], t["calls"], replay(t["calls"]), t["answer"]))
        rows.append(encode_choice(tokenizer, commit_prompt(t["prompt"], logged_memory(rng, t, cfg)), [], [],
                                  t["answer"]))
    for s in tool_snippets(cfg):
        rows.append(encode_episode(tokenizer, s["prompt"], s["calls"], replay(s["calls"]), act_role=PROMPT))
    return rows


# ----------------------------------------------------------------------------- private rehearsal

def imagine(policy, tokenizer, prompts, budget, mode="parallel", rehearser=None, world_=None, generator=None,
            temperature=1.0, **limits):
    """The paper's rule, imagination: up to `budget` imagined episodes per task prompt (explore form),
    in rehearse mode (the policy plays the world) or, with a `rehearser`, frozen (it plays the
    world). parallel: `budget` at once; sequential: one per task at a time until two imagined
    episodes judged `good` (rehearsal_memory.self_assess) agree on the item. No real call.
    Returns, per task, its imagined episodes in order."""
    imagined = [[] for _ in prompts]
    env_mode = "rehearse" if rehearser is None else "frozen"
    per_task = budget if mode == "parallel" else 1
    for _ in range(budget if mode == "sequential" else (1 if budget else 0)):
        todo = [i for i in range(len(prompts)) if mode == "parallel" or not agreed(imagined[i])]
        if not todo:
            break
        episodes = sample_episodes(policy, tokenizer, [prompts[i] for i in todo for _ in range(per_task)], env_mode,
                                   env_model=rehearser, world=world_ or sys.modules[__name__], generator=generator,
                                   temperature=temperature, **limits)
        for k, e in enumerate(episodes):
            imagined[todo[k // per_task]].append(e)
    return imagined


def agreed(episodes):
    """Two imagined episodes judged `good` bought the same item (sequential imagination stops)."""
    answers = [e["answer"] for e in episodes if rehearsal_memory.self_assess(e) == "good"]
    return len(answers) > len(set(answers))


def sample_with_memory(policy, tokenizer, prompts, env_mode="rehearse", *, memory_max=4, imagine_temperature=1.0,
                       env_model=None, world=None, generator=None, temperature=1.0, **kw):
    """The RL sampler of this world (features.choice_features' `sample`; train.py uses it in
    rehearse and frozen modes): for each commit prompt N is drawn uniformly from 0..memory_max,
    the current policy imagines N parallel episodes of the task (the simulator plays the world
    there too in frozen mode), and the committed episode, the one returned and trained, reads
    their memory. Imagined episodes are context: not returned, not trained."""
    world = world or sys.modules[__name__]
    limits = {k: v for k, v in kw.items() if k not in ("plans", "rows")}
    budgets = torch.randint(0, memory_max + 1, (len(prompts),), generator=generator).tolist()
    tasks = [task_prompt_of(p) for p in prompts]
    memories = [[] for _ in prompts]
    for n in sorted(set(budgets) - {0}):
        index = [i for i, b in enumerate(budgets) if b == n]
        for i, episodes in zip(index, imagine(policy, tokenizer, [tasks[i] for i in index], n, "parallel", env_model,
                                              world, generator, imagine_temperature, **limits)):
            memories[i] = episodes
    return sample_episodes(policy, tokenizer, [commit_prompt(t, m) for t, m in zip(tasks, memories)], env_mode,
                           env_model=env_model, world=world, generator=generator, temperature=temperature, **kw)


def expert_episodes(tokenizer, tasks):
    """The expert's explore episodes of `tasks` (their K real lookups, then the purchase) as rows
    with calls and responses: what the would-rehearse fidelity (and the gate) reads here, since a
    committed episode makes no lookup to compare."""
    rows = []
    for t in tasks:
        responses = replay(t["calls"])
        rows.append({**encode_choice(tokenizer, t["prompt"], t["calls"], responses, t["answer"]),
                     "calls": t["calls"], "responses": responses})
    return rows


# ----------------------------------------------------------------------------- the measurement

def committed_success(model, tokenizer, tasks, cfg, budget, mode="parallel", rehearser=None, seed=0,
                      batch_size=256):
    """Success at `budget` imagined episodes per task (the paper's rule), then ONE committed real
    episode reading their memory (eval sampling: eval_temperature). Imagination at
    imagine_temperature. Both in one counting world: `imagination_real_calls` (must be 0) and the
    committed episodes' real lookups per task (`real_lookups_per_task`; the purchase is the one
    real call a task is allowed). Returns the figures and per-task `task_rewards`."""
    model.eval()
    generator = torch.Generator().manual_seed(seed)
    limits = {k: cfg[k] for k in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
    counted = counting_world()
    imagined = []
    with torch.no_grad():
        for k in range(0, len(tasks), batch_size):
            imagined += imagine(model, tokenizer, [t["prompt"] for t in tasks[k:k + batch_size]], budget, mode,
                                rehearser, counted, generator, cfg["imagine_temperature"], top_p=cfg["top_p"], **limits)
        imagination_calls = counted.real_calls
        committed = []
        for k in range(0, len(tasks), batch_size):
            prompts = [commit_prompt(t["prompt"], m) for t, m in zip(tasks[k:k + batch_size], imagined[k:k + batch_size])]
            committed += sample_episodes(model, tokenizer, prompts, "real", world=counted,
                                         temperature=cfg["eval_temperature"], top_p=cfg["top_p"], generator=generator,
                                         **limits)
    rewards = [choice_reward(e, t) for e, t in zip(committed, tasks)]
    flat = [(e, t) for m, t in zip(imagined, tasks) for e in m]
    verdicts = {v: sum(rehearsal_memory.self_assess(e) == v for e, _ in flat) for v in ("good", "bad", "unfinished")}
    return {"success": sum(rewards) / len(tasks), "task_rewards": rewards,
            "imagined_per_task": len(flat) / len(tasks),
            "imagined_right": sum(e["answer"] == t["answer"] for e, t in flat) / len(flat) if flat else None,
            "imagined_fidelity": imagined_fidelity([e for e, _ in flat]),
            "by_memory": by_memory(imagined, committed, tasks),
            "verdicts": verdicts, "imagination_real_calls": imagination_calls,
            "real_lookups_per_task": (counted.real_calls - imagination_calls) / len(tasks),
            "purchases_per_task": sum(e["cause"] == "answer" for e in committed) / len(tasks)}


def imagined_fidelity(episodes):
    """Per tool kind [matches, total]: the imagined responses against the real world's to the same calls."""
    counts = {}
    for e in episodes:
        for call, imagined, truth in zip(e["calls"], e["responses"], replay(e["calls"])):
            cell = counts.setdefault(TOOL_KINDS[parse_call(call)[0]] if parse_call(call) else "other", [0, 0])
            cell[0] += imagined == truth
            cell[1] += 1
    return counts


def memory_majority(episodes):
    """The item most often bought by the `good` imagined episodes (the first on a tie), or None."""
    answers = [e["answer"] for e in episodes if rehearsal_memory.self_assess(e) == "good"]
    return max(answers, key=answers.count) if answers else None


def by_memory(imagined, committed, tasks):
    """How the committed choice relates to its memory: per kind of memory (`right`: its good
    episodes' majority bought the cheapest; `wrong`: another item; `none`: no good episode),
    [tasks, committed right, committed the memory's majority]."""
    out = {"right": [0, 0, 0], "wrong": [0, 0, 0], "none": [0, 0, 0]}
    for m, e, t in zip(imagined, committed, tasks):
        majority = memory_majority(m)
        cell = out["none" if majority is None else ("right" if majority == t["answer"] else "wrong")]
        cell[0] += 1
        cell[1] += choice_reward(e, t)
        cell[2] += majority is not None and e["answer"] == majority
    return out


def memory_sweep(model, tokenizer, tasks, cfg, rehearsers, budgets=BUDGETS, modes=("parallel", "sequential")):
    """Success against N for each rehearser ({name: model, or None for the policy itself}) and
    mode, each N > 0 with its paired-bootstrap difference to N = 0 over the test tasks
    (experiments.paired_bootstrap; N = 0 imagines nothing, so it is measured once). One row each."""
    from experiments import paired_bootstrap
    base = committed_success(model, tokenizer, tasks, cfg, 0, seed=cfg["seed"])
    rows = []
    for name, rehearser in rehearsers.items():
        for mode in modes:
            for n in budgets:
                m = base if n == 0 else committed_success(model, tokenizer, tasks, cfg, n, mode, rehearser, cfg["seed"])
                mean, low, high, _ = paired_bootstrap({0: m["task_rewards"]})
                row = {"rehearser": name, "mode": mode, "budget": n, **m, "interval": [low, high]}
                if n:
                    diff, dlow, dhigh, called = paired_bootstrap({0: m["task_rewards"]}, {0: base["task_rewards"]})
                    row["vs_0"] = {"diff": diff, "interval": [dlow, dhigh], "called": bool(called)}
                rows.append(row)
    return rows


def cost_bucket(task):
    """choice: costs: the two costs' digits and their gap, e.g. ("both two digits", "gap 3+")."""
    low, high = sorted(q * world.PRICES[i] for q, i in zip(task["quantities"], task["items"]))[:2]
    digits = "both one digit" if high < 10 else ("both two digits" if low >= 10 else "one and two digits")
    return digits, "gap 1-2" if high - low <= 2 else "gap 3+"


def diagnose(model, tokenizer, tasks, cfg):
    """Why imagination does not beat the one-forward choice (choice: costs): one imagined episode
    per task at T = imagine_temperature and at T = 0, each classed (right; unfinished; wrong with
    calls other than the expert's; wrong with the expert's calls but a wrong response; wrong with
    the expert's calls and true responses: a wrong purchase), and the wrong purchases of greedy
    imagination and of N = 0 per cost bucket (`cost_bucket`). Returns a dict of counts."""
    limits = {k: cfg[k] for k in ("max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
    generator = torch.Generator().manual_seed(cfg["seed"])
    out = {}
    for temperature in (cfg["imagine_temperature"], 0.0):
        episodes = [m[0] for m in imagine(model, tokenizer, [t["prompt"] for t in tasks], 1, "parallel", None,
                                          sys.modules[__name__], generator, temperature, **limits)]
        classes = {}
        for e, t in zip(episodes, tasks):
            k = ("unfinished" if not e["finished"] else "right" if e["answer"] == t["answer"] else
                 "wrong: other calls" if e["calls"] != t["calls"] else
                 "wrong: a wrong response" if e["responses"] != replay(e["calls"]) else "wrong: true responses, wrong purchase")
            classes[k] = classes.get(k, 0) + 1
        out[f"imagined at T={temperature}"] = dict(sorted(classes.items()))
    direct = committed_success(model, tokenizer, tasks, cfg, 0, seed=cfg["seed"])["task_rewards"]
    buckets = {}
    for e, r, t in zip(episodes, direct, tasks):
        cell = buckets.setdefault(" / ".join(cost_bucket(t)), [0, 0, 0])
        cell[0] += 1
        cell[1] += e["finished"] and e["answer"] != t["answer"]
        cell[2] += 1 - int(r)
    out["wrong purchases by cost bucket: [tasks, greedy imagination, N = 0]"] = dict(sorted(buckets.items()))
    return out


def sweep_line(r):
    diff = r.get("vs_0")
    vs = (f" | vs N=0 {diff['diff']:+.3f} [{diff['interval'][0]:+.3f}, {diff['interval'][1]:+.3f}]"
          f"{' called' if diff['called'] else ''}") if diff else ""
    right = "-" if r["imagined_right"] is None else f"{r['imagined_right']:.3f}"
    fid = ", ".join(f"{k} {m / n:.3f}" for k, (m, n) in sorted(r.get("imagined_fidelity", {}).items()) if n)
    memo = " ".join(f"{k} {c[1]}/{c[0]}" for k, c in r.get("by_memory", {}).items() if c[0])
    right += f", fidelity {fid}" if fid else ""
    return (f"{r['rehearser']:10s} {r['mode']:10s} N={r['budget']}: success {r['success']:.3f} "
            f"[{r['interval'][0]:.3f}, {r['interval'][1]:.3f}]{vs} | {r['imagined_per_task']:.2f} imagined "
            f"(right {right}), {r['real_lookups_per_task']:.2f} real lookups, {r['purchases_per_task']:.2f} "
            f"purchases per task, {r['imagination_real_calls']} real calls in imagination"
            + (f" | right by memory: {memo}" if r["budget"] else ""))


def report(folder):
    """The tables and the figure of `folder` (configs/run_choice.sh's results): per model (the warm
    start, the RL model), rehearser and mode, success at each N, mean and 95% interval from the
    paired bootstrap over seeds and test tasks, and the difference to N = 0. Writes
    FOLDER/results.md and FOLDER/choice.png; returns the markdown."""
    import glob
    import re
    from experiments import cell
    runs = {}
    for path in sorted(glob.glob(os.path.join(folder, "sweep_*-seed*.json"))):
        model, seed = re.match(r"sweep_(.+)-seed(\d+)\.json", os.path.basename(path)).groups()
        for r in json.load(open(path)):
            runs.setdefault((model, r["rehearser"], r["mode"]), {}).setdefault(r["budget"], {})[int(seed)] = r
    lines = ["| model | rehearser | mode | seeds | " + " | ".join(f"N = {n}" for n in BUDGETS)
             + " | " + " | ".join(f"N = {n} - N = 0" for n in BUDGETS[1:]) + " |",
             "|" + "---|" * (4 + 2 * len(BUDGETS) - 1)]
    curves = {}
    for (model, rehearser, mode), by_n in sorted(runs.items()):
        rewards = {n: {s: r["task_rewards"] for s, r in by_n[n].items()} for n in BUDGETS if n in by_n}
        seeds = sorted(rewards[0])
        lines.append(f"| {model} | {rehearser} | {mode} | {len(seeds)} | "
                     + " | ".join(cell(rewards[n]) if n in rewards else "-" for n in BUDGETS) + " | "
                     + " | ".join(cell(rewards[n], rewards[0]) if n in rewards else "-" for n in BUDGETS[1:]) + " |")
        from experiments import paired_bootstrap
        curves[f"{model}, {rehearser} rehearses, {mode}"] = [paired_bootstrap(rewards[n])[:3] for n in BUDGETS
                                                             if n in rewards]
    lines += ["", "Paired against N = 0, summed over seeds: tasks N = 0 got wrong and N = k right (fixed), and the "
              "reverse (broken); the committed choice by kind of memory (its good imagined episodes' majority "
              "right / wrong / none): committed right of tasks; imagined responses' fidelity.", "",
              "| model | rehearser | mode | N | fixed | broken | memory right | memory wrong | no good memory | "
              "imagined fidelity |", "|" + "---|" * 10]
    for (model, rehearser, mode), by_n in sorted(runs.items()):
        for n in BUDGETS[1:]:
            if n not in by_n:
                continue
            pairs = [(a, b) for s in by_n[n] for a, b in zip(by_n[0][s]["task_rewards"], by_n[n][s]["task_rewards"])]
            memo = {k: [sum(r["by_memory"][k][j] for r in by_n[n].values()) for j in range(3)]
                    for k in ("right", "wrong", "none")} if all("by_memory" in r for r in by_n[n].values()) else None
            fid = {}
            for r in by_n[n].values():
                for kind, (m, t) in r.get("imagined_fidelity", {}).items():
                    fid[kind] = [fid.get(kind, [0, 0])[0] + m, fid.get(kind, [0, 0])[1] + t]
            lines.append(f"| {model} | {rehearser} | {mode} | {n} | {sum(a < b for a, b in pairs)} | "
                         f"{sum(a > b for a, b in pairs)} | "
                         + (" | ".join(f"{c[1]:.0f}/{c[0]}" for c in memo.values()) if memo else "- | - | -") + " | "
                         + ", ".join(f"{k} {m / t:.3f}" for k, (m, t) in sorted(fid.items()) if t) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(folder, "results.md"), "w") as f:
        f.write(text)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for k, (name, points) in enumerate(curves.items()):
        x = [n + 0.04 * (k - len(curves) / 2) for n in BUDGETS[:len(points)]]
        mean = [p[0] for p in points]
        ax.errorbar(x, mean, yerr=[[m - p[1] for m, p in zip(mean, points)], [p[2] - m for m, p in zip(mean, points)]],
                    marker="o", capsize=3, label=name)
    ax.set_xlabel("imagined episodes per task N (then one committed real episode)")
    ax.set_ylabel("real-world success (95% interval)")
    ax.set_xticks(BUDGETS)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(folder, "choice.png"), dpi=120)
    return text


def main(argv=None):
    """python world_choice.py --ckpt RUN [--rehearser CKPT] [--n_test N] [--out FILE]: the N sweep
    of a run folder of train.py (its latest checkpoint) or a checkpoint (warmstart/). The
    rehearser defaults to RUN/warmstart when RUN has one (the warm start playing the world).
    python world_choice.py --report RESULTS: the tables and figure of configs/run_choice.sh.
    python world_choice.py --ckpt RUN --diagnose: why imagination does not beat N = 0 (`diagnose`)."""
    from checkpoint import load_policy
    from config import ConfigError
    from distributed import pick_device
    from evaluate import load_run
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ckpt", help="a run folder of train.py, or a checkpoint in it")
    parser.add_argument("--report", help="a results folder of configs/run_choice.sh: its tables and figure")
    parser.add_argument("--rehearser", help="a checkpoint that plays the world in imagination (default RUN/warmstart)")
    parser.add_argument("--n_test", type=int, default=None, help="the first N test tasks")
    parser.add_argument("--out", help="where the rows go (default <ckpt>/memory_sweep.json)")
    parser.add_argument("--diagnose", action="store_true",
                        help="why imagination does not beat N = 0 (choice: costs): imagined episodes classed, "
                             "wrong purchases by cost bucket (into --out, default <ckpt>/diagnosis.json)")
    args, overrides = parser.parse_known_args(argv)
    if args.report:
        print(report(args.report), end="")
        return 0
    try:
        if not args.ckpt:
            raise ConfigError("give --ckpt RUN (a run folder of train.py) or --report RESULTS")
        cfg, model, tokenizer, tasks, fx, _ = load_run(args.ckpt, overrides)
        if cfg["world"] != "choice":
            raise ConfigError(f"{args.ckpt} was trained with world: {cfg['world']}; this sweep is for world: choice")
        if args.n_test is not None and args.n_test < 1:
            raise ConfigError(f"--n_test must be at least 1, got {args.n_test}")
        rehearser_path = args.rehearser or os.path.join(args.ckpt, "warmstart")
        rehearsers = {"policy": None}
        if os.path.isfile(os.path.join(rehearser_path, "config.yaml")):
            rehearsers["warm start"] = load_policy(rehearser_path, pick_device(cfg))[0]
        elif args.rehearser:
            raise ConfigError(f"no checkpoint written by train.py in {args.rehearser}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tasks = tasks[:args.n_test] if args.n_test else tasks
    if args.diagnose:
        if cfg["choice_kind"] != "costs":
            print("error: --diagnose reads the costs of choice_kind: costs", file=sys.stderr)
            return 2
        result = diagnose(model, tokenizer, tasks, cfg)
        print(json.dumps(result, indent=1))
        out = args.out or os.path.join(args.ckpt, "diagnosis.json")
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"written to {out}")
        return 0
    rows = memory_sweep(model, tokenizer, tasks, cfg, rehearsers)
    for r in rows:
        print(sweep_line(r))
    out = args.out or os.path.join(args.ckpt, "memory_sweep.json")
    with open(out, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
