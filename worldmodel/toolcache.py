"""The tool cache: the grounding examples of a separate rehearse prompt, from training traffic only.

Built once at setup (the format's setup: formats/format_plain.py, formats/format_chat.py) from the TRAINING
traffic in its order: the logged episodes' (call, response) pairs, then the toy's logged tool
snippets (plain) or the RL tasks' reference examples (chat). Never from a test task: evaluation's
rehearse prompts (would-rehearse fidelity, --coverage, the imagined world, test-time rehearsal)
are grounded by this cache alone, so that a test task's gold results cannot reach them. In
training a chat task's own reference examples may come first (chat_separate.grounding).

A call is read as (tool, {argument: value}) by the format's `parse` (`plain_call`: the toy's
positional arguments by position, "0", "1"; `chat_call`: a JSON call's name and arguments).
Retrieval for a call (`examples`), up to k (call, response) pairs of the same tool, nearest first:

    distance(a, b) = the number of argument names (of either call) whose values differ,
                     a name missing from one call counting as differing; values compared as
                     canonical JSON. 0 exactly when the calls are the same (an exact match).
    ties           the pair that entered the cache first comes first (the traffic's order).

    cache: price milk -> 2, mul 3 , 4 -> 12, price jam -> 8, mul 2 , 4 -> 8, mul 3 , 5 -> 15
    examples(cache, "mul 3 , 4", 2) == [("mul 3 , 4", "12"), ("mul 2 , 4", "8")]   (0, then 1 first seen)
    examples(cache, "pay 3", 2) == []                                              (no traffic of pay)

The cache keeps each distinct (call, response) pair once, so a stateful tool's call may show
several responses (pay 3 from different balances); its rehearse row also holds the dialogue so
far, which says which one applies. It is a dict:
    {"parse": parse, "tools": {tool: [{"call", "response", "key", "args"}, ...]},
     "counts": Counter({call key: times in the traffic}), "pairs": {(call key, response)}}
"""
import heapq
import json
from collections import Counter

import world as toy_world


def plain_call(call, world=toy_world):
    """The toy's call text -> (tool, {"0": first argument, ...}); a malformed one -> (None, {"text": call}):
    matched by its exact text only."""
    parsed = world.parse_call(call)
    if parsed is None:
        return None, {"text": call}
    return parsed[0], {str(i): value for i, value in enumerate(parsed[1])}


def chat_call(call):
    """A chat call ({"name", "arguments"}, or its JSON text) -> (name, arguments); text that is
    not such JSON -> (None, {"text": call})."""
    try:
        call = json.loads(call) if isinstance(call, str) else call
        return call["name"], call["arguments"]
    except (ValueError, KeyError, TypeError):
        return None, {"text": call}


def _canonical(value):
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _key(tool, args):
    return _canonical([tool, args])


def build(traffic, parse):
    """The cache of `traffic` ([(call, response)], training traffic only, in its order), calls read by `parse`."""
    cache = {"parse": parse, "tools": {}, "counts": Counter(), "pairs": set()}
    for call, response in traffic:
        tool, args = parse(call)
        key = _key(tool, args)
        cache["counts"][key] += 1
        if (key, response) not in cache["pairs"]:
            cache["pairs"].add((key, response))
            cache["tools"].setdefault(tool, []).append({"call": call, "response": response, "key": key,
                                                        "args": {name: _canonical(v) for name, v in args.items()}})
    return cache


def distance(a, b):
    """The number of argument names whose (canonical JSON) values differ between two argument dicts."""
    return sum(a.get(name) != b.get(name) for name in a.keys() | b.keys())


def examples(cache, call, k, first=()):
    """Up to k (call, response) grounding examples for `call`: `first` (training: a task's own
    reference pairs), then the cache's pairs of the same tool nearest first (`distance`; an
    exact match is 0), ties by first seen, less those already in `first`. No cache: `first` only."""
    chosen = list(first)[:k]
    if cache is None or len(chosen) >= k:
        return chosen
    tool, args = cache["parse"](call)
    args = {name: _canonical(v) for name, v in args.items()}
    taken = {(_key(*cache["parse"](c)), r) for c, r in chosen}
    entries = cache["tools"].get(tool, [])
    nearest = heapq.nsmallest(k + len(taken), range(len(entries)),
                              key=lambda i: (distance(args, entries[i]["args"]), i))
    chosen += [(entries[i]["call"], entries[i]["response"]) for i in nearest
               if (entries[i]["key"], entries[i]["response"]) not in taken]
    return chosen[:k]


def exact_response(cache, call):
    """The response of the cache's first-seen pair of exactly `call` (the first example a rehearse
    prompt shows for it: distance 0, first seen), or None when the traffic never held the call."""
    tool, args = cache["parse"](call)
    key = _key(tool, args)
    return next((e["response"] for e in cache["tools"].get(tool, []) if e["key"] == key), None)


def times_seen(cache, call):
    """How often the exact call is in the cache's traffic (0: unseen)."""
    return cache["counts"].get(_key(*cache["parse"](call)), 0)


def counts_of(cache, calls):
    """{call: times_seen} for `calls`: the warm-start counts honesty.fidelity_by_coverage reads."""
    return {call: times_seen(cache, call) for call in calls}
