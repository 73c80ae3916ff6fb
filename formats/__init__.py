"""The task format, chosen once at setup: the functions train.py and evaluate.py call.

    features.py  the splits (build_tasks), the tiny model's words, and the format's functions
"""
