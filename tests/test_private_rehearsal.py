"""Test-time private rehearsal: imagination never touches the real world, the committed episode
makes no more real calls than an unrehearsed one, the vote and the re-planning rule."""
import dataclasses
from types import SimpleNamespace

from formats import format_plain
import rehearse
import world
from envace import ACT, OBS, PROMPT, TAG
from evaluate import evaluate
from helpers import ScriptedModel, toy_tokenizer
from rollout import sample_episodes
from machinery.config import DEFAULTS

TOK = toy_tokenizer()
# the policy prices the distractor (a wrong plan); imagined episodes answer 6, the real world 3
SCRIPTS = {"not pear price apple": "<act> price pear </act> <env> 4 </env> <act> answer 4 </act>",
           "buy apple": "<act> price apple </act> <env> 3 </env> <act> pay 3 </act> <env> 6 </env> "
                        "<act> answer 6 </act>"}


def counting_world():
    """The toy world with every real execution counted."""
    calls = []

    def step(state, call):
        calls.append(call)
        return world.step(state, call)
    functions = {k: getattr(world, k) for k in dir(world) if not k.startswith("_")}
    return SimpleNamespace(**{**functions, "step": step}), calls


def test_imagination_never_calls_the_real_world():
    counted, calls = counting_world()
    for mode in ("parallel", "sequential"):
        plans, used = rehearse.private_rehearsal_plans(ScriptedModel(TOK, SCRIPTS), TOK, list(SCRIPTS), 4,
                                                       mode, world=counted, sample=sample_episodes)
        assert calls == []
        assert plans == [[("price pear", "4")], [("price apple", "3"), ("pay 3", "6")]]
        assert used == ([4, 4] if mode == "parallel" else [2, 2])   # sequential: 2 agree, stop


def test_rehearsed_evaluation_makes_the_same_real_calls_as_plain():
    tasks = [{"prompt": p, "answer": a, "family": "x"} for p, a in zip(SCRIPTS, ["3", "6"])]
    real_calls = {}
    for budget in (0, 2, 4):
        counted, calls = counting_world()
        cfg = {**DEFAULTS, "rehearsal_budget": budget}
        setting = dataclasses.replace(format_plain.setup(cfg, TOK, {"logged": []}), world=counted)
        result = evaluate(ScriptedModel(TOK, SCRIPTS), TOK, tasks, cfg, format_plain, setting)
        real_calls[budget] = list(calls)
        assert result["success"] == 0.5 and result["imagined_per_task"] == budget
    assert real_calls[0] == real_calls[2] == real_calls[4] == ["price pear", "price apple", "pay 3"]


def test_the_vote_and_its_ties():
    def episode(answer, calls=("price tea",), finished=True):
        return {"answer": answer, "finished": finished, "calls": list(calls), "responses": ["4"] * len(calls)}
    votes = [episode("4", ["price tea"]), episode("8", ["price jam"]), episode("8", ["price jam", "pay 8"]),
             episode("4", finished=False)]
    assert rehearse._vote(votes) == [("price jam", "4")]              # 8 twice beats 4 once
    assert rehearse._vote(votes[:2]) == [("price tea", "4")]          # a tie: the first imagined
    assert rehearse._vote([episode(None, finished=False)]) == []      # no answer, no plan
    assert rehearse._agreed(votes) and not rehearse._agreed(votes[:2])


def test_a_plan_is_followed_until_the_world_surprises():
    script = "<act> price milk </act> <env> x x <act> answer 2 </act> x x x x"
    policy = ScriptedModel(TOK, {"buy apple": script})
    followed, surprised = sample_episodes(
        policy, TOK, ["buy apple", "buy apple"], "real", settings={"temperature": 0},
        plans=[[("price apple", "3"), ("pay 3", "6")], [("price apple", "5"), ("pay 5", "4")]])
    # row 0: both planned calls happen (their responses were as imagined), then the policy answers
    assert followed["calls"] == ["price apple", "pay 3"] and followed["responses"] == ["3", "6"]
    # row 1: the real price is 3, not the imagined 5: the plan is dropped and the policy re-plans
    assert surprised["calls"] == ["price apple"] and surprised["cause"] == "answer"
    assert followed["roles"][:8] == [PROMPT, PROMPT, PROMPT, TAG, ACT, ACT, ACT, TAG]


def test_no_env_mode_gives_empty_observations():
    script = "<act> price apple </act> <env> </env> <act> pay 3 </act> <env> </env> <act> answer 6 </act>"
    e, = sample_episodes(ScriptedModel(TOK, {"buy apple": script}), TOK, ["buy apple"], "none",
                         settings={"temperature": 0})
    assert e["responses"] == ["", ""]
    words = TOK.convert_ids_to_tokens(e["ids"])
    assert words[3:9] == ["<act>", "price", "apple", "</act>", "<env>", "</env>"]
    assert e["roles"][7:9] == [TAG, OBS]


def test_the_sweep_of_a_run_folder_writes_every_setting(tmp_path):
    """evaluate.py --sweep (the last step of configs/run_all.sh) on a real run folder: one row per
    rehearser, mode and budget; in parallel mode a task imagines exactly N episodes, in sequential
    mode at most N."""
    import json
    import os

    from scripts import evaluate_cli
    import train
    from helpers import tiny_cfg
    cfg = tiny_cfg(tmp_path, rl_steps=1, n_test=4, n_collusion=0)
    assert train.run(cfg) == 0
    warm = os.path.join(cfg["out_dir"], "warmstart")
    assert evaluate_cli.main(["--ckpt", cfg["out_dir"], "--sweep", "--rehearser", warm, "--n_test=3",
                              "--eval_temperature=0.6", "--top_p=0.95", "--imagine_temperature=0.6"]) == 0
    rows = json.load(open(os.path.join(cfg["out_dir"], "private_rehearsal.json")))
    assert [(r["rehearser"], r["mode"], r["budget"]) for r in rows] == [
        (who, mode, n) for who in ("policy", "rehearser") for mode in ("parallel", "sequential") for n in (0, 1, 2, 4)]
    for r in rows:
        assert round(r["success"] * 3, 9).is_integer()
        if r["mode"] == "parallel":
            assert r["imagined_per_task"] == r["budget"]
        else:
            assert r["imagined_per_task"] <= r["budget"]
