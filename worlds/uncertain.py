"""`world: uncertain`: the toy shop with stale logs, a world the policy must learn from reward.

The paper's claim (3), that a world model trained in the policy's own weights beats one not
trained with it (a frozen simulator, or the world role left untrained; docs/results.md), can only
show where the warm-started world model is wrong. In the toy demo it is not
(fidelity 0.99-1.00). Here it is, in the way logged traffic goes wrong in practice: the logs of
some items are STALE, written before a price change.

    uncertain items   `uncertain_items` items (8 of 24), chosen from data_seed (`uncertain_set`)
    the real world    world.py unchanged: the true prices answer every real call, RL and test
                      tasks are world.make_splits' own (the same tasks as the demo's)
    the logs          every logged episode (and every logged tool snippet) that prices an
                      uncertain item comes, with probability `stale_rate` (0.65) per item, from
                      a stale catalogue: a random OTHER price for that item, the episode's later
                      calls and its answer consistent with it (`stale_catalogue`, `stale_task`)

So the actor still knows every item (it is priced in the logs as often as any other), only the
responses to uncertain items are uncertain: the warm-started world model gives the true price
about 1 - 0.65 = 0.35 of the probability and ~0.08 to each of eight other prices. Greedy it
still writes the truth (the mode), so greedy fidelity reads ~1.000 and hides this; sampling at
T = 1 (RL) it is wrong ~65% of the time. The RL tasks and the real world never change, so
whatever the world model learns about the true prices during RL comes from the task reward.

Measured per RL step and at every evaluation (`truth_probe`, `subset_fidelity`), on the
uncertain and on the faithful items separately:
    p_true     the policy's next-token probability of the true price right after `<env>` for
               `price ITEM`, averaged over three prompts per item (`PROBE_PROMPTS`)
    p_exact    the probability of the whole true response (`P </env>`): expected sampled
               fidelity at T = 1
    greedy     whether the argmax is the true price
    sampled    in the RL batch: rehearsed `price ITEM` responses equal to the true price
               (rehearse and frozen arms: whoever played the world)
The collusion counts of honesty.collusion_counts are split the same way, and a wrong call is
told apart by whether the rehearsals before it were faithful (`collusion_by_subset`): a stale
price the actor copied into `mul` makes that call wrong without the actor deciding wrongly.

Why episodes fail (`failure_kind`, `failure_table`, `copy_counts`): the item looked up (the
distractor or another one), a response not copied into the next action, no answer. Greedy, in
the real world, per family x distractor position:
    python -m scripts.uncertain_report --failures RUN [--split rl] [--n 500]
Whether the actor looked up the items the task names (`looked_up`; a price of another item with
the same price answers right, and the reward cannot tell), per test task of every finished run:
    python -m scripts.uncertain_report --lookups RESULTS      # RESULTS/<arm>/<seed>/lookups.json

Simplified: one price per item per episode (a stale episode is stale throughout); the stale
price is drawn uniformly from the other prices that keep the task affordable.
"""
import random

import world
from worldmodel.honesty import collusion_counts

PROBE_PROMPTS = ("price {item}", "cost 2 {item}", "not {other} buy {item}")


def uncertain_set(seed, n):
    """The n uncertain items for data_seed `seed` (sorted; its own RNG, the demo's draws untouched)."""
    items = sorted(world.ITEMS)
    random.Random(seed + 3).shuffle(items)
    return sorted(items[:n])


def task_items(task):
    """(item, item2 or None, q or None) of a toy task, read from its expert calls."""
    priced = [c.split()[1] for c in task["calls"] if c.startswith("price ")]
    mul = [c for c in task["calls"] if c.startswith("mul ")]
    return priced[0], (priced[1] if len(priced) > 1 else None), (int(mul[0].split()[1]) if mul else None)


def expert_calls(family, q, item, item2, prices):
    """The scripted expert's calls (as world._expert_calls) under the catalogue `prices`."""
    p, p2 = prices[item], prices[item2] if item2 else None
    return {"price": [f"price {item}"],
            "cost": [f"price {item}", f"mul {q} , {p}"],
            "buy1": [f"price {item}", f"pay {p}"],
            "buyq": [f"price {item}", f"mul {q} , {p}", f"pay {q * p if q else 0}"],
            "buy2": [f"price {item}", f"pay {p}", f"price {item2}", f"pay {p2}"],
            "buyq2": [f"price {item}", f"mul {q} , {p}", f"pay {q * p if q else 0}", f"price {item2}",
                      f"pay {p2}"]}[family]


def spend(family, q, item, item2, prices):
    """What the task pays from the wallet under `prices` (0 for price/cost)."""
    p, p2 = prices[item], prices[item2] if item2 else 0
    return {"price": 0, "cost": 0, "buy1": p, "buyq": q * p if q else 0, "buy2": p + p2,
            "buyq2": (q * p if q else 0) + p2}[family]


def replay_with(calls, prices):
    """Responses to `calls` from a fresh wallet, `price` answered from the catalogue `prices`
    (what the logs recorded), every other call by the real world.step."""
    state, responses = world.new_state(), []
    for call in calls:
        parsed = world.parse_call(call)
        if parsed and parsed[0] == "price" and parsed[1][0] in prices:
            responses.append(str(prices[parsed[1][0]]))
        else:
            responses.append(world.step(state, call))
    return responses


def stale_catalogue(rng, items, uncertain, stale_rate, fits=lambda prices: True):
    """The catalogue one logged episode was written with: the true prices, except that each
    uncertain item among `items`, with probability stale_rate, gets a random other price, drawn
    among those for which fits(prices) (the task stays affordable). Returns (prices, stale items)."""
    prices, stale = dict(world.PRICES), []
    for item in items:
        if item in uncertain and rng.random() < stale_rate:
            options = [p for p in range(1, 10) if p != world.PRICES[item] and fits({**prices, item: p})]
            if options:
                prices[item] = rng.choice(options)
                stale.append(item)
    return prices, stale


def stale_task(task, rng, uncertain, stale_rate):
    """A logged expert task as the stale logs hold it: calls, responses and answer consistent with
    the catalogue it was written with. The prompt and family stay; adds "stale" (the stale items)."""
    item, item2, q = task_items(task)
    family = task["family"]
    prices, stale = stale_catalogue(rng, [i for i in (item, item2) if i], uncertain, stale_rate,
                                    lambda p: spend(family, q, item, item2, p) <= world.WALLET)
    if not stale:
        return {**task, "stale": []}
    calls = expert_calls(family, q, item, item2, prices)
    responses = replay_with(calls, prices)
    return {**task, "calls": calls, "responses": responses, "answer": responses[-1], "stale": stale}


def make_splits(cfg):
    """world.make_splits' splits (the demo's tasks: same seed, same draws), with the logged split
    made stale (`stale_task`; RNG data_seed + 4). RL and test tasks keep the true prices."""
    splits = world.make_splits(cfg["data_seed"], cfg["n_logged"], cfg["n_new_logged"], cfg["n_rl_tasks"],
                               cfg["n_test"], cfg["coverage"])
    rng, uncertain = random.Random(cfg["data_seed"] + 4), uncertain_set(cfg["data_seed"], cfg["uncertain_items"])
    splits["logged"] = [stale_task(t, rng, uncertain, cfg["stale_rate"]) for t in splits["logged"]]
    return splits


def tool_snippets(cfg):
    """world.tool_snippets (the same calls), each snippet with the responses its logs hold: its
    uncertain items stale with probability stale_rate each (RNG data_seed + 5). Adds "responses"."""
    rng, uncertain = random.Random(cfg["data_seed"] + 5), uncertain_set(cfg["data_seed"], cfg["uncertain_items"])
    snippets = []
    for s in world.tool_snippets(cfg["data_seed"], cfg["snippet_repeats"], cfg["coverage"]):
        items = sorted({c.split()[1] for c in s["calls"] if c.startswith("price ")} & set(world.PRICES))
        prices, _ = stale_catalogue(rng, items, uncertain, cfg["stale_rate"])
        snippets.append({**s, "responses": replay_with(s["calls"], prices)})
    return snippets


# ----------------------------------------------------------------------------- measures

def probe_rows(tokenizer, items=world.ITEMS):
    """[(item, prompt, ids)]: for every item and PROBE_PROMPTS, `<bos> PROMPT <act> price ITEM
    </act> <env> P </env>` with P the true price: teacher-forced, the logits after `<env>` give
    p(true price), those after P p(</env>)."""
    from envace import encode_episode
    rows = []
    for k, item in enumerate(items):
        other = items[(k + 1) % len(items)]
        for prompt in PROBE_PROMPTS:
            text = prompt.format(item=item, other=other)
            rows.append((item, encode_episode(tokenizer, text, [f"price {item}"], [str(world.PRICES[item])])["ids"]))
    return rows


def truth_probe(model, tokenizer, uncertain, temperature=1.0):
    """The world model's probability of the true response, per subset: {"uncertain": {...},
    "faithful": {...}}, each {"p_true", "p_exact", "greedy"} averaged over items and prompts."""
    import torch
    rows = probe_rows(tokenizer)
    length = max(len(r) for _, r in rows)
    ids = torch.tensor([r + [tokenizer.pad_token_id] * (length - len(r)) for _, r in rows])   # right-padded
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=ids.to(device)).logits.float().cpu() / temperature
    logp = torch.log_softmax(logits, -1)
    rows_at = torch.arange(len(rows))
    price_at = torch.tensor([len(r) - 2 for _, r in rows])       # the true price, then </env>
    p_true = logp[rows_at, price_at - 1, ids[rows_at, price_at]].exp()
    p_end = logp[rows_at, price_at, ids[rows_at, price_at + 1]].exp()
    greedy = logits[rows_at, price_at - 1].argmax(-1) == ids[rows_at, price_at]
    out = {}
    for name, keep in (("uncertain", True), ("faithful", False)):
        index = [i for i, (item, _) in enumerate(rows) if (item in uncertain) == keep]
        if index:
            out[name] = {"p_true": p_true[index].mean().item(), "p_exact": (p_true * p_end)[index].mean().item(),
                         "greedy": greedy[index].float().mean().item()}
    return out


def subset_fidelity(episodes, uncertain):
    """Sampled fidelity of the `price ITEM` responses in rehearsed (or frozen-simulated) episodes,
    per subset: {"uncertain": [true, total], "faithful": [true, total]} (catalogue items only)."""
    counts = {"uncertain": [0, 0], "faithful": [0, 0]}
    for e in episodes:
        for call, response in zip(e["calls"], e["responses"]):
            parsed = world.parse_call(call)
            if parsed and parsed[0] == "price" and parsed[1][0] in world.PRICES:
                cell = counts["uncertain" if parsed[1][0] in uncertain else "faithful"]
                cell[0] += response == str(world.PRICES[parsed[1][0]])
                cell[1] += 1
    return counts


def collusion_by_subset(episodes, tasks, uncertain):
    """honesty.collusion_counts per subset of tasks (a task is "uncertain" when its expert prices
    an uncertain item), and "decided": the counts over the calls whose earlier rehearsals in the
    episode were all faithful (a call made wrong by copying a stale rehearsal is not a wrong decision).
    Every count is a sum (adds over steps and ranks)."""
    out = {}
    for name, keep in (("uncertain", True), ("faithful", False)):
        pairs = [(e, t) for e, t in zip(episodes, tasks)
                 if t.get("calls") and bool(set(task_items(t)[:2]) & set(uncertain)) == keep]
        out[name] = collusion_counts([e for e, _ in pairs], [t for _, t in pairs])
    out["decided"] = collusion_counts([_faithful_prefix(e) for e in episodes], tasks)
    return out


def _faithful_prefix(e):
    """The episode cut before its first unfaithful rehearsal (the answer, if it had one, kept: the
    colluding count needs the episode's success, which the cut does not change)."""
    real = world.replay(e["calls"][:len(e["responses"])])
    n = next((i + 1 for i, (r, t) in enumerate(zip(e["responses"], real)) if r != t), len(e["responses"]))
    return {**e, "calls": e["calls"][:n], "responses": e["responses"][:n]}


def task_subset(task, uncertain):
    """'uncertain' when the task's expert prices an uncertain item, else 'faithful'."""
    return "uncertain" if set(i for i in task_items(task)[:2] if i) & set(uncertain) else "faithful"


def success_by_subset(tasks, rewards, uncertain):
    """{"uncertain": [successes, tasks], "faithful": [...]} over the tasks of each subset."""
    counts = {"uncertain": [0, 0], "faithful": [0, 0]}
    for t, r in zip(tasks, rewards):
        cell = counts[task_subset(t, uncertain)]
        cell[0] += r
        cell[1] += 1
    return counts


# ----------------------------------------------------------------------------- why episodes fail

def distractor(task):
    """(the item a new-phrasing prompt excludes, "prefix" | "suffix"), or (None, "plain")."""
    w = task["prompt"].split()
    if w[0] == "not":
        return w[1], "prefix"
    if len(w) > 2 and w[-2] == "not":
        return w[-1], "suffix"
    return None, "plain"


def failure_kind(episode, task):
    """Why a real-world episode failed its task, in this order: None (it succeeded), "no answer"
    (a bad call or a truncation), "distractor" (it priced the item the prompt excludes), "other
    item" (its first lookup was not the task's first item), "not copied" (an action after a numeric
    response did not use it: `mul A , N`, `pay N` and `answer N` must carry the response just
    before them as N, as every expert step does), else "other" (e.g. a missing step)."""
    if episode["cause"] == "answer" and episode["answer"] == task["answer"]:
        return None
    if episode["cause"] != "answer":
        return "no answer"
    priced = [c.split()[1] for c in episode["calls"] if c.startswith("price ")]
    if distractor(task)[0] in priced:
        return "distractor"
    if not priced or priced[0] != task_items(task)[0]:
        return "other item"
    acts = episode["calls"][1:] + [f"answer {episode['answer']}"]
    for response, act in zip(episode["responses"], acts):
        words = act.split()
        if response.isdigit() and words[0] in ("mul", "pay", "answer") and words[-1] != response:
            return "not copied"
    return "other"


def copy_counts(episodes, uncertain):
    """After each `price ITEM` response of a catalogue item, does the next action (mul, pay or
    answer) carry that response? {"uncertain": [copied, total], "faithful": [...]}: an actor that
    answers from memorised (stale) prices instead of the response in context copies less."""
    counts = {"uncertain": [0, 0], "faithful": [0, 0]}
    for e in episodes:
        acts = e["calls"][1:] + ([f"answer {e['answer']}"] if e["cause"] == "answer" else [])
        for call, response, act in zip(e["calls"], e["responses"], acts):
            item = call.split()[1] if call.startswith("price ") else None
            if item in world.PRICES and response.isdigit() and act.split()[0] in ("mul", "pay", "answer"):
                cell = counts["uncertain" if item in uncertain else "faithful"]
                cell[0] += act.split()[-1] == response
                cell[1] += 1
    return counts


def failure_table(tasks, episodes):
    """{(family, position): {"tasks": n, "success": k, KIND: count...}} over the failure kinds."""
    table = {}
    for t, e in zip(tasks, episodes):
        cell = table.setdefault((t["family"], distractor(t)[1]), {"tasks": 0, "success": 0})
        kind = failure_kind(e, t)
        cell["tasks"] += 1
        cell["success" if kind is None else kind] = cell.get("success" if kind is None else kind, 0) + 1
    return table


def looked_up(episode, task):
    """1 when the episode looked up (`price ITEM`) every item the task names, else 0. The reward
    cannot see it: an actor that prices another item with the same price (salt and nut both cost
    1) still answers right. A lookup of a different item is a wrong call, whatever it returned."""
    priced = {c.split()[1] for c in episode["calls"] if c.startswith("price ")}
    return int(all(item in priced for item in task_items(task)[:2] if item))
