"""The toy tool world: a deterministic shop that stands in for a real API.

In the paper the environment is a real or synthesized executable API (BFCL, tau2-Bench). Here it
is a tiny shop, so that the true dynamics exist for evaluation and for measuring rehearsal
fidelity, while training in `rehearse` mode never calls it. Three kinds of tools:

    price ITEM   lookup    the catalogue price of ITEM (1..9), a fact the model must memorise
    mul A , B    compute   A * B for one-digit A and B (a rule: 81 facts)
    pay N        stateful  pays N from a wallet that starts at 9 coins; answers the balance left

A call that parses but is invalid gets an error response, as a real API would:
`price 3` -> `error item`, `mul 0 , 12` -> `error args`, `pay 7` with 5 left -> `error funds`.

Tasks (1 to 5 calls; the answer is always a number that only the last tool response states):

    price ITEM                       price                      -> P
    cost Q ITEM                      price, mul                 -> Q*P
    buy ITEM                         price, pay                 -> 9-P
    buy Q ITEM                       price, mul, pay            -> 9-Q*P
    buy ITEM and ITEM2               price, pay, price, pay     -> 9-P-P2
    buy Q ITEM and ITEM2             price, mul, pay, price, pay -> 9-Q*P-P2

The warm start logs a scripted expert on these *plain* phrasings. RL and test tasks use *new*
phrasings with a distractor the shopper does not want, `not DIS buy 2 apple` or `buy 2 apple not
DIS`, seen only `n_new_logged` times in the logged data. That is the skill RL must add: the
actor's decisions (which item to look up), while every tool response stays memorisable, so that
rehearsal can be faithful (a world model that is wrong makes rehearsed rewards noise).

Example:
    >>> state = new_state(); step(state, "price apple"), step(state, "pay 3"), step(state, "pay 7")
    ('3', '6', 'error funds')
"""
import random

ITEMS = ["apple", "bread", "milk", "egg", "rice", "tea", "soap", "salt", "jam", "fish", "corn",
         "pear", "plum", "lime", "nut", "bean", "oil", "cake", "pie", "soup", "kiwi", "fig",
         "yam", "ham"]
PRICES = dict(zip(ITEMS, [3, 7, 2, 1, 5, 4, 6, 1, 8, 9, 2, 4, 3, 5, 1, 2, 7, 6, 3, 8, 9, 4, 5, 6]))
WALLET = 9                                    # every episode's wallet starts with 9 coins
TOOL_KINDS = {"price": "lookup", "mul": "compute", "pay": "stateful"}
QUANTITIES = range(2, 10)
WORDS = ["price", "cost", "buy", "and", "not", "mul", "pay", "answer", "error", "item", "args",
         "funds", ","] + [str(d) for d in range(10)] + ITEMS


def join_digits(text):
    """'mul 1 2 , 3' -> ['mul', '12', ',', '3']: digits are single tokens, numbers are their runs."""
    words = []
    for w in text.split():
        if w.isdigit() and words and words[-1].isdigit():
            words[-1] += w
        else:
            words.append(w)
    return words


def parse_call(text):
    """Strict syntax check of an actor's call. Returns (tool, args) or None if malformed.
    Only the shape is checked here (tool name, arity, a number where a number goes);
    whether the item exists or the wallet can pay is the world's business (an error response)."""
    w = join_digits(text)
    if len(w) == 2 and w[0] == "price":
        return "price", (w[1],)
    if len(w) == 4 and w[0] == "mul" and _number(w[1]) and w[2] == "," and _number(w[3]):
        return "mul", (int(w[1]), int(w[3]))
    if len(w) == 2 and w[0] == "pay" and _number(w[1]):
        return "pay", (int(w[1]),)
    return None


def _number(word):
    return word.isascii() and word.isdigit()


def parse_answer(text):
    """'answer 1 2' -> '12'; anything else -> None."""
    w = join_digits(text)
    return w[1] if len(w) == 2 and w[0] == "answer" and _number(w[1]) else None


def read_act(text):
    """The actor's text -> ("answer", '12') | ("call", 'mul 3 , 4') | ("bad_call", None)."""
    answer = parse_answer(text)
    if answer is not None:
        return "answer", answer
    if parse_call(text) is None:
        return "bad_call", None
    return "call", " ".join(join_digits(text))


def next_turn(answered):
    """The sampler's hook after the actor's answer: a toy task has one user turn, so the episode
    ends (None). A multi-turn chat task's world (chat.task_world) gives the forced (id, role)
    pairs of its next user turn instead."""
    return None


def new_state():
    return {"balance": WALLET}


def step(state, call_text):
    """Execute one call in the real world; mutates `state` (the wallet). Returns response text."""
    call = parse_call(call_text)
    if call is None:
        return "error call"
    tool, args = call
    if tool == "price":
        return str(PRICES[args[0]]) if args[0] in PRICES else "error item"
    if tool == "mul":
        a, b = args
        return str(a * b) if 1 <= a <= 9 and 1 <= b <= 9 else "error args"
    n = args[0]
    if n < 1:
        return "error args"
    if n > state["balance"]:
        return "error funds"
    state["balance"] -= n
    return str(state["balance"])


def response_form(tool, args):
    """What a well-formed response to a parsed call looks like, judged from the call alone (the
    tool's argument schema: a catalogue item, one-digit factors, a positive amount), never from
    the wallet: ("N",) a number; ("N", "error funds") a number or, if the wallet is short, that
    error; ("error item",) or ("error args",) the only right answer to a call the schema rejects.
    It agrees with `step` on every call (tests/test_guards.py): the form, not the value."""
    if tool == "price":
        return ("N",) if args[0] in PRICES else ("error item",)
    if tool == "mul":
        return ("N",) if all(1 <= a <= 9 for a in args) else ("error args",)
    return ("N", "error funds") if args[0] >= 1 else ("error args",)


def replay(calls):
    """Real responses to a sequence of calls from a fresh world (the ground truth for fidelity)."""
    state = new_state()
    return [step(state, c) for c in calls]


# ----------------------------------------------------------------------------- tasks

FAMILIES = ["price", "cost", "buy1", "buyq", "buy2", "buyq2"]


def _expert_calls(family, q, item, item2):
    """The scripted expert's calls for a task (responses come from running them in the world)."""
    p, p2 = PRICES[item], PRICES[item2] if item2 else None
    if family == "price":
        return [f"price {item}"]
    if family == "cost":
        return [f"price {item}", f"mul {q} , {p}"]
    if family == "buy1":
        return [f"price {item}", f"pay {p}"]
    if family == "buyq":
        return [f"price {item}", f"mul {q} , {p}", f"pay {q * p}"]
    if family == "buy2":
        return [f"price {item}", f"pay {p}", f"price {item2}", f"pay {p2}"]
    return [f"price {item}", f"mul {q} , {p}", f"pay {q * p}", f"price {item2}", f"pay {p2}"]


def _plain_prompt(family, q, item, item2):
    return {"price": f"price {item}", "cost": f"cost {q} {item}", "buy1": f"buy {item}",
            "buyq": f"buy {q} {item}", "buy2": f"buy {item} and {item2}",
            "buyq2": f"buy {q} {item} and {item2}"}[family]


def _feasible(family, q, item, item2):
    spend = {"price": 0, "cost": 0, "buy1": PRICES[item], "buyq": q * PRICES[item],
             "buy2": PRICES[item] + PRICES[item2 or item], "buyq2": q * PRICES[item] + PRICES[item2 or item]}
    return spend[family] <= WALLET


def random_task(rng, phrasing, items=ITEMS, family=None, prefix=None):
    """One task dict: prompt, answer, family, expert calls. phrasing: 'plain' or 'new' (with the
    distractor first if `prefix`); family and prefix are drawn at random unless given."""
    wanted = family
    while True:
        family = wanted or rng.choice(FAMILIES)
        q = rng.choice(QUANTITIES)
        item, item2 = rng.sample(items, 2)
        if family not in ("buy2", "buyq2"):
            item2 = None
        if _feasible(family, q, item, item2):
            break
    prompt = _plain_prompt(family, q, item, item2)
    if phrasing == "new":
        distractor = rng.choice([i for i in items if i not in (item, item2)])
        prefix = rng.random() < 0.5 if prefix is None else prefix
        prompt = f"not {distractor} {prompt}" if prefix else f"{prompt} not {distractor}"
    calls = _expert_calls(family, q, item, item2)
    answer = replay(calls)[-1]
    return {"prompt": prompt, "answer": answer, "family": family, "calls": calls}


def make_splits(seed, n_logged, n_new_logged, n_rl, n_test, coverage=1.0):
    """Tasks generated from `seed`, prompts disjoint across splits.

    logged: expert trajectories for the warm start: n_logged plain, and n_new_logged new-phrasing
            ones spread evenly over the 6 families x 2 distractor positions;
    rl:     new-phrasing tasks with the answer only (no trajectories);
    test:   held-out new-phrasing tasks.
    coverage < 1 keeps only that fraction of the catalogue in the logged data (and in the tool
    snippets, see `tool_snippets`), so that rehearsal of the other items is never taught."""
    rng = random.Random(seed)
    known = covered_items(seed, coverage)
    seen, splits = set(), {}
    for name, phrasing, n, items in [("test", "new", n_test, ITEMS), ("rl", "new", n_rl, ITEMS),
                                     ("logged_new", "new", n_new_logged, known),
                                     ("logged", "plain", n_logged, known)]:
        tasks = []
        while len(tasks) < n:
            combo = {} if name != "logged_new" else {"family": FAMILIES[len(tasks) % len(FAMILIES)],
                                                      "prefix": len(tasks) // len(FAMILIES) % 2 == 0}
            t = random_task(rng, phrasing, items, **combo)
            if t["prompt"] in seen and name != "logged":    # logged plain tasks may repeat
                continue
            seen.add(t["prompt"])
            tasks.append(t)
        splits[name] = tasks
    splits["logged"] += splits.pop("logged_new")
    return splits


def covered_items(seed, coverage):
    items = sorted(ITEMS)
    random.Random(seed + 1).shuffle(items)
    return sorted(items[:max(2, round(coverage * len(items)))])


def tool_snippets(seed, repeats, coverage=1.0):
    """Logged API traffic the world model is warm-started on: every tool's whole argument range
    (every covered item, every mul pair, every wallet balance 0..9 x amount 1..9 and every
    larger amount a product can reach, and a few errors), `repeats` times. Each target call sits
    behind a random lead of other calls and, half the time, after an unrelated plain task prompt
    (traffic of other episodes), so that a response is learned as a function of the call and the
    wallet, not of the task. Returns [{"prompt": str, "calls": [str]}]: no answer, no plan."""
    rng = random.Random(seed + 2)
    items = covered_items(seed, coverage)
    products = sorted({a * b for a in range(1, 10) for b in range(1, 10)} - set(range(10)))
    targets = [(None, f"price {i}") for i in items]
    targets += [(None, f"mul {a} , {b}") for a in range(1, 10) for b in range(1, 10)]
    targets += [(balance, f"pay {amount}") for balance in range(WALLET + 1)
                for amount in range(1, WALLET + 1)]
    targets += [(None, f"pay {amount}") for amount in products]                # always 'error funds'
    targets += [(None, "price 5"), (None, "mul 0 , 3"), (None, "pay 0")]   # errors, to be rehearsed too
    snippets = []
    for _ in range(repeats):
        for balance, call in targets:
            if balance is None:         # any wallet state will do: often untouched, sometimes spent
                balance = WALLET if rng.random() < 0.5 else rng.randint(0, WALLET - 1)
            prompt = random_task(rng, "plain", items)["prompt"] if rng.random() < 0.5 else ""
            snippets.append({"prompt": prompt, "calls": _lead(rng, items, WALLET - balance) + [call]})
    rng.shuffle(snippets)
    return snippets


def _lead(rng, items, spend):
    """0-2 random price/mul calls and 0-2 payments that spend exactly `spend`, shuffled."""
    calls = [f"price {rng.choice(items)}" if rng.random() < 0.5 else
             f"mul {rng.randint(1, 9)} , {rng.randint(1, 9)}" for _ in range(rng.randint(0, 2))]
    if spend:
        first = rng.randint(1, spend) if rng.random() < 0.5 else spend
        calls += [f"pay {n}" for n in (first, spend - first) if n]
    rng.shuffle(calls)
    return calls


ERROR_WORDS = ("item", "args", "funds", "call")


def parse_response(text):
    """A rehearsed response: '1 2' -> '12', 'error funds' -> 'error funds', anything else -> None
    (the sampler then ends the episode: bad_rehearsal, as the official simulator's format check)."""
    w = join_digits(text)
    if len(w) == 1 and w[0].isdigit():
        return w[0]
    if len(w) == 2 and w[0] == "error" and w[1] in ERROR_WORDS:
        return " ".join(w)
    return None
