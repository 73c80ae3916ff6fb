"""bench.py runs end to end on a tiny batch and writes its JSON (speed itself is never asserted),
and the generate-driven baseline builds well-formed interleaved episodes."""
import json
import resource

import pytest

import bench
import world
from envace import encode
from helpers import tiny_llama, toy_tokenizer

TOK = toy_tokenizer()


def test_bench_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    assert bench.main(["--size", "demo", "--tasks", "2", "--group_size", "2", "--repeats", "1",
                       "--out", str(out), "--ckpt", ""]) == 0
    result = json.loads(out.read_text())
    for key in ("sampler_rehearse", "sampler_real", "generate_rehearse", "generate_real",
                "generate_one_call", "old_logprob_forward", "train_step"):
        figure = result[key]
        assert figure["tok_per_s"] == pytest.approx(figure["tokens"] / figure["seconds"], rel=1e-9), key
        assert figure["tokens"] >= result["rows"], key      # every row writes at least its <act>
    # the update's batch is the last real-mode sample: its ids are the sampled ones plus the prompts
    tasks = world.make_splits(0, 10, 0, 200, 10)["rl"][:2]
    prompt_ids = 2 * sum(1 + len(encode(TOK, t["prompt"])) for t in tasks)
    n_tok = result["sampler_real"]["tokens"] + prompt_ids
    assert result["old_logprob_forward"]["tokens"] == result["train_step"]["tokens"] == n_tok
    # one generate call decodes the longest real-mode row's length for each of the 4 rows
    assert result["generate_one_call"]["tokens"] % 4 == 0
    assert result["generate_one_call"]["tokens"] >= result["sampler_real"]["tokens"]
    # the 4 rows (at most 96 ids) fit one micro-batch of 512: pad_frac = 1 - n_tok / (4 x longest)
    longest = n_tok / (4 * (1 - result["train_step"]["pad_frac"]))
    assert abs(longest - round(longest)) < 1e-6 and n_tok / 4 <= round(longest) <= 96
    # peak memory: at least the fp32 weights, at most this process's peak resident size (in MB)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    assert result["rows"] == 4 and result["parameters"] * 4 / 2 ** 20 <= result["peak_memory_mb"] <= peak


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
