"""Commands over runs and results, apart from the library they use; each runs with -m
(`python -m scripts.compare ...`).

    evaluate_cli.py      the command line of `python evaluate.py` (evaluate.py's __main__ runs it)
    compare.py           arms and seeds compared: tables, paired bootstrap intervals, figures
    uncertain_report.py  `world: uncertain`: why its episodes fail, which items the actor looked up
    choice_sweep.py      `world: choice`: test-time private rehearsal swept over N
    speed.py             the sampler against generate, and the update, timed
"""
