"""What runs around the algorithm: configs, checkpoints, faults, parallelism, the KV cache, logs.

    config.py        DEFAULTS, load_config, one-line config errors
    checkpoint.py    build_policy, save_checkpoint, find_checkpoint, resume
    faults.py        one line and an exit status per fault, Ctrl-C/SIGTERM, non-finite checks
    distributed.py   DDP, FSDP2, all_sum, gathered, memory_estimate
    kvcache.py       the sampler's batch decoder and its growing KV cache (rollout.py uses it)
    sharedprefix.py  the update's logprobs in less memory: a shared prefix once, the LM head in chunks
    metrics.py       what an RL step logs to metrics.jsonl; the run's real-world evaluations
    taskfiles.py     JSONL task files read and checked; the toy splits exported
    evaluate_cli.py  the command line of `python evaluate.py`
"""
