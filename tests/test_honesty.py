"""evaluate.py --compare, the honesty part: pooled fidelity and collusion from made-up
metrics.jsonl lines, the honesty table's arithmetic, and the figure it writes."""
from experiments import compare as experiments
import json

import pytest



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
    fidelity, collusion = experiments.pooled(SEED1, 3, 4)
    assert fidelity == {"compute": 0.9, "lookup": 0.5}          # (4+5)/10, (6+4)/20
    assert collusion == pytest.approx(5 / 8)                     # (3+2)/(6+2), not mean(1/2, 1)
    assert experiments.pooled(SEED2, 1, 1) == ({"compute": 1.0, "lookup": 1.0}, None)   # no wrong call
    assert experiments.pooled(REAL, 1, 4) == ({}, None)


def test_honesty_curves_mean_over_seeds_per_window():
    steps, fidelity, collusion = experiments.honesty_curves([SEED1, SEED2], window=2)
    assert steps == [2, 4]
    # window 1-2: lookup 17/20 and 20/20 -> 0.925; collusion 1/6 (seed 1), 0/1 (seed 2) -> 1/12
    # window 3-4: lookup 10/20 and 16/20 -> 0.65;  collusion 5/8, 1/4 -> 7/16
    assert fidelity == pytest.approx([0.925, 0.65])
    assert collusion == pytest.approx([1 / 12, 7 / 16])
    assert experiments.honesty_curves([REAL], window=2) == ([2, 4], [None, None], [None, None])


def test_honesty_table_arithmetic():
    evals = {"rehearse": [{"imagined_success": 0.9, "collusion": {"wrong": 10, "colluding": 2, "rate": 0.2}},
                          {"imagined_success": 0.7, "collusion": {"wrong": 5, "colluding": 3, "rate": 0.6}}],
             "real": [{"success": 1.0}]}                   # an older eval.json: nothing measured
    rl = {"rehearse": [SEED1, SEED2], "real": [REAL]}
    lines = experiments.honesty_table(evals, rl, kinds=("lookup", "compute"), last=2).splitlines()
    assert lines[0] == ("| arm | seeds | imagined success | collusion (eval) | colluding / wrong calls (eval) | "
                        "collusion (RL, last 2 steps) | fidelity lookup (RL, last 2) | "
                        "fidelity compute (RL, last 2) |")
    # RL, last 2 steps (3-4): collusion 5/8 and 1/4 -> mean 0.4375; lookup 0.5 and 0.8 -> 0.65;
    # compute 9/10 and 8/10 -> 0.85
    assert lines[2] == ("| rehearse | 2 | 0.800 (0.700-0.900) | 0.400 (0.200-0.600) | 5 / 15 | "
                        "0.438 (0.250-0.625) | 0.650 (0.500-0.800) | 0.850 (0.800-0.900) |")
    assert len(lines) == 3                       # real: nothing to measure, left out
    assert experiments.honesty_table({"real": evals["real"]}, {"real": [REAL]}) == ""


def test_compare_adds_the_honesty_table_and_figure(tmp_path):
    for arm, seed, lines in (("rehearse", "seed1", SEED1), ("rehearse", "seed2", SEED2),
                             ("real", "seed1", REAL)):
        folder = tmp_path / arm / seed
        folder.mkdir(parents=True)
        result = {"success": 0.8, "format_errors": 0.0, "mean_calls": 2.0, "fidelity": {"lookup": 1.0}}
        (folder / "eval.json").write_text(json.dumps(result))
        (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    # a run trained before collusion was measured, measured later with evaluate.py --collusion
    (tmp_path / "rehearse" / "seed1" / "collusion.json").write_text(json.dumps(
        {"imagined_success": 0.5, "collusion": {"calls": 9, "wrong": 4, "colluding": 1, "rate": 0.25}}))
    text = experiments.compare(str(tmp_path))
    # the last 20 steps are all 4 here: collusion 6/14 and 1/5
    assert "| rehearse | 2 | 0.500 | 0.250 | 1 / 4 | 0.314 (0.200-0.429) |" in text
    from matplotlib import colors, image
    png = image.imread(tmp_path / "honesty.png")      # figsize (11, 4.2) x dpi 120
    assert png.shape == (504, 1320, 4)
    # the rehearse arm's curves (real has none), in the first cycle colour, in both panels
    line = abs(png[..., :3] - colors.to_rgb("C0")).max(-1) < 0.05
    assert line[:, :660].sum() > 20 and line[:, 660:].sum() > 20
    assert experiments.compare(str(tmp_path)) == text        # again, beside its own outputs
