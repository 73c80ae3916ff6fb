"""Benchmarks run offline and scored by real execution.

    bfcl.py    BFCL-v4 multi-turn as chat task files, its tools' executor and official check
               (`python bfcl.py --out DIR` from the root)
    oracle.py  every task's gold calls replayed through its executor (`python evaluate.py --oracle`)
"""
