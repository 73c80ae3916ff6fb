"""The policy as a world model beyond the paper's path: rehearsals measured, laid out in rows of
their own, grounded, and remembered at test time.

    honesty.py        rehearsals against the real world: fidelity, collusion, the imagined world, the gate
    chat_honesty.py   the same in the chat format's rows
    separate.py       `rehearsal_context: separate`: every rehearsal a row of its own (the sampler)
    chat_separate.py  the separate rehearse rows of the chat format, in the model's own template
    toolcache.py      the grounding examples of a separate rehearse prompt, from training traffic only
    memory.py         imagined episodes self-assessed into a rehearsal memory the actor reads
"""
