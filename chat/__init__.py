"""The chat format: a real model's own chat template, JSON tool calls, chat task files.

    format.py       episodes in the template (chat_format, assemble, read_act, export of the toy shop)
    templates.py    the act format derived from a chat template (derive, read_calls, is_call)
    tasks.py        chat task files checked line by line (read_chat_jsonl, check_task)
    chat_reward.py  answer, tool-call and judge rewards (chat_reward)
    executor.py     a task's own tools run for real (`env`: "MODULE:CLASS")
    multiturn.py    dialogues whose user speaks again (`turns`)
    setup.py        what a chat run sets up from the files above
    toytokenizer.py a small BPE with a Hermes-style template (scripts/speed.py and the tests)
Rehearsals in chat rows (separate rows, fidelity and collusion) are in worldmodel/, which imports
this folder, never the reverse.
"""
