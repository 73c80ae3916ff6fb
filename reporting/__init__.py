"""What train.py's RL loop logs and reports beside the algorithm.

    metrics.py  what an RL step logs to metrics.jsonl; the run's real-world evaluations (evaluate.py)
"""
