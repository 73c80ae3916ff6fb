"""The task format, chosen once at setup: the functions train.py and evaluate.py call.

    features.py          the splits (build_tasks), the tiny model's words, and the format chosen (choose, setup)
    format_plain.py      the toy's tags and world (world.py, the demo)
    format_uncertain.py  the plain format in `world: uncertain` (worlds/uncertain.py)
    format_choice.py     the plain format in `world: choice` (worlds/choice.py)
    format_chat.py       a model's chat template, JSON tool calls, JSONL tasks (chat/)
"""
