"""BFCL-v4 multi-turn offline, from the repo root (the code is benchmarks/bfcl.py):

    python bfcl.py --out data/bfcl       # chat task files: multi_turn_base.jsonl (200 tasks), ...

Task files written before the converter moved name `"env": "bfcl:BFCLEnv"` and `"check":
"bfcl:check"`: this module still answers to those names."""
import sys

from benchmarks.bfcl import BFCLEnv, check, main  # noqa: F401  (the names old task files use)

if __name__ == "__main__":
    sys.exit(main())
