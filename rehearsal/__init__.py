"""Rehearsals measured and laid out beyond the paper's path.

    honesty.py   rehearsals against the real world: fidelity, collusion, the imagined world, the gate
    separate.py  `rehearsal_context: separate`: every rehearsal a row of its own
    toolcache.py the grounding examples of a separate rehearse prompt, from training traffic only
    memory.py    imagined episodes self-assessed into a rehearsal memory the actor reads
"""
