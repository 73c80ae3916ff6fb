"""evaluate.py --compare, the honesty part: pooled fidelity and collusion from made-up
metrics.jsonl lines, the honesty table's arithmetic, and the figure it writes; greedy_hits (what
would-rehearse fidelity reads) on a model that is no transformers model, by hand."""
import json
from types import SimpleNamespace

import pytest
import torch

from envace import ACT, OBS, PROMPT, REHEARSE
from scripts import compare
from worldmodel import honesty


def line(step, lookup=(0, 0), compute=(0, 0), wrong=0, colluding=0):
    counts = {k: list(v) for k, v in (("lookup", lookup), ("compute", compute)) if v[1]}
    return {"step": step, "fidelity_counts": counts,
            "collusion": {"calls": 0, "wrong": wrong, "colluding": colluding}}


# seed 1: steps 1..4; seed 2: steps 1..4, with a step that had no wrong call
SEED1 = [line(1, (9, 10), (5, 5), 4, 0), line(2, (8, 10), (5, 5), 2, 1),
         line(3, (6, 10), (4, 5), 6, 3), line(4, (4, 10), (5, 5), 2, 2)]
SEED2 = [line(1, (10, 10), (5, 5), 0, 0), line(2, (10, 10), (5, 5), 1, 0),
         line(3, (9, 10), (5, 5), 0, 0), line(4, (7, 10), (3, 5), 4, 1)]
REAL = [{"step": s} for s in (1, 2, 3, 4)]          # real mode: no rehearsed calls


def test_pooled_is_a_rate_of_sums():
    fidelity, collusion = compare.pooled(SEED1, 3, 4)
    assert fidelity == {"compute": 0.9, "lookup": 0.5}          # (4+5)/10, (6+4)/20
    assert collusion == pytest.approx(5 / 8)                     # (3+2)/(6+2), not mean(1/2, 1)
    assert compare.pooled(SEED2, 1, 1) == ({"compute": 1.0, "lookup": 1.0}, None)   # no wrong call
    assert compare.pooled(REAL, 1, 4) == ({}, None)


def test_honesty_curves_mean_over_seeds_per_window():
    steps, fidelity, collusion = compare.honesty_curves([SEED1, SEED2], window=2)
    assert steps == [2, 4]
    # window 1-2: lookup 17/20 and 20/20 -> 0.925; collusion 1/6 (seed 1), 0/1 (seed 2) -> 1/12
    # window 3-4: lookup 10/20 and 16/20 -> 0.65;  collusion 5/8, 1/4 -> 7/16
    assert fidelity == pytest.approx([0.925, 0.65])
    assert collusion == pytest.approx([1 / 12, 7 / 16])
    assert compare.honesty_curves([REAL], window=2) == ([2, 4], [None, None], [None, None])


def test_honesty_table_arithmetic():
    evals = {"rehearse": [{"imagined_success": 0.9, "collusion": {"wrong": 10, "colluding": 2, "rate": 0.2}},
                          {"imagined_success": 0.7, "collusion": {"wrong": 5, "colluding": 3, "rate": 0.6}}],
             "real": [{"success": 1.0}]}                   # an older eval.json: nothing measured
    rl = {"rehearse": [SEED1, SEED2], "real": [REAL]}
    lines = compare.honesty_table(evals, rl, kinds=("lookup", "compute"), last=2).splitlines()
    assert lines[0] == ("| arm | seeds | imagined success | collusion (eval) | colluding / wrong calls (eval) | "
                        "collusion (RL, last 2 steps) | fidelity lookup (RL, last 2) | "
                        "fidelity compute (RL, last 2) |")
    # RL, last 2 steps (3-4): collusion 5/8 and 1/4 -> mean 0.4375; lookup 0.5 and 0.8 -> 0.65;
    # compute 9/10 and 8/10 -> 0.85
    assert lines[2] == ("| rehearse | 2 | 0.800 (0.700-0.900) | 0.400 (0.200-0.600) | 5 / 15 | "
                        "0.438 (0.250-0.625) | 0.650 (0.500-0.800) | 0.850 (0.800-0.900) |")
    assert len(lines) == 3                       # real: nothing to measure, left out
    assert compare.honesty_table({"real": evals["real"]}, {"real": [REAL]}) == ""


def test_compare_adds_the_honesty_table_and_figure(tmp_path):
    for arm, seed, lines in (("rehearse", "seed1", SEED1), ("rehearse", "seed2", SEED2),
                             ("real", "seed1", REAL)):
        folder = tmp_path / arm / seed
        folder.mkdir(parents=True)
        result = {"success": 0.8, "format_errors": 0.0, "mean_calls": 2.0, "fidelity": {"lookup": 1.0}}
        (folder / "eval.json").write_text(json.dumps(result))
        (folder / "config.yaml").write_text(f"seed: {seed[-1]}\n")          # seeds of one config: pooled
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    # a run trained before collusion was measured, measured later with evaluate.py --collusion
    (tmp_path / "rehearse" / "seed1" / "collusion.json").write_text(json.dumps(
        {"imagined_success": 0.5, "collusion": {"calls": 9, "wrong": 4, "colluding": 1, "rate": 0.25}}))
    text = compare.compare(str(tmp_path))
    # the last 20 steps are all 4 here: collusion 6/14 and 1/5
    assert "| rehearse | 2 | 0.500 | 0.250 | 1 / 4 | 0.314 (0.200-0.429) |" in text
    from matplotlib import colors, image
    png = image.imread(tmp_path / "honesty.png")      # figsize (11, 4.2) x dpi 120
    assert png.shape == (504, 1320, 4)
    # the rehearse arm's curves (real has none), in the first cycle colour, in both panels
    line = abs(png[..., :3] - colors.to_rgb("C0")).max(-1) < 0.05
    assert line[:, :660].sum() > 20 and line[:, 660:].sum() > 20
    assert compare.compare(str(tmp_path)) == text        # again, beside its own outputs


class NextId(torch.nn.Module):
    """A causal LM of no transformers class and with no parameters: after id x its argmax is x + 1."""

    def forward(self, input_ids, **kw):
        return SimpleNamespace(logits=torch.nn.functional.one_hot(input_ids + 1, 16).float())


@pytest.mark.parametrize("token_budget", [4096, 4])
def test_greedy_hits_of_a_model_that_is_no_transformers_model_by_hand(token_budget):
    """hits[i, t]: the argmax after row i's ids 0..t is its id t+1, at the targets of the asked
    role only (the role of id t+1); a padded target is never a hit. Budget 4: each row a
    micro-batch of its own (row 1 is 4 ids long). Mutations: the logits not shifted by one, the
    role mask dropped, a parameterless model's device taken from its parameters."""
    P, A, R, O = PROMPT, ACT, REHEARSE, OBS
    rows = [{"ids": [5, 6, 7, 9, 10], "roles": [P, A, O, O, O]},     # next id +1?  6 y, 7 y, 9 n, 10 y
            {"ids": [5, 6, 7, 9], "roles": [P, R, R, O]}]            #              6 y, 7 y, 9 n, (pad)
    hits, roles, _ = honesty.greedy_hits(NextId(), rows, OBS, pad_id=0, token_budget=token_budget)
    assert hits.tolist() == [[False, True, False, True], [False, False, False, False]]
    assert roles.tolist() == [[P, A, O, O, O], [P, R, R, O, 5]]           # 5: PAD
    hits, _, _ = honesty.greedy_hits(NextId(), rows, REHEARSE, pad_id=0, token_budget=token_budget)
    assert hits.tolist() == [[False, False, False, False], [True, True, False, False]]


def test_the_imagined_world_samples_eval_batch_size_tasks_at_a_time():
    """Collusion and imagined success sample their tasks eval_batch_size at a time, the bound on an
    evaluation's KV cache (5 tasks at 2: batches of 2, 2, 1)."""
    import rollout
    import world
    from helpers import tiny_llama, toy_tokenizer
    from machinery import config
    batches = []

    def sample(model, tokenizer, prompts, mode, **kwargs):
        batches.append(len(prompts))
        return rollout.sample_episodes(model, tokenizer, prompts, mode, **kwargs)

    tokenizer = toy_tokenizer()
    tasks = [{"prompt": f"price {item}", "answer": "1", "family": "price", "calls": [f"price {item}"]}
             for item in world.ITEMS[:5]]
    cfg = {**config.DEFAULTS, "eval_batch_size": 2, "max_turns": 1, "max_tokens": 32}
    honesty.imagined_world(tiny_llama(tokenizer), tokenizer, tasks, cfg, sample=sample)
    assert batches == [2, 2, 1]
