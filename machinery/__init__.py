"""What runs around the algorithm: configs, checkpoints, faults, parallelism, the KV cache, task files.

The bottom layer: these modules import the paper's envace.py and world.py and each other, never
a folder above them (tests/test_layers.py).

    config.py        DEFAULTS, load_config, one-line config errors
    checkpoint.py    build_policy, save_checkpoint, find_checkpoint, resume
    faults.py        one line and an exit status per fault, Ctrl-C/SIGTERM, non-finite checks
    distributed.py   DDP, FSDP2, all_sum, gathered, memory_estimate
    kvcache.py       the sampler's batch decoders: the demo's plain one, one with long prompts' speed tricks
    sharedprefix.py  the update's logprobs in less memory: a shared prefix once, the LM head in chunks
    savefiles.py     folders and files written whole (renames) and checked whole when read
    realmodel.py     a GGUF file turned into a Hugging Face folder once (`python -m machinery.realmodel`)
    taskfiles.py     JSONL task files read and checked; the toy splits exported
"""
