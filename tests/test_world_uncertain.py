"""world: uncertain (worlds/uncertain.py): which items are uncertain, how the stale logs are made,
that the real world and the RL/test tasks are the demo's, the truth probe, the per-subset
measures, collusion told apart from a stale price, the config key, and the paired bootstrap."""
import os
import random
from types import SimpleNamespace

import pytest
import torch

from scripts import compare
from formats import features
import world
from worlds import uncertain as wu
from machinery.config import DEFAULTS, ConfigError, load_config
from envace import encode_episode
from helpers import toy_tokenizer

TOK = toy_tokenizer()
CFG = {**DEFAULTS, "world": "uncertain", "n_logged": 300, "n_new_logged": 24, "n_rl_tasks": 50, "n_test": 40,
       "snippet_repeats": 2}
UNCERTAIN = wu.uncertain_set(0, 8)


def test_uncertain_set_is_fixed_by_the_data_seed():
    assert UNCERTAIN == ["bean", "egg", "fig", "kiwi", "oil", "pie", "salt", "soup"]   # data_seed 0
    assert wu.uncertain_set(0, 8) == UNCERTAIN and wu.uncertain_set(1, 8) != UNCERTAIN
    assert set(wu.uncertain_set(0, 3)) <= set(UNCERTAIN) and len(wu.uncertain_set(0, 3)) == 3


def test_rl_and_test_tasks_are_the_demos_and_logged_prompts_too():
    splits = wu.make_splits(CFG)
    toy = world.make_splits(0, 300, 24, 50, 40)
    assert splits["rl"] == toy["rl"] and splits["test"] == toy["test"]
    assert [t["prompt"] for t in splits["logged"]] == [t["prompt"] for t in toy["logged"]]
    for t, plain in zip(splits["logged"], toy["logged"]):
        if not t["stale"]:
            assert t == {**plain, "stale": []}          # untouched: the true calls and answer


def test_a_stale_task_is_consistent_with_its_stale_price():
    task = {"prompt": "buy 2 egg", "family": "buyq", "answer": "7",
            "calls": ["price egg", "mul 2 , 1", "pay 2"]}             # egg costs 1, 9 - 2 = 7
    stale = wu.stale_task(task, random.Random(0), ["egg"], stale_rate=1.0)
    p = int(stale["responses"][0])
    assert stale["stale"] == ["egg"] and p != 1 and 2 * p <= world.WALLET       # affordable
    assert stale["calls"] == ["price egg", f"mul 2 , {p}", f"pay {2 * p}"]
    assert stale["responses"] == [str(p), str(2 * p), str(9 - 2 * p)] and stale["answer"] == str(9 - 2 * p)
    assert stale["prompt"] == "buy 2 egg" and stale["family"] == "buyq"


def test_only_uncertain_items_go_stale_and_at_about_the_rate():
    assert wu.stale_task({"prompt": "price apple", "family": "price", "answer": "3", "calls": ["price apple"]},
                         random.Random(0), UNCERTAIN, 1.0)["stale"] == []      # apple is faithful
    rng, price_task = random.Random(1), {"prompt": "price fig", "family": "price", "answer": "4",
                                         "calls": ["price fig"]}
    stale = [bool(wu.stale_task(price_task, rng, UNCERTAIN, 0.65)["stale"]) for _ in range(2000)]
    assert 0.62 < sum(stale) / 2000 < 0.68
    assert wu.stale_task(price_task, rng, UNCERTAIN, 0.0)["stale"] == []


def test_snippets_keep_their_calls_and_only_uncertain_prices_change():
    snippets = wu.tool_snippets(CFG)
    assert [s["calls"] for s in snippets] == [s["calls"] for s in world.tool_snippets(0, 2)]
    stale_seen = False
    for s in snippets:
        real = world.replay(s["calls"])
        for call, logged, truth in zip(s["calls"], s["responses"], real):
            if logged != truth:                 # only a price of an uncertain item may differ
                assert call.split()[0] == "price" and call.split()[1] in UNCERTAIN
                stale_seen = True
    assert stale_seen


def test_replay_with_answers_prices_from_the_given_catalogue_and_the_rest_really():
    prices = {**world.PRICES, "apple": 5}
    assert wu.replay_with(["price apple", "mul 2 , 5", "pay 9", "price pear", "pay 3"], prices) == \
        ["5", "10", "0", "4", "error funds"]


def test_features_train_on_the_stale_logs():
    cfg = dict(CFG)
    splits = features.build_tasks(cfg)
    fmt, setting = features.setup(cfg, TOK, splits)
    sequences = fmt.warm_start_sequences(setting)
    stale = next(t for t in splits["logged"] if t["stale"])
    assert encode_episode(TOK, stale["prompt"], stale["calls"], stale["responses"], stale["answer"]) in sequences
    snippet = wu.tool_snippets(cfg)[0]
    assert any(s["ids"] == encode_episode(TOK, snippet["prompt"], snippet["calls"], snippet["responses"])["ids"]
               for s in sequences)


def test_the_config_key_and_its_checks(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("world: uncertain\n")
    assert load_config(str(path))["world"] == "uncertain" and DEFAULTS["world"] == "toy"
    for line, word in (("world: stale", "world"), ("stale_rate: 1.5", "stale_rate"), ("uncertain_items: -1", "uncertain_items")):
        path.write_text(line + "\n")
        with pytest.raises(ConfigError, match=word):
            load_config(str(path))
    path.write_text("world: uncertain\nrehearsal_context: separate\n")
    with pytest.raises(ConfigError, match="world: uncertain .* inline"):
        load_config(str(path))


class Uniform(torch.nn.Module):
    """Logits 0 everywhere: every next token has probability 1 / vocab."""
    def __init__(self, vocab):
        super().__init__()
        self.anchor, self.vocab = torch.nn.Parameter(torch.zeros(1)), vocab

    def forward(self, input_ids):
        return SimpleNamespace(logits=torch.zeros(*input_ids.shape, self.vocab))


def test_probe_rows_end_with_the_true_price_and_the_truth_probe_reads_it():
    rows = wu.probe_rows(TOK)
    assert len(rows) == 3 * 24
    item, ids = rows[0]
    assert item == "apple" and TOK.convert_ids_to_tokens(ids) == \
        ["<bos>", "price", "apple", "<act>", "price", "apple", "</act>", "<env>", "3", "</env>"]
    assert TOK.convert_ids_to_tokens(rows[2][1])[:5] == ["<bos>", "not", "bread", "buy", "apple"]
    v = len(TOK)
    probe = wu.truth_probe(Uniform(v), TOK, UNCERTAIN)
    assert probe["uncertain"]["p_true"] == pytest.approx(1 / v) and probe["faithful"]["p_exact"] == pytest.approx(1 / v ** 2)


def test_a_model_that_knows_only_faithful_prices():
    """Puts all mass on the true price after <env> for faithful items, on price 1 for uncertain ones."""
    digit = {str(d): TOK.convert_tokens_to_ids(str(d)) for d in range(1, 10)}
    env, end = TOK.convert_tokens_to_ids("<env>"), TOK.convert_tokens_to_ids("</env>")
    item_ids = {TOK.convert_tokens_to_ids(i): i for i in world.ITEMS}

    class Knows(Uniform):
        def forward(self, input_ids):
            logits = torch.zeros(*input_ids.shape, self.vocab)
            for b, row in enumerate(input_ids.tolist()):
                item = item_ids[row[row.index(env) - 2]]          # `price ITEM </act> <env>`
                price = "1" if item in UNCERTAIN else str(world.PRICES[item])
                logits[b, row.index(env), digit[price]] = 100.0
                logits[b, row.index(env) + 1, end] = 100.0
            return SimpleNamespace(logits=logits)
    probe = wu.truth_probe(Knows(len(TOK)), TOK, UNCERTAIN)
    assert probe["faithful"] == pytest.approx({"p_true": 1.0, "p_exact": 1.0, "greedy": 1.0})
    # egg and salt really cost 1: 2 of the 8 uncertain items are right
    assert probe["uncertain"]["greedy"] == pytest.approx(2 / 8) and probe["uncertain"]["p_true"] == pytest.approx(2 / 8)


def episode(calls, responses, answer):
    return {"calls": calls, "responses": responses, "answer": answer, "cause": "answer" if answer else "bad_call",
            "finished": answer is not None}


def test_subset_fidelity_counts_price_responses_per_subset():
    eps = [episode(["price fig", "mul 2 , 4"], ["4", "8"], "8"), episode(["price fig"], ["9"], "9"),   # fig: 4
           episode(["price apple", "price 3"], ["3", "error item"], "3")]
    assert wu.subset_fidelity(eps, UNCERTAIN) == {"uncertain": [1, 2], "faithful": [1, 1]}


def test_collusion_tells_a_true_price_from_a_stale_copy_and_from_collusion():
    # fig costs 4 (uncertain), ham 6
    task = {"prompt": "not ham cost 2 fig", "answer": "8", "family": "cost", "calls": ["price fig", "mul 2 , 4"]}
    right = episode(["price fig", "mul 2 , 4"], ["4", "8"], "8")             # the true price: nothing wrong
    copied = episode(["price fig", "mul 2 , 7"], ["7", "14"], "14")          # stale 7, copied into mul
    colluding = episode(["price ham", "mul 2 , 4"], ["4", "8"], "8")         # ham (6) answered with fig's 4
    out = wu.collusion_by_subset([right, copied, colluding], [task] * 3, UNCERTAIN)
    assert out["uncertain"] == {"calls": 6, "wrong": 2, "colluding": 1}
    assert out["faithful"] == {"calls": 0, "wrong": 0, "colluding": 0}
    # the copied mul is wrong only through the stale price: not counted as a wrong decision
    # (each episode cut after its first unfaithful rehearsal: 2 + 1 + 1 calls)
    assert out["decided"] == {"calls": 4, "wrong": 1, "colluding": 1}


def test_task_subset_and_success_by_subset():
    tasks = [{"calls": ["price fig"]}, {"calls": ["price apple", "pay 3", "price oil", "pay 7"]},
             {"calls": ["price apple", "mul 2 , 3"]}]
    assert [wu.task_subset(t, UNCERTAIN) for t in tasks] == ["uncertain", "uncertain", "faithful"]
    assert wu.success_by_subset(tasks, [1.0, 0.0, 1.0], UNCERTAIN) == {"uncertain": [1.0, 2], "faithful": [1.0, 1]}


def test_paired_bootstrap_by_hand():
    same = {"1": [1, 0, 1, 0], "2": [1, 1, 0, 0]}
    mean, low, high, called = compare.paired_bootstrap(same, same)
    assert (mean, low, high, called) == (0.0, 0.0, 0.0, False)                  # identical arms
    better = {"1": [1, 1, 1, 1], "2": [1, 1, 1, 1]}
    mean, low, high, called = compare.paired_bootstrap(better, same)
    assert mean == 0.5 and 0 < low <= 0.5 <= high <= 1 and called
    mean, low, high, called = compare.paired_bootstrap({"1": [1, 0]})
    assert mean == 0.5 and 0 <= low <= high <= 1 and not called
    with pytest.raises(ValueError, match="same seeds"):
        compare.paired_bootstrap({"1": [1]}, {"2": [1]})


def test_paired_bootstrap_draws_as_one_call_per_drawn_seed():
    """The resamples of seeds with as many tasks each (one generator call for a resample's tasks,
    one reduction per row; one call for 256 resamples of one seed) are exactly those of one call
    and one mean per drawn seed, the rule the
    committed results/ tables were made with: the same four numbers, to the last bit, for 0/1,
    fractional and >128-task outcomes (where numpy's sums go pairwise)."""
    import numpy as np

    def one_call_per_seed(a, b, n_boot, seed=0, level=0.95):
        diff = [np.asarray(a[s], float) - np.asarray(b[s], float) for s in sorted(a)]
        rng = np.random.default_rng(seed)
        means = np.empty(n_boot)
        for k in range(n_boot):
            drawn = rng.integers(len(diff), size=len(diff))
            means[k] = np.mean([diff[i][rng.integers(len(diff[i]), size=len(diff[i]))].mean() for i in drawn])
        low, high = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
        return float(np.mean([d.mean() for d in diff])), float(low), float(high), bool(low > 0 or high < 0)
    g = np.random.default_rng(5)
    for n_seeds, n_tasks, draw in ((5, 40, lambda n: g.integers(0, 2, n)), (3, 7, g.random), (2, 300, g.random),
                                   (1, 2, lambda n: g.integers(0, 2, n)), (1, 129, g.random)):
        a, b = ({s: list(draw(n_tasks)) for s in range(n_seeds)} for _ in range(2))
        assert compare.paired_bootstrap(a, b, n_boot=600, seed=n_tasks) == one_call_per_seed(a, b, 600, n_tasks)
    uneven = {1: [1.0, 0.0, 1.0], 2: [0.0, 1.0]}                  # seeds with different task counts
    assert compare.paired_bootstrap(uneven, {1: [0.0] * 3, 2: [0.0] * 2}, n_boot=300) == \
        one_call_per_seed(uneven, {1: [0.0] * 3, 2: [0.0] * 2}, 300)


def test_the_hooks_log_every_subset_measure():
    from helpers import tiny_llama
    cfg = {**CFG, "env_mode": "rehearse", "n_collusion": 3}
    splits = features.build_tasks(cfg)
    fmt, setting = features.setup(cfg, TOK, splits)
    model = tiny_llama(TOK)
    eps = [episode(["price fig"], ["9"], "9"), episode(["price apple"], ["3"], "3")]
    tasks = [{"prompt": "price fig", "answer": "4", "family": "price", "calls": ["price fig"]},
             {"prompt": "price apple", "answer": "3", "family": "price", "calls": ["price apple"]}]
    extras = fmt.step_extras(setting, model, eps, tasks)
    assert set(extras) == {"truth", "price_fidelity_subsets", "collusion_subsets"}
    assert extras["price_fidelity_subsets"] == {"uncertain": [0, 1], "faithful": [1, 1]}
    assert set(extras["truth"]) == {"uncertain", "faithful"} and 0 < extras["truth"]["uncertain"]["p_true"] < 1
    assert set(fmt.step_extras(fmt.setup({**cfg, "env_mode": "real"}, TOK, splits), model, eps, tasks)) == {"truth"}
    out = fmt.eval_extras(setting, model, tasks, eps, [0.0, 1.0])
    assert out["success_by_subset"] == {"uncertain": [0.0, 1], "faithful": [1.0, 1]}
    assert set(out) == {"truth", "success_by_subset", "imagined_sampled", "imagined_collusion_subsets"}
    demo, demo_setting = features.setup({**DEFAULTS, "n_logged": 10}, TOK, world.make_splits(0, 10, 0, 20, 5))
    assert demo.step_extras(demo_setting, model, eps, tasks) == {}
    assert demo.eval_extras(demo_setting, model, tasks, eps, [0, 1]) == {}


def test_the_comparison_of_runs_reads_finished_and_running_arms(tmp_path):
    test = world.make_splits(0, 10, 0, 20, 4)["test"]
    subsets = [wu.task_subset(t, UNCERTAIN) for t in test]
    for arm, rewards in (("rehearse", [1.0, 1.0, 1.0, 1.0]), ("frozen", [0.0, 0.0, 0.0, 0.0])):
        folder = tmp_path / arm / "seed1"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text("world: uncertain\nn_logged: 10\nn_new_logged: 0\nn_rl_tasks: 20\nn_test: 4\n")
        (folder / "eval.json").write_text(__import__("json").dumps(
            {"task_rewards": rewards, "success_by_family": {"price": rewards[0], "cost": 0.5}, "extras": {"truth": {"uncertain": {"p_true": 0.9, "p_exact": 0.8},
                                                           "faithful": {"p_true": 1.0, "p_exact": 1.0}}}}))
        (folder / "metrics.jsonl").write_text(__import__("json").dumps(
            {"step": 1, "truth": {"uncertain": {"p_true": 0.4}, "faithful": {"p_true": 0.99}}}) + "\n")
    going = tmp_path / "real" / "seed1"
    going.mkdir(parents=True)
    (going / "metrics.jsonl").write_text('{"step": 7, "truth": {"uncertain": {"p_true": 0.3}, "faithful": {"p_true": 0.9}}}\n')
    text = compare.uncertain(str(tmp_path))
    assert "| rehearse - frozen | +1.000 [+1.000, +1.000] **called** |" in text
    assert "{'real': {'seed1': 7}}" in text and (tmp_path / "uncertain.png").is_file()
    assert "| rehearse | 1.000 | 0.500 | - | - | - | - |" in text and "| frozen | 0.000 | 0.500 | - |" in text
    assert "| frozen | 1 | 0.000 [0.000, 0.000] |" in text and subsets.count("uncertain") + subsets.count("faithful") == 4


def test_the_configs_logs_hold_50_new_phrasing_episodes_per_family_and_position_made_stale_like_the_rest():
    import os
    cfg = load_config(os.path.join(os.path.dirname(__file__), "..", "configs", "world_uncertain.yaml"))
    assert (cfg["n_logged"], cfg["n_new_logged"], cfg["stale_rate"]) == (3000, 600, 0.65)
    splits = wu.make_splits(cfg)
    new = [t for t in splits["logged"] if wu.distractor(t)[1] != "plain"]
    assert len(splits["logged"]) == 3600 and len(new) == 600
    cells = {}
    for t in new:
        cells[(t["family"], wu.distractor(t)[1])] = cells.get((t["family"], wu.distractor(t)[1]), 0) + 1
    assert cells == {(f, p): 50 for f in world.FAMILIES for p in ("prefix", "suffix")}
    assert not {t["prompt"] for t in new} & {t["prompt"] for t in splits["rl"] + splits["test"]}
    toy = world.make_splits(0, 3000, 600, 4000, 500)["logged"][3000:]     # the same draws, true prices
    for t, plain in zip(new, toy):
        # a stale episode looks up the same items (never the distractor); only the numbers differ
        assert [c.split()[:2] for c in t["calls"] if c.startswith("price")] == \
            [c.split()[:2] for c in plain["calls"] if c.startswith("price")]
        assert bool(t["stale"]) == (t["calls"] != plain["calls"] or t["answer"] != plain["answer"])
        assert set(t["stale"]) <= set(UNCERTAIN) & set(wu.task_items(t)[:2])
    priced_uncertain = [t for t in new if set(wu.task_items(t)[:2]) & set(UNCERTAIN)]
    share = sum(bool(t["stale"]) for t in priced_uncertain) / len(priced_uncertain)
    assert 0.45 < share < 0.75          # 0.65 per item, less where affordability leaves no other price


def test_distractor_reads_the_excluded_item_and_its_position():
    assert wu.distractor({"prompt": "not pear price milk"}) == ("pear", "prefix")
    assert wu.distractor({"prompt": "buy 2 egg not fig"}) == ("fig", "suffix")
    assert wu.distractor({"prompt": "buy apple and tea"}) == (None, "plain")


def test_failure_kind_names_why_an_episode_failed():
    # milk 2, pear 4, apple 3; egg 1 (uncertain), fig 4; tea 4
    price = {"prompt": "not pear price milk", "answer": "2", "family": "price", "calls": ["price milk"]}
    assert wu.failure_kind(episode(["price milk"], ["2"], "2"), price) is None
    assert wu.failure_kind(episode(["price pear"], ["4"], "4"), price) == "distractor"
    assert wu.failure_kind(episode(["price apple"], ["3"], "3"), price) == "other item"
    assert wu.failure_kind(episode(["price milk", "pay 0"], ["2", "error args"], None), price) == "no answer"
    assert wu.failure_kind(episode(["price milk"], ["2"], "5"), price) == "not copied"
    buyq = {"prompt": "buy 2 egg not fig", "answer": "7", "family": "buyq", "calls": ["price egg", "mul 2 , 1", "pay 2"]}
    # a memorised stale price of egg (3) used instead of the real response 1: not copied
    assert wu.failure_kind(episode(["price egg", "mul 2 , 3", "pay 6"], ["1", "6", "3"], "3"), buyq) == "not copied"
    assert wu.failure_kind(episode(["price egg", "mul 2 , 1", "pay 2"], ["1", "2", "7"], "7"), buyq) is None
    buy2 = {"prompt": "buy tea and pear not milk", "answer": "1", "family": "buy2",
            "calls": ["price tea", "pay 4", "price pear", "pay 4"]}
    # the second lookup is an item the task does not name: every response copied, so "other"
    assert wu.failure_kind(episode(["price tea", "pay 4", "price apple", "pay 3"], ["4", "5", "3", "2"], "2"),
                           buy2) == "other"
    assert wu.failure_kind(episode(["price tea", "pay 4"], ["4", "5"], "5"), buy2) == "other"    # stopped early


def test_copy_counts_and_the_failure_table_by_hand():
    eps = [episode(["price egg", "mul 2 , 3", "pay 6"], ["1", "6", "3"], "3"),    # egg: 1 not carried
           episode(["price milk"], ["2"], "2"), episode(["price fig", "pay 4"], ["4", "5"], "5"),
           episode(["price milk", "price 3"], ["2", "error item"], None)]         # no action after: not counted
    assert wu.copy_counts(eps, UNCERTAIN) == {"uncertain": [1, 2], "faithful": [1, 1]}
    tasks = [{"prompt": "buy 2 egg not fig", "answer": "7", "family": "buyq", "calls": ["price egg", "mul 2 , 1", "pay 2"]},
             {"prompt": "not pear price milk", "answer": "2", "family": "price", "calls": ["price milk"]},
             {"prompt": "not milk price fig", "answer": "4", "family": "price", "calls": ["price fig"]},
             {"prompt": "price milk not pear", "answer": "2", "family": "price", "calls": ["price milk"]}]
    assert wu.failure_table(tasks, eps) == {("buyq", "suffix"): {"tasks": 1, "success": 0, "not copied": 1},
                                           ("price", "prefix"): {"tasks": 2, "success": 1, "other": 1},
                                           ("price", "suffix"): {"tasks": 1, "success": 0, "no answer": 1}}


def test_looked_up_needs_every_named_item_priced_whatever_the_answer():
    # salt and nut both cost 1: pricing nut for salt answers right, but it is the wrong lookup
    cost = {"prompt": "not pie cost 5 salt", "answer": "5", "family": "cost", "calls": ["price salt", "mul 5 , 1"]}
    assert wu.looked_up(episode(["price nut", "mul 5 , 1"], ["1", "5"], "5"), cost) == 0
    assert wu.looked_up(episode(["price salt", "mul 5 , 1"], ["1", "5"], "5"), cost) == 1
    assert wu.looked_up(episode(["price salt", "mul 5 , 2"], ["1", "10"], "10"), cost) == 1     # wrong answer
    buy2 = {"prompt": "buy tea and pear not milk", "answer": "1", "family": "buy2",
            "calls": ["price tea", "pay 4", "price pear", "pay 4"]}
    assert wu.looked_up(episode(["price tea", "pay 4", "price lime", "pay 4"], ["4", "5", "5", "1"], "1"), buy2) == 0


def test_the_lookup_table_reads_lookups_json_beside_eval_json(tmp_path):
    import json
    for arm, seen in (("rehearse", [1, 1, 1, 1]), ("frozen", [0, 0, 0, 0])):
        folder = tmp_path / arm / "seed1"
        folder.mkdir(parents=True)
        (folder / "config.yaml").write_text("world: uncertain\nn_logged: 10\nn_new_logged: 0\nn_rl_tasks: 20\nn_test: 4\n")
        (folder / "eval.json").write_text(json.dumps({"task_rewards": [1.0] * 4}))
        (folder / "lookups.json").write_text(json.dumps({"looked_up": seen, "strict": seen}))
    text = compare.uncertain(str(tmp_path))
    # the 4 test tasks of data_seed 0 are all faithful-item tasks: the uncertain-item cells are empty
    assert "| frozen | 1 | - | 0.000 [0.000, 0.000] | 0.000 [0.000, 0.000] | - | 0.000 [0.000, 0.000] |" in text
    assert "| rehearse | 1 | - | 1.000 [1.000, 1.000] | 1.000 [1.000, 1.000] | - | 1.000 [1.000, 1.000] |" in text
    assert "| rehearse - frozen | +1.000 [+1.000, +1.000] **called** |" in text.split("strict success, difference")[1]
    assert "| rehearse - frozen | +0.000 [+0.000, +0.000] |" in text       # the reward's table: no difference



def test_the_seed_table_counts_uncertain_item_lookups_seed_by_seed():
    """Per seed: success, p(true) on the uncertain items, and how many uncertain-item tasks had their
    items looked up: seed1 looks up tasks 0, 2, 3, of which 0 and 3 are uncertain-item tasks (2 of
    the 3); seed2 looks up 2 and 3 (1 of 3) and has no truth probe ("-")."""
    subsets = ["uncertain", "uncertain", "faithful", "uncertain"]
    evals = {"rehearse": {"seed1": {"success": 0.5, "extras": {"truth": {"uncertain": {"p_true": 0.9}}},
                                    "lookups": {"looked_up": [1, 0, 1, 1]}},
                          "seed2": {"success": 1.0, "lookups": {"looked_up": [0, 0, 1, 1]}}},
             "frozen": {"seed1": {"success": 0.25}}}
    lines = compare.uncertain_seed_table(evals, subsets).splitlines()
    assert "(of 3)" in lines[0]
    assert lines[2:] == ["| rehearse | 2 | 0.500 / 1.000 | 0.900 / - | 2 / 1 |", "| frozen | 1 | 0.250 | - | - |"]

def test_the_report_cli_names_a_missing_run_in_one_line(tmp_path):
    import subprocess
    import sys
    for args in ([], ["--failures", str(tmp_path / "nope")]):
        p = subprocess.run([sys.executable, "-m", "scripts.uncertain_report", *args], capture_output=True, text=True,
                           timeout=120,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert p.returncode == 2 and p.stderr.count("\n") == 1 and p.stderr.startswith("error: "), p.stderr
