"""bench.py runs end to end on a tiny batch and writes its JSON (speed itself is never asserted),
and the generate-driven baseline builds well-formed interleaved episodes."""
import json

import bench
from helpers import tiny_llama, toy_tokenizer


def test_bench_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--size", "demo", "--tasks", "2", "--group_size", "2", "--repeats", "1",
                       "--out", str(out), "--ckpt", ""]) == 0
    result = json.loads(out.read_text())
    for key in ("sampler_rehearse", "sampler_real", "generate_rehearse", "generate_real",
                "generate_one_call", "old_logprob_forward", "train_step"):
        assert result[key]["tokens"] > 0 and result[key]["tok_per_s"] > 0, key
    assert 0 <= result["train_step"]["pad_frac"] < 1
    assert result["rows"] == 4 and result["peak_memory_mb"] > 0


def test_generate_baseline_builds_interleaved_episodes():
    tok = toy_tokenizer()
    rows = bench.generate_episodes(tiny_llama(tok), tok, ["price apple", "buy tea"], "real",
                                   bench.DEFAULTS, seed=0)
    for r, prompt in zip(rows, ["price apple", "buy tea"]):
        words = tok.convert_ids_to_tokens(r["ids"])
        assert " ".join(words[:r["prompt_len"] + 1]) == f"<bos> {prompt} <act>"
        assert len(words) > r["prompt_len"] + 1                       # the actor wrote something
        for t, w in enumerate(words):                                  # the hand-offs are in order
            if w == "<env>":
                assert words[t - 1] == "</act>"
            if w == "</env>" and t + 1 < len(words):
                assert words[t + 1] == "<act>"
