"""worlds/choice.py (`world: choice`): which items a task names and which is right, the held-out
test item sets, the budget rule (the first real act decides the episode), how the logs and the
warm start's memories are made, the memory format in the committed prompt (role PROMPT, never
trained), the self-assessment rule in context, and the N sweep: imagination never calls the real
world (a counting world), sequential imagination stops at two agreeing `good` episodes."""
import pytest
import torch

from formats import features
import world
from scripts import choice_sweep
from worlds import choice as wc
from machinery.checkpoint import build_tokenizer
from machinery.config import DEFAULTS, ConfigError, load_config
from envace import ACT, OBS, PROMPT, TAG, loss_mask
from helpers import ScriptedModel, tiny_cfg

CFG = {**DEFAULTS, "world": "choice", "n_logged": 30, "n_rl_tasks": 20, "n_test": 10, "snippet_repeats": 2,
       "max_turns": 4, "max_tokens": 128, "eval_temperature": 0.0, "imagine_temperature": 1.0}


def tokenizer():
    return build_tokenizer(features.tiny_words(CFG))


def tokens(tok, ids):
    return tok.convert_ids_to_tokens(ids)


def test_a_task_names_its_items_and_the_cheapest_is_the_answer():
    # fig 4, apple 3, milk 2: the cheapest is milk; the expert's free lookups are in prompt order
    assert wc.choice_task(["fig", "apple", "milk"]) == {
        "prompt": "cheapest fig apple milk", "answer": "milk", "family": "choice", "items": ["fig", "apple", "milk"],
        "calls": ["price fig", "price apple", "price milk"], "quantities": None}


def test_a_costs_task_multiplies_each_price_by_its_quantity():
    # 3 fig = 3 x 4 = 12, 5 apple = 5 x 3 = 15: fig; the expert prices then multiplies each option
    assert wc.choice_task(["fig", "apple"], [3, 5]) == {
        "prompt": "cheapest 3 fig 5 apple", "answer": "fig", "family": "choice", "items": ["fig", "apple"],
        "quantities": [3, 5], "calls": ["price fig", "mul 3 , 4", "price apple", "mul 5 , 3"]}
    assert wc.choice_task(["fig", "apple"], [2, 3])["answer"] == "fig"           # 8 < 9
    cfg = {**CFG, "choice_kind": "costs", "choice_items": 2}
    splits = wc.make_splits(cfg)
    held = {frozenset(zip(t["quantities"], t["items"])) for t in splits["test"]}
    assert len(held) == 10 and not held & {frozenset(zip(t["quantities"], t["items"])) for t in splits["rl"] + splits["logged"]}
    for t in splits["test"] + splits["logged"]:
        totals = [q * world.PRICES[i] for q, i in zip(t["quantities"], t["items"])]
        assert len(set(totals)) == 2 and len(set(t["items"])) == 2 and all(2 <= q <= 9 for q in t["quantities"])
        assert t["answer"] == t["items"][totals.index(min(totals))]
    rows = wc.warm_start_sequences(tokenizer(), splits, cfg)
    assert len(rows) == 2 * 30 + (24 + 81) * 2                 # every price and every one-digit product, twice


def test_item_sets_have_distinct_prices_and_test_sets_are_held_out():
    # prices: six values held by 3 items each (1..6), three by 2 items (7, 8, 9). Sets of 3 items with
    # 3 distinct prices: C(6,3)*27 + C(6,2)*3*(9*2) + 6*C(3,2)*(3*4) + 8 = 540 + 810 + 216 + 8 = 1574
    assert len(wc.item_sets(3)) == 1574
    assert all(len({world.PRICES[i] for i in s}) == 3 for s in wc.item_sets(3))
    splits = wc.make_splits(CFG)
    assert [len(splits[k]) for k in ("test", "rl", "logged")] == [10, 20, 30]
    test_sets = {frozenset(t["items"]) for t in splits["test"]}
    assert len(test_sets) == 10                                       # distinct sets
    assert not test_sets & {frozenset(t["items"]) for t in splits["rl"] + splits["logged"]}
    for t in splits["test"] + splits["rl"] + splits["logged"]:
        assert t["answer"] == min(t["items"], key=world.PRICES.get) and t["prompt"] == "cheapest " + " ".join(t["items"])
    assert wc.make_splits(CFG) == splits                              # from data_seed alone
    with pytest.raises(ConfigError, match="n_test .1574. must be less than the 1574 item sets"):
        wc.make_splits({**CFG, "n_test": 1574})


def test_the_purchase_ends_the_episode_and_lookups_are_calls():
    assert wc.read_act("buy fig") == ("answer", "fig")
    assert wc.read_act("price fig") == ("call", "price fig")
    assert wc.read_act("buy 3") == ("bad_call", None) and wc.read_act("answer 3") == ("bad_call", None)
    assert wc.read_act("buy fog") == ("bad_call", None)               # not a catalogue item
    state = wc.new_state()
    assert [wc.step(state, c) for c in ("price fig", "price fog", "buy fig", "mul 3 , 4", "pay 3")] == [
        "4", "error item", "error call", "12", "error call"]                   # no wallet in this world


def test_the_first_real_act_decides_the_episode():
    """Budget ONE real call: only a purchase of the cheapest as the very first act scores; a real
    lookup before it spends the budget (0 even if it then buys right), counted by the world."""
    tok = tokenizer()
    prompts = ["cheapest fig apple milk memory", "cheapest fig apple egg memory", "cheapest fig milk egg memory"]
    model = ScriptedModel(tok, {
        prompts[0]: "<act> buy milk </act>",                                           # right, at once
        prompts[1]: "<act> price egg </act> <env> 1 </env> <act> buy egg </act>",      # right, after a lookup
        prompts[2]: "<act> buy milk </act>"})                                          # wrong (egg 1)
    counted = wc.counting_world()
    episodes = wc.sample_episodes(model, tok, prompts, "real", world=counted, settings={"temperature": 0.0})
    tasks = [wc.choice_task(p.split()[1:4]) for p in prompts]
    assert [e["answer"] for e in episodes] == ["milk", "egg", "milk"]
    assert [e["responses"] for e in episodes] == [[], ["1"], []]
    assert [wc.choice_reward(e, t) for e, t in zip(episodes, tasks)] == [1.0, 0.0, 0.0]
    assert counted.real_calls == 1


def test_logs_explore_and_commit_episodes_and_every_lookup():
    tok = tokenizer()
    splits = wc.make_splits(CFG)
    rows = wc.warm_start_sequences(tok, splits, CFG)
    assert len(rows) == 2 * 30 + 24 * 2                     # per logged task two rows; 24 items x 2 repeats
    t = splits["logged"][0]
    explore = rows[0]
    a, b, c = t["items"]
    p = [str(world.PRICES[i]) for i in (a, b, c)]
    assert tokens(tok, explore["ids"]) == (["<bos>", "cheapest", a, b, c]
                                           + ["<act>", "price", a, "</act>", "<env>", p[0], "</env>"]
                                           + ["<act>", "price", b, "</act>", "<env>", p[1], "</env>"]
                                           + ["<act>", "price", c, "</act>", "<env>", p[2], "</env>"]
                                           + ["<act>", "buy", t["answer"], "</act>"])
    assert explore["roles"][:5] == [PROMPT] * 5 and explore["roles"][5:12] == [TAG, ACT, ACT, ACT, TAG, OBS, OBS]
    commit = rows[1]
    words = tokens(tok, commit["ids"])
    assert words[:6] == ["<bos>", "cheapest", a, b, c, "memory"] and words[-4:] == ["<act>", "buy", t["answer"], "</act>"]
    assert commit["roles"] == [PROMPT] * (len(words) - 4) + [TAG, ACT, ACT, ACT]
    snippets = rows[60:]
    looked = [tokens(tok, r["ids"])[-5] for r in snippets]      # ... <act> price ITEM </act> <env> P </env>
    assert sorted(set(looked)) == sorted(world.ITEMS) and all(ACT not in r["roles"] for r in snippets)
    assert sum(r["roles"].count(OBS) for r in snippets) == 2 * sum(tokens(tok, r["ids"]).count("<env>") for r in snippets)


class Script:
    """A stand-in for random.Random that returns scripted draws: random() from `floats`, randrange
    and choice from `picks` (an index into the options)."""

    def __init__(self, floats, picks=()):
        self.floats, self.picks = list(floats), list(picks)

    def random(self):
        return self.floats.pop(0)

    def randrange(self, n):
        return self.picks.pop(0)

    def choice(self, options):
        return options[self.picks.pop(0)]


def test_synthetic_imagined_episodes():
    task = wc.choice_task(["fig", "apple", "milk"])            # 4, 3, 2
    # no cut (0.9 >= 0.15), prices: fig true (0.5), apple wrong (0.1 < 0.15: options 1,2,4..9, pick 0 -> 1), milk true
    e = wc.imagined_episode(Script([0.9, 0.5, 0.1, 0.7], [0]), task, 0.15)
    assert e == {"calls": ["price fig", "price apple", "price milk"], "responses": ["4", "1", "2"], "answer": "apple",
                 "finished": True, "cause": "answer"}
    # cut (0.05 < 0.15) after 1 lookup: unfinished, no answer
    e = wc.imagined_episode(Script([0.05, 0.9, 0.9, 0.9], [1]), task, 0.15)
    assert e["calls"] == ["price fig"] and e["responses"] == ["4"] and not e["finished"] and e["answer"] is None
    assert wc.imagined_episode(Script([0.9] * 4), task, 0.0)["responses"] == ["4", "3", "2"]
    # choice: costs, `cheapest 3 fig 5 apple` (12 vs 15): fig's price imagined wrong (0.1: options
    # 1,2,3,5..9, pick 0 -> 1), its product follows the imagined price (3 x 1 = 3), apple true (5 x 3)
    costs = wc.choice_task(["fig", "apple"], [3, 5])
    e = wc.imagined_episode(Script([0.9, 0.1, 0.5], [0]), costs, 0.15)
    assert e["calls"] == ["price fig", "mul 3 , 1", "price apple", "mul 5 , 3"] and e["responses"] == ["1", "3", "3", "15"]
    assert e["answer"] == "fig" and e["finished"]


@torch.no_grad()
def test_memory_in_the_commit_prompt_is_read_never_trained():
    """The committed prompt after two imagined episodes, one self-assessed `good`, one `bad` (a
    rehearsed `error item`), exactly; every memory token is PROMPT, so no loss falls on it."""
    tok = tokenizer()
    good = {"calls": ["price fig", "price apple", "price milk"], "responses": ["4", "3", "2"], "answer": "milk",
            "finished": True, "cause": "answer"}
    bad = {"calls": ["price fig"], "responses": ["error item"], "answer": "fig", "finished": True, "cause": "answer"}
    prompt = wc.commit_prompt("cheapest fig apple milk", [good, bad])
    assert prompt == ("cheapest fig apple milk memory tried price fig got 4 price apple got 3 price milk got 2 "
                      "answer milk good tried price fig got error item answer fig bad")
    assert wc.commit_prompt("cheapest fig apple milk", []) == "cheapest fig apple milk memory"
    assert wc.task_prompt_of(prompt) == "cheapest fig apple milk"
    row = wc.encode_choice(tok, prompt, [], [], "milk")
    words = tokens(tok, row["ids"])
    assert "<unk>" not in words and len(words) == 1 + 30 + 4
    mask = loss_mask(torch.tensor([row["roles"]]), trained=(ACT,))[0].tolist()
    assert mask == [False] * 31 + [True] * 3                  # predicts buy, milk, </act>: nothing before


def scripted_choice(tok, bad_task=False):
    """Two tasks: imagination looks the prices up (the scripted policy rehearses them) and buys;
    the commit prompts read the memories. Task 2's imagination rehearses `error item` (bad)."""
    m1 = " tried price fig got 4 price apple got 3 price milk got 2 answer milk good"
    m2 = " tried price egg got error item answer egg bad"
    return ScriptedModel(tok, {
        "cheapest fig apple milk": "<act> price fig </act> <env> 4 </env> <act> price apple </act> <env> 3 </env> "
                                   "<act> price milk </act> <env> 2 </env> <act> buy milk </act>",
        "cheapest egg fig tea": "<act> price egg </act> <env> error item </env> <act> buy egg </act>",
        "cheapest fig apple milk memory": "<act> buy fig </act>",               # N = 0: wrong
        "cheapest egg fig tea memory": "<act> buy fig </act>",                  # wrong (egg 1)
        "cheapest fig apple milk memory" + m1: "<act> buy milk </act>",
        "cheapest fig apple milk memory" + m1 * 2: "<act> buy milk </act>",
        "cheapest fig apple milk memory" + m1 * 4: "<act> buy milk </act>",
        "cheapest egg fig tea memory" + m2: "<act> buy egg </act>",
        "cheapest egg fig tea memory" + m2 * 2: "<act> buy egg </act>",
        "cheapest egg fig tea memory" + m2 * 4: "<act> buy egg </act>"})


def test_the_sweep_imagines_without_a_real_call_and_commits_once():
    tok = tokenizer()
    model = scripted_choice(tok)
    tasks = [wc.choice_task(["fig", "apple", "milk"]), wc.choice_task(["egg", "fig", "tea"])]
    zero = choice_sweep.committed_success(model, tok, tasks, CFG, 0)
    assert zero["task_rewards"] == [0.0, 0.0] and zero["imagined_per_task"] == 0
    four = choice_sweep.committed_success(model, tok, tasks, CFG, 4, "parallel")
    assert four["task_rewards"] == [1.0, 1.0] and four["imagined_per_task"] == 4
    assert four["imagination_real_calls"] == 0 and four["real_lookups_per_task"] == 0 and four["purchases_per_task"] == 1
    assert four["verdicts"] == {"good": 4, "bad": 4, "unfinished": 0} and four["imagined_right"] == 1.0
    # task 1's 4 x 3 imagined prices are true; task 2's `error item` for egg is not (egg costs 1)
    assert four["imagined_fidelity"] == {"lookup": [12, 16]}
    # task 1: the good episodes' majority (milk) is right and followed; task 2 has no good episode
    assert four["by_memory"] == {"right": [1, 1, 1], "wrong": [0, 0, 0], "none": [1, 1, 0]}
    # sequential: task 1 stops at two agreeing good episodes; task 2's are bad, so it spends all 4
    seq = choice_sweep.committed_success(model, tok, tasks, CFG, 4, "sequential")
    assert seq["imagined_per_task"] == (2 + 4) / 2 and seq["task_rewards"] == [1.0, 1.0]
    rows = choice_sweep.memory_sweep(model, tok, tasks, CFG, {"policy": None}, budgets=(0, 2), modes=("parallel",))
    assert [(r["budget"], r["success"]) for r in rows] == [(0, 0.0), (2, 1.0)]
    assert rows[1]["vs_0"]["diff"] == 1.0 and rows[1]["vs_0"]["interval"] == [1.0, 1.0] and rows[1]["vs_0"]["called"]


def test_rl_sampler_commits_reading_what_the_policy_imagined():
    tok = tokenizer()
    model = scripted_choice(tok)
    prompts = ["cheapest fig apple milk memory"] * 6
    episodes = wc.sample_with_memory(model, tok, prompts, "rehearse", memory_max=2, world=wc,
                                     generator=torch.Generator().manual_seed(0),
                                     settings={"temperature": 1.0, "max_turns": 4, "max_tokens": 128})
    memories = [tokens(tok, e["ids"]).count("tried") for e in episodes]
    assert set(memories) <= {0, 1, 2} and len(set(memories)) > 1
    assert [e["answer"] for e in episodes] == ["fig" if k == 0 else "milk" for k in memories]
    assert all(e["calls"] == [] and set(e["roles"][:e["prompt_len"]]) == {PROMPT} for e in episodes)


@pytest.mark.parametrize("line, message", [
    ("choice_items: 5", "choice_items' must be 2, 3 or 4"),
    ("choice_kind: prices", "choice_kind' must be one of"),
    ("rehearsal_budget: 2", "not evaluate.py's vote"),
    ("rehearsal_context: separate", "world: choice needs format: plain and rehearsal_context: inline"),
    ("test_file: t.jsonl", "remove test_file"),
    ("memory_noise: 1.5", "memory_noise' must be in"),
    ("memory_max: -1", "memory_max' must be >= 0"),
])
def test_config_mistakes_are_one_line(tmp_path, line, message):
    path = tmp_path / "c.yaml"
    path.write_text(f"world: choice\n{line}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(str(path))


def test_the_shipped_config_and_the_vocabulary():
    cfg = load_config("configs/choice.yaml")
    assert (cfg["world"], cfg["choice_kind"], cfg["choice_items"], cfg["memory_max"], cfg["max_tokens"]) == (
        "choice", "costs", 2, 4, 160)
    control = load_config("configs/choice_items.yaml")
    assert (control["choice_kind"], control["choice_items"], control["max_tokens"]) == ("items", 3, 128)
    assert features.tiny_words(cfg)[-7:] == ["cheapest", "memory", "tried", "got", "good", "bad", "unfinished"]
    assert "cheapest" not in features.tiny_words(DEFAULTS)          # the demo's vocabulary is untouched


def test_train_runs_a_choice_run_end_to_end(tmp_path):
    """train.py with world: choice: the warm start, the gate on the expert's lookups, one RL step
    in rehearse mode through the memory sampler, and the real-world evaluation (N = 0)."""
    import json
    import train
    cfg = tiny_cfg(tmp_path, world="choice", choice_kind="costs", choice_items=2, n_logged=12, n_test=4,
                   n_rl_tasks=8, rl_steps=1, tasks_per_step=2, group_size=2, max_turns=5, max_tokens=160,
                   n_collusion=2, memory_max=1, sft_steps=2)
    assert train.run(cfg) == 0
    result = json.load(open(tmp_path / "run" / "eval.json"))
    assert result["n_tasks"] == 4 and set(result["fidelity"]) == {"lookup", "compute"}
    # the expert's 2 lookups and 2 products of each of the 4 test tasks
    assert result["fidelity_counts"]["lookup"][1] == 8 and result["fidelity_counts"]["compute"][1] == 8
    line = json.loads(open(tmp_path / "run" / "metrics.jsonl").readline())
    assert line["step"] == 1


def test_report_pools_seeds_and_tasks(tmp_path):
    """--report: a row per (model, rehearser, mode); N = 0 over seeds 1 ([1, 0]) and 2 ([1, 1]):
    the mean of the seed means, (0.5 + 1) / 2 = 0.75; N = 1 is 1 everywhere: +0.25 against N = 0.
    The seeds share their test tasks, so the crossed bootstrap: 2 seeds drawn and ONE pair of tasks
    for both; a resample misses (seed 1's share of the seeds drawn) x (task 2's share of the tasks
    drawn), each share 0, 1/2 or 1 with p 1/4, 1/2, 1/4, so N = 0 is 0 with p 1/16 = 6.2% and 1
    with p 7/16: [0.000, 1.000], and N = 1 - N = 0 [+0.000, +1.000]. The t-interval over the 2
    seed means of N = k - N = 0 (0.5 and 0): half-width 12.7062 x 0.3536 / sqrt(2) = 3.1766."""
    import json
    for seed, zero in ((1, [1.0, 0.0]), (2, [1.0, 1.0])):
        rows = [{"rehearser": "policy", "mode": "parallel", "budget": n, "task_rewards": zero if n == 0 else [1.0, 1.0]}
                for n in wc.BUDGETS]
        (tmp_path / f"sweep_rl-seed{seed}.json").write_text(json.dumps(rows))
    text = choice_sweep.report(str(tmp_path))
    row = text.splitlines()[2].split(" | ")
    assert row[:4] == ["| rl", "policy", "parallel", "2"] and row[4] == "0.750 [0.000, 1.000]"
    assert row[8] == "+0.250 [+0.000, +1.000]" and (tmp_path / "choice.png").is_file()
    assert "| rl | policy | parallel | 2 | [-2.927, +3.427] | [-2.927, +3.427] | [-2.927, +3.427] |" in text
    # paired: seed 1's second task is fixed at every N > 0, nothing broken
    paired = [line for line in text.splitlines() if line.startswith("| rl | policy | parallel | 1 |")]
    assert paired == ["| rl | policy | parallel | 1 | 1 | 0 | - | - | - |  |"]



def test_report_sets_each_model_against_the_warm_start_at_the_same_n(tmp_path):
    """One seed, two tasks: the warm start gets [1, 0] at N = 0 and [1, 1] with a memory, the RL
    model the reverse, so RL - warm start is +0.500 at N = 0 and -0.500 at every N > 0."""
    import json
    for model, zero, more in (("warmstart", [1.0, 0.0], [1.0, 1.0]), ("rl", [1.0, 1.0], [1.0, 0.0])):
        rows = [{"rehearser": "policy", "mode": "parallel", "budget": n, "task_rewards": zero if n == 0 else more}
                for n in wc.BUDGETS]
        (tmp_path / f"sweep_{model}-seed1.json").write_text(json.dumps(rows))
    text = choice_sweep.report(str(tmp_path))
    row = [line for line in text.splitlines() if line.startswith("| rl - warm start |")]
    assert len(row) == 1
    cells = row[0].split(" | ")
    assert cells[1:3] == ["policy", "parallel"] and cells[3].startswith("+0.500 [")
    assert all(c.startswith("-0.500 [") for c in cells[4:])
    assert not any(line.startswith("| warmstart - warm start") for line in text.splitlines())


def test_report_lists_each_seed_with_its_evaluation(tmp_path):
    """Seed by seed: N = 0 and N = 4 success from the sweep rows, imagined success and fidelity from
    eval_MODEL-seedS.json; '-' where the sweep row has no success or the eval file is missing."""
    import json
    rows = [{"rehearser": "policy", "mode": mode, "budget": n, "task_rewards": [1.0, 0.0],
             "success": {0: 0.5, 4: 0.75 if mode == "parallel" else 0.625}.get(n, 0.5)}
            for mode in ("parallel", "sequential") for n in wc.BUDGETS]
    (tmp_path / "sweep_warmstart-seed3.json").write_text(json.dumps(rows))
    (tmp_path / "sweep_rl-seed3.json").write_text(json.dumps([{k: v for k, v in r.items() if k != "success"} for r in rows]))
    (tmp_path / "eval_warmstart-seed3.json").write_text(json.dumps({"imagined_success": 0.8,
                                                                     "fidelity": {"lookup": 1.0, "compute": 0.25}}))
    lines = choice_sweep.report(str(tmp_path)).splitlines()
    assert "| warmstart | 3 | 0.500 | 0.750 | 0.625 | 0.800 | compute 0.250, lookup 1.000 |" in lines
    assert "| rl | 3 | - | - | - | - | - |" in lines

def test_cost_buckets():
    # 3 fig (12) vs 5 apple (15): both two digits, gap 3; 2 milk (4) vs 3 apple (9): one digit each
    assert choice_sweep.cost_bucket(wc.choice_task(["fig", "apple"], [3, 5])) == ("both two digits", "gap 3+")
    assert choice_sweep.cost_bucket(wc.choice_task(["milk", "apple"], [2, 3])) == ("both one digit", "gap 3+")
    assert choice_sweep.cost_bucket(wc.choice_task(["milk", "egg"], [4, 9])) == ("both one digit", "gap 1-2")   # 8, 9
    assert choice_sweep.cost_bucket(wc.choice_task(["milk", "fish"], [2, 2])) == ("one and two digits", "gap 3+")  # 4, 18
