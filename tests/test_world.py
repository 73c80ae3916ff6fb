"""The toy shop world (world.py): tools, errors, wallet state, parsing, task generation, splits."""
import random
from collections import Counter

import pytest

import world
from world import ITEMS, covered_items, join_digits, make_splits, new_state, parse_answer, parse_call, random_task, replay, step, tool_snippets

# The DEFAULTS sizes of train.py, written out so this file never imports torch (checked against
# config.DEFAULTS in test_config.py::test_world_sizes_match_train_defaults).
SIZES = dict(n_logged=3000, n_new_logged=20, n_rl=4000, n_test=500)


def fresh(call):
    return step(new_state(), call)


# ----------------------------------------------------------------------------- tools

@pytest.mark.parametrize("call, expected", [
    ("price apple", "3"), ("price bread", "7"), ("price milk", "2"), ("price egg", "1"),
    ("price fish", "9"), ("price jam", "8"), ("price ham", "6"), ("price yam", "5"),
])
def test_price_reads_the_catalogue(call, expected):
    assert fresh(call) == expected


@pytest.mark.parametrize("call, expected", [
    ("mul 3 , 4", "12"), ("mul 1 , 1", "1"), ("mul 9 , 9", "81"), ("mul 7 , 8", "56"),
    ("mul 2 , 5", "10"),
])
def test_mul_multiplies(call, expected):
    assert fresh(call) == expected


def test_pay_answers_the_balance_left():
    assert fresh("pay 3") == "6"
    assert fresh("pay 9") == "0"
    assert fresh("pay 1") == "8"


def test_digits_split_by_spaces_are_one_number():
    assert fresh("mul 1 2 , 3") == "error args"       # 12 is out of 1..9
    assert fresh("pay 1 0") == "error funds"          # 10 > 9


# ----------------------------------------------------------------------------- errors

def test_unknown_item_is_error_item():
    assert fresh("price banana") == "error item"
    assert fresh("price apples") == "error item"


def test_numeric_item_is_error_item():
    assert fresh("price 5") == "error item"


@pytest.mark.parametrize("call", ["mul 0 , 3", "mul 3 , 0", "mul 1 0 , 2", "mul 2 , 1 0",
                                  "mul 0 , 12", "pay 0"])
def test_out_of_range_arguments_are_error_args(call):
    assert fresh(call) == "error args"


def test_paying_more_than_the_balance_is_error_funds():
    assert fresh("pay 10") == "error funds"


@pytest.mark.parametrize("call", ["mul 3 4", "price", "pay", "mul", "pay apple", "hello", "",
                                  "price apple bread", "mul 3 , apple", "mul , 3", "mul 3 ,",
                                  "mul 3 , 4 , 5", "buy apple", "answer 3", "Price apple",
                                  "pay -3", "pay 3 apple"])
def test_malformed_text_is_error_call(call):
    assert fresh(call) == "error call"


# ----------------------------------------------------------------------------- wallet state

def test_wallet_carries_across_calls():
    state = new_state()
    assert state == {"balance": 9}
    assert step(state, "pay 3") == "6"
    assert step(state, "pay 7") == "error funds"
    assert state["balance"] == 6                      # a refused payment leaves the wallet alone
    assert step(state, "pay 6") == "0"
    assert step(state, "pay 1") == "error funds"
    assert state["balance"] == 0


def test_errors_and_other_tools_leave_the_wallet_alone():
    state = new_state()
    for call in ["pay 0", "pay", "price apple", "mul 3 , 3", "price banana", "nonsense"]:
        step(state, call)
    assert state["balance"] == 9
    assert step(state, "pay 9") == "0"


def test_states_are_independent():
    a, b = new_state(), new_state()
    assert step(a, "pay 5") == "4"
    assert step(b, "pay 2") == "7"
    assert a["balance"] == 4 and b["balance"] == 7


def test_replay_starts_from_a_fresh_wallet():
    calls = ["price apple", "mul 2 , 3", "pay 6", "price milk", "pay 2"]
    assert replay(calls) == ["3", "6", "3", "2", "1"]
    assert replay(calls) == ["3", "6", "3", "2", "1"]   # no state leaks between replays
    assert replay(["pay 4", "pay 4", "pay 4"]) == ["5", "1", "error funds"]
    assert replay([]) == []


# ----------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, expected", [
    ("price apple", ("price", ("apple",))),
    ("price banana", ("price", ("banana",))),          # shape only: existence is the world's
    ("mul 3 , 4", ("mul", (3, 4))),
    ("mul 1 2 , 3", ("mul", (12, 3))),
    ("mul 0 , 3", ("mul", (0, 3))),                    # range is the world's business too
    ("pay 3", ("pay", (3,))),
    ("pay 1 2", ("pay", (12,))),
    ("pay 0", ("pay", (0,))),
    ("  pay   3 ", ("pay", (3,))),
])
def test_parse_call_accepts(text, expected):
    assert parse_call(text) == expected


@pytest.mark.parametrize("text", ["mul 3 4", "price", "pay", "mul", "", "pay apple",
                                  "mul 3 , apple", "mul , 3", "mul 3 , 4 , 5", "price apple bread",
                                  "buy apple", "answer 3", "pay -3", "mul 3 ; 4"])
def test_parse_call_rejects(text):
    assert parse_call(text) is None


@pytest.mark.parametrize("text, expected", [
    ("answer 1 2", "12"), ("answer 7", "7"), ("answer 12", "12"), ("answer 8 1", "81"),
    ("answer", None), ("answer apple", None), ("answer 3 apple", None), ("pay 3", None),
    ("", None), ("3", None), ("answer , 3", None),
])
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("mul 1 2 , 3", ["mul", "12", ",", "3"]),
    ("1 2", ["12"]),
    ("pay 3", ["pay", "3"]),
    ("a 1 b 2 3", ["a", "1", "b", "23"]),
    ("1 2 3 4", ["1234"]),
    ("", []),
    ("  price   apple  ", ["price", "apple"]),
])
def test_join_digits(text, expected):
    assert join_digits(text) == expected


# ----------------------------------------------------------------------------- tasks

@pytest.mark.parametrize("family, q, item, item2, calls, responses", [
    ("price", 2, "apple", None, ["price apple"], ["3"]),
    ("cost", 4, "milk", None, ["price milk", "mul 4 , 2"], ["2", "8"]),
    ("buy1", 2, "bread", None, ["price bread", "pay 7"], ["7", "2"]),
    ("buyq", 3, "milk", None, ["price milk", "mul 3 , 2", "pay 6"], ["2", "6", "3"]),
    ("buy2", 2, "tea", "apple", ["price tea", "pay 4", "price apple", "pay 3"],
     ["4", "5", "3", "2"]),
    ("buyq2", 2, "apple", "milk", ["price apple", "mul 2 , 3", "pay 6", "price milk", "pay 2"],
     ["3", "6", "3", "2", "1"]),
])
def test_expert_calls_by_family(family, q, item, item2, calls, responses):
    assert world._expert_calls(family, q, item, item2) == calls
    assert replay(calls) == responses


N_CALLS = {"price": 1, "cost": 2, "buy1": 2, "buyq": 3, "buy2": 4, "buyq2": 5}


@pytest.mark.parametrize("phrasing", ["plain", "new"])
def test_random_tasks_are_consistent(phrasing):
    rng = random.Random(123)
    families = set()
    for _ in range(600):
        t = random_task(rng, phrasing)
        assert set(t) == {"prompt", "answer", "family", "calls"}
        assert 1 <= len(t["calls"]) <= 5
        assert len(t["calls"]) == N_CALLS[t["family"]]
        responses = replay(t["calls"])
        assert t["answer"] == responses[-1]
        assert all(r.isdigit() for r in responses)    # the expert never hits an error
        assert all(parse_call(c) is not None for c in t["calls"])
        families.add(t["family"])
    assert families == set(N_CALLS)


def test_plain_prompts_have_no_distractor():
    rng = random.Random(5)
    for _ in range(300):
        assert "not" not in random_task(rng, "plain")["prompt"].split()


def test_new_phrasing_has_a_distractor_the_expert_ignores():
    rng = random.Random(7)
    leading = trailing = 0
    for _ in range(600):
        t = random_task(rng, "new")
        words = t["prompt"].split()
        assert words.count("not") == 1
        k = words.index("not")
        distractor = words[k + 1]
        assert distractor in ITEMS
        if k == 0:
            leading += 1
        else:
            assert k == len(words) - 2                # `... not DIS` ends the prompt
            trailing += 1
        rest = words[:k] + words[k + 2:]
        wanted = [w for w in rest if w in ITEMS]
        assert 1 <= len(wanted) <= 2
        assert distractor not in wanted
        looked_up = [parse_call(c)[1][0] for c in t["calls"] if c.startswith("price")]
        assert looked_up == wanted                    # the expert looks up the wanted items only
    # the distractor leads half the time: 600 draws, 300 +- 5 standard deviations (12.2 each)
    assert leading + trailing == 600 and abs(leading - 300) < 61


def test_random_task_respects_items():
    rng = random.Random(3)
    items = ["apple", "milk", "tea"]
    for _ in range(200):
        t = random_task(rng, "new", items)
        assert {w for w in t["prompt"].split() if w in ITEMS} <= set(items)


# ----------------------------------------------------------------------------- splits

@pytest.fixture(scope="module")
def splits():
    return make_splits(0, SIZES["n_logged"], SIZES["n_new_logged"], SIZES["n_rl"], SIZES["n_test"])


def test_split_sizes(splits):
    assert set(splits) == {"logged", "rl", "test"}
    assert len(splits["test"]) == 500
    assert len(splits["rl"]) == 4000
    assert len(splits["logged"]) == 3000 + 20


def test_split_prompts_are_disjoint(splits):
    test = [t["prompt"] for t in splits["test"]]
    rl = [t["prompt"] for t in splits["rl"]]
    logged_new = [t["prompt"] for t in splits["logged"] if "not" in t["prompt"].split()]
    assert len(logged_new) == 20
    assert logged_new == [t["prompt"] for t in splits["logged"][3000:]]
    assert len(set(test)) == 500 and len(set(rl)) == 4000 and len(set(logged_new)) == 20
    assert not set(test) & set(rl)
    assert not set(test) & set(logged_new)
    assert not set(rl) & set(logged_new)
    assert all("not" in p.split() for p in test + rl)  # RL and test use the new phrasing only


def test_splits_are_deterministic(splits):
    again = make_splits(0, SIZES["n_logged"], SIZES["n_new_logged"], SIZES["n_rl"], SIZES["n_test"])
    assert again == splits
    other = make_splits(1, 50, 5, 50, 50)
    assert [t["prompt"] for t in other["test"]] != [t["prompt"] for t in splits["test"][:50]]


def test_split_tasks_are_consistent(splits):
    for name in ("logged", "rl", "test"):
        for t in splits[name]:
            assert t["answer"] == replay(t["calls"])[-1]


# ----------------------------------------------------------------------------- coverage, snippets

def item_words(tasks):
    return {w for t in tasks for w in t["prompt"].split() if w in ITEMS}


def test_coverage_half_keeps_half_of_the_items():
    known = covered_items(0, 0.5)
    assert len(known) == 12 and set(known) < set(ITEMS)
    s = make_splits(0, SIZES["n_logged"], SIZES["n_new_logged"], SIZES["n_rl"], SIZES["n_test"],
                    coverage=0.5)
    assert item_words(s["logged"]) == set(known)       # distractors included
    called = {parse_call(c)[1][0] for t in s["logged"] for c in t["calls"] if c.startswith("price")}
    assert called == set(known)
    assert item_words(s["test"]) == set(ITEMS)         # test and RL still use the whole catalogue
    assert item_words(s["rl"]) == set(ITEMS)
    snippet_items = {parse_call(c)[1][0] for sn in tool_snippets(0, 1, coverage=0.5) for c in sn["calls"]
                     if c.startswith("price") and parse_call(c) is not None}
    assert snippet_items == set(known) | {"5"}     # 'price 5': the deliberate error snippet


def test_full_coverage_keeps_every_item():
    assert covered_items(0, 1.0) == sorted(ITEMS)
    snippet_items = {parse_call(c)[1][0] for sn in tool_snippets(0, 1) for c in sn["calls"]
                     if c.startswith("price") and parse_call(c) is not None}
    assert snippet_items == set(ITEMS) | {"5"}     # 'price 5': the deliberate error snippet


def test_tool_snippets_count_and_determinism():
    one = tool_snippets(0, 1)
    # prices, mul pairs, (balance 0..9, amount 1..9), the 27 products > 9 as amounts, errors
    assert len(one) == 24 + 81 + 90 + 27 + 3
    assert len(tool_snippets(0, 2)) == 2 * 225
    assert tool_snippets(0, 1) == one
    assert all(1 <= len(sn["calls"]) <= 5 for sn in one)   # the target behind 0-2 calls, 0-2 pays
    prompts = [sn["prompt"] for sn in one]
    assert 0.3 < prompts.count("") / len(one) < 0.7       # half with an unrelated plain prompt
    assert all(p == "" or "not" not in p.split() for p in prompts)   # never a new phrasing
    targets = [sn["calls"][-1] for sn in one]
    for error_call in ("price 5", "mul 0 , 3", "pay 0"):
        assert targets.count(error_call) == 1
    assert replay(["pay 9", "pay 1"]) == ["0", "error funds"]


def test_tool_snippets_cover_every_mul_pair():
    targets = [sn["calls"][-1] for sn in tool_snippets(0, 1)]
    pairs = {parse_call(call)[1] for call in targets if call.startswith("mul")}
    assert {(a, b) for a in range(1, 10) for b in range(1, 10)} <= pairs


def test_tool_snippets_cover_every_balance_amount_pair():
    """The target pay of each snippet meets every wallet state 0..9 with every amount 1..9; the
    lead never fails (it only spends what the wallet has)."""
    seen, big = [], []
    for sn in tool_snippets(0, 1):
        calls = sn["calls"]
        responses = replay(calls)
        assert not any(r.startswith("error") for r in responses[:-1])
        if calls[-1].startswith("pay") and calls[-1] != "pay 0":
            paid = sum(int(c.split()[1]) for c in calls[:-1] if c.startswith("pay"))
            amount = int(calls[-1].split()[1])
            (seen if amount <= 9 else big).append((9 - paid, amount))
    assert sorted(seen) == [(b, a) for b in range(10) for a in range(1, 10)]
    assert sorted(a for _, a in big) == [10, 12, 14, 15, 16, 18, 20, 21, 24, 25, 27, 28, 30, 32, 35,
                                         36, 40, 42, 45, 48, 49, 54, 56, 63, 64, 72, 81]


def test_logged_new_phrasings_cover_every_family_and_distractor_position_evenly():
    logged = make_splits(0, 50, 24, 10, 10)["logged"]
    new = [t for t in logged if "not" in t["prompt"].split()]
    assert len(new) == 24
    combos = Counter((t["family"], t["prompt"].startswith("not")) for t in new)
    assert combos == {(f, prefix): 2 for f in ("price", "cost", "buy1", "buyq", "buy2", "buyq2")
                      for prefix in (True, False)}
