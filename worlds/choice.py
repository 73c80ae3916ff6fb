"""`world: choice`: a task family where private rehearsal can pay (the paper's claim 4;
docs/imagination.md).

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
Then RL (formats/format_choice.py, rehearse mode, no real world): for each episode N is drawn uniformly from
0..memory_max, the CURRENT policy imagines N episodes and the committed episode reads their
memory; its reward is the choice's.

Splits (`make_splits`): test tasks are held-out SETS (of options `Q ITEM`, or of items): no test
set is ever in a logged or RL task (in any order), so the N = 0 actor cannot recall the answer of
a set it has seen.

The measurement (scripts/choice_sweep.py: `memory_sweep`, `python -m scripts.choice_sweep --ckpt RUN`): success at N = 0, 1, 2, 4
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
import itertools
import random
import sys
from types import SimpleNamespace

import torch

from worldmodel import memory as rehearsal_memory
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
    from machinery.config import ConfigError
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
            settings=None):
    """The paper's rule, imagination: up to `budget` imagined episodes per task prompt (explore form),
    in rehearse mode (the policy plays the world) or, with a `rehearser`, frozen (it plays the
    world). parallel: `budget` at once; sequential: one per task at a time until two imagined
    episodes judged `good` (rehearsal_memory.self_assess) agree on the item. No real call.
    settings: the imagined episodes' sampler settings (rollout.SAMPLING: temperature, the limits, ...).
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
                                   settings=settings)
        for k, e in enumerate(episodes):
            imagined[todo[k // per_task]].append(e)
    return imagined


def agreed(episodes):
    """Two imagined episodes judged `good` bought the same item (sequential imagination stops)."""
    answers = [e["answer"] for e in episodes if rehearsal_memory.self_assess(e) == "good"]
    return len(answers) > len(set(answers))


def sample_with_memory(policy, tokenizer, prompts, env_mode="rehearse", *, memory_max=4, imagine_temperature=1.0,
                       env_model=None, world=None, settings=None, generator=None, plans=None):
    """The RL sampler of this world (format_choice's setting.sampler; train.py uses it in
    rehearse and frozen modes): for each commit prompt N is drawn uniformly from 0..memory_max,
    the current policy imagines N parallel episodes of the task (the simulator plays the world
    there too in frozen mode), and the committed episode, the one returned and trained, reads
    their memory. Imagined episodes are context: not returned, not trained. `settings`
    (rollout.SAMPLING) hold for the imagined and the committed episodes alike, but that the
    imagined ones sample at imagine_temperature; `plans` are the committed rows'."""
    world = world or sys.modules[__name__]
    imagining = {**(settings or {}), "temperature": imagine_temperature}
    budgets = torch.randint(0, memory_max + 1, (len(prompts),), generator=generator).tolist()
    tasks = [task_prompt_of(p) for p in prompts]
    memories = [[] for _ in prompts]
    for n in sorted(set(budgets) - {0}):
        index = [i for i, b in enumerate(budgets) if b == n]
        for i, episodes in zip(index, imagine(policy, tokenizer, [tasks[i] for i in index], n, "parallel", env_model,
                                              world, generator, imagining)):
            memories[i] = episodes
    return sample_episodes(policy, tokenizer, [commit_prompt(t, m) for t, m in zip(tasks, memories)], env_mode,
                           env_model=env_model, world=world, settings=settings, generator=generator, plans=plans)


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
