"""The experiments: world variants, their reports, and the comparison of runs.

    compare.py           arms and seeds compared: tables, paired bootstrap intervals, figures
    uncertain.py         `world: uncertain`: the toy shop with stale logs for some items
    uncertain_report.py  why its episodes fail, which items the actor looked up
    choice.py            `world: choice`: buy the cheapest option with one real call
    choice_sweep.py      test-time private rehearsal swept over N
"""
