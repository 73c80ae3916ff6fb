"""GPU readiness, tested on the CPU: the memory estimate's arithmetic, gradient checkpointing
(same loss and gradients, sampler untouched), model_init random (architecture without weights),
FSDP2 on gloo (2 ranks make the one-rank update; a full-state save loads with from_pretrained;
gathered weights let ranks sample different numbers of steps) and every config under configs/."""
from formats import format_plain
import envace
from machinery import distributed
from machinery import config
from machinery import checkpoint
from machinery.config import ConfigError
import contextlib
import datetime
import glob
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM

import train
from machinery.checkpoint import save_checkpoint
from helpers import (assert_ratio_one, assert_same_gradients, recording, run_ranks, step_grads, tiny_cfg, tiny_llama,
                     toy_tokenizer)
from rollout import sample_episodes
from test_distributed import BUDGET, fixed_step_inputs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 2 ** 30
PROMPTS = ["price apple", "buy 2 milk and egg", "cost 3 fish", "buy tea"]
FP32 = contextlib.nullcontext()          # rl_step's autocast context on the CPU in fp32


def fixed_batch(cfg, share=slice(None)):
    """test_distributed's fixed inputs (4 groups of 3 hand-made episodes, mixed rewards; `share`: a
    rank's whole groups) as rl_step's batch."""
    tok, episodes, rewards = fixed_step_inputs()[:3]
    return tok, train.make_batch(episodes[share], rewards[share], {**cfg, "group_size": 3}, tok.pad_token_id)


def one_rank_grads():
    """The gradient of one rl_step on the whole fixed batch in one process (an SGD of lr 0 records it)."""
    cfg = {**config.DEFAULTS, "micro_batch_tokens": BUDGET, "kl_coef": 0.0}
    tok, batch = fixed_batch(cfg)
    model = tiny_llama(tok, seed=0)
    opt = recording(torch.optim.SGD)(model.parameters(), lr=0.0)
    assert train.rl_step(model, model, opt, batch, cfg, FP32)["status"] == "updated"
    return step_grads(model, opt)


# ----------------------------------------------------------------------------- memory estimate

def toy_shapes(tied=True):
    return SimpleNamespace(num_hidden_layers=2, hidden_size=8, num_attention_heads=2, num_key_value_heads=1,
                           head_dim=4, vocab_size=10, tie_word_embeddings=tied)


def test_memory_estimate_by_hand_under_fsdp():
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 100, "bf16": True, "fsdp": True, "gradient_checkpointing": True,
           "kl_coef": 0.1, "tasks_per_step": 4, "group_size": 2, "max_tokens": 50}
    e = distributed.memory_estimate(1000, cfg, toy_shapes(), world_size=2)
    by_hand = {"params": 4 * 1000 / 2, "grads": 4 * 1000 / 2, "adam": 8 * 1000 / 2, "reference": 4 * 1000 / 2,
               "activations_full": 100 * 2 * 8 * 34,               # tokens x layers x hidden x 34 bytes
               "activations_checkpointed": 100 * 8 * (2 * 2 + 34),  # 2 layer inputs in bf16 + 1 layer
               "logits": 100 * 10 * 20,
               "fsdp_unsharded": (80 + 2 * 460) * 2,                # embed 10x8 tied; (1000-80)/2 per layer
               "kv_cache": (4 // 2 * 2) * 50 * 2 * 2 * 1 * 4 * 2,   # rows x tokens x layers x k,v x kv heads x dim x 2B
               "gathered_weights": 1000 * 2}
    by_hand["train"] = 2000 + 2000 + 4000 + 2000 + 30400 + 20000 + 2000
    by_hand["sample"] = 2000 + 2000 + 4000 + 2000 + 6400 + 2000
    assert set(e) == set(by_hand)
    for k, v in by_hand.items():
        assert e[k] == pytest.approx(v / GIB, rel=1e-12), k


def test_memory_estimate_by_hand_one_gpu_without_checkpointing():
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 100, "bf16": True, "fsdp": True, "gradient_checkpointing": False,
           "kl_coef": 0.0, "env_mode": "rehearse", "tasks_per_step": 4, "group_size": 2, "max_tokens": 50}
    e = distributed.memory_estimate(1000, cfg, toy_shapes(tied=False), world_size=1)   # fsdp needs > 1 rank
    assert e["params"] * GIB == pytest.approx(4000) and e["reference"] == 0 and e["gathered_weights"] == 0
    assert e["fsdp_unsharded"] == 0 and e["kv_cache"] * GIB == pytest.approx(8 * 50 * 2 * 2 * 1 * 4 * 2)
    assert e["train"] * GIB == pytest.approx(4000 + 4000 + 8000 + 54400 + 20000)
    line = distributed.memory_line(e, cfg, 1)
    assert "unsharded" in line and f"train {e['train']:.1f}" in line


def test_memory_estimate_counts_the_logits_from_the_first_trained_target_only():
    """The update's LM head runs from the first trained target on: rows of max_tokens 50 whose first
    30 targets are prompt keep 20 of 50 positions, so a 100-token micro-batch has 40 positions of
    logits over the vocabulary of 10, at 20 bytes each; the rest of the budget is unchanged."""
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 100, "bf16": True, "fsdp": False, "gradient_checkpointing": True,
           "kl_coef": 0.0, "env_mode": "rehearse", "tasks_per_step": 4, "group_size": 2, "max_tokens": 50}
    whole = distributed.memory_estimate(1000, cfg, toy_shapes(), world_size=1)
    tail = distributed.memory_estimate(1000, cfg, toy_shapes(), world_size=1, first_target=30)
    assert whole["logits"] * GIB == pytest.approx(100 * 10 * 20)
    assert tail["logits"] * GIB == pytest.approx(40 * 10 * 20)            # 8000 bytes
    assert (whole["train"] - tail["train"]) * GIB == pytest.approx(60 * 10 * 20)
    assert tail["sample"] == whole["sample"]
    assert distributed.memory_estimate(1000, cfg, toy_shapes(), first_target=50)["logits"] == 0


def test_memory_estimate_counts_one_chunk_of_logits_at_most():
    """The LM head runs in chunks of LOGIT_CHUNK (2^24) logits: SmolLM2's micro-batch of 4096 tokens
    over its vocabulary of 49,152 (2.0e8 logits) counts one chunk, 2^24 x 20 bytes = 320 MiB, where
    a micro-batch of 100 tokens over 10 entries (1000 logits) counts them all."""
    cfg = {**config.DEFAULTS, "micro_batch_tokens": 4096, "bf16": False, "fsdp": False, "max_tokens": 768}
    smollm2 = SimpleNamespace(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                              head_dim=64, vocab_size=49152, tie_word_embeddings=True)
    assert distributed.LOGIT_CHUNK == 2 ** 24
    assert distributed.memory_estimate(134_515_008, cfg, smollm2)["logits"] * GIB == pytest.approx(2 ** 24 * 20)
    small = {**cfg, "micro_batch_tokens": 100, "max_tokens": 50}
    assert distributed.memory_estimate(1000, small, toy_shapes())["logits"] * GIB == pytest.approx(100 * 10 * 20)


def test_memory_estimate_of_qwen3_8b_under_fsdp_8():
    shapes = SimpleNamespace(num_hidden_layers=36, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                             head_dim=128, vocab_size=151936, tie_word_embeddings=False)
    cfg = config.load_config(os.path.join(ROOT, "configs", "qwen3-8b.yaml"))
    e = distributed.memory_estimate(8_190_735_360, cfg, shapes, world_size=8)
    assert e["params"] + e["grads"] + e["adam"] == pytest.approx(16 * 8_190_735_360 / 8 / GIB)   # 15.26 GiB


# ----------------------------------------------------------------------------- gradient checkpointing

def test_gradient_checkpointing_gives_the_same_loss_and_gradients():
    cfg = {**config.DEFAULTS, "micro_batch_tokens": BUDGET, "kl_coef": 0.0}
    tok, batch = fixed_batch(cfg)
    assert not batch["sampled_logprobs"].any()          # hand-made episodes: old logprobs 0
    results = []
    for checkpointing in (False, True):
        model = tiny_llama(tok, seed=0)
        distributed.parallel_model(model, {**cfg, "gradient_checkpointing": checkpointing}, "cpu", 1)
        calls = []
        for layer in model.model.layers:
            if checkpointing:
                inner = layer._gradient_checkpointing_func
                layer._gradient_checkpointing_func = lambda *a, f=inner, **k: calls.append(1) or f(*a, **k)
        model.train()
        with torch.no_grad():       # the KV-cached sampler in train mode: no_grad turns checkpointing off
            eps = sample_episodes(model, tok, PROMPTS, settings={"max_tokens": 40},
                                  generator=torch.Generator().manual_seed(3))
        assert not calls
        opt = recording(torch.optim.SGD)(model.parameters(), lr=0.0)     # the step's gradient, weights kept
        stats = train.rl_step(model, model, opt, batch, cfg, FP32)
        assert stats["status"] == "updated" and stats["rows_updated"] == 12
        results.append((stats["loss"], step_grads(model, opt), eps, len(calls)))
    (loss0, grads0, eps0, _), (loss1, grads1, eps1, n_calls) = results
    assert n_calls == 2 * len(envace.micro_batches(batch["lengths"], BUDGET))     # 2 layers per forward
    # checkpointing reruns each layer's forward for the backward: the same operations on the same
    # inputs, so the loss is the same float (1e-6: room for a kernel that reorders on a rerun) and
    # the gradients agree to helpers.GRAD_TOLERANCE
    assert loss1 == pytest.approx(loss0, rel=1e-6) and loss0 != 0
    assert_same_gradients(grads0, grads1)
    # the sampler under no_grad never checkpoints: the very same forwards, so the same tokens
    assert [e["ids"] for e in eps0] == [e["ids"] for e in eps1]


def test_a_rank_with_no_rows_to_train_runs_weight_zero_passes(monkeypatch):
    # all its groups had equal rewards (rows left out) while another rank has 2 micro-batches:
    # it must still run 2 forward/backward passes (row 0, weight 0), not crash on an empty batch;
    # in one process (no process group) there is no other rank: no pass at all
    empty = envace.micro_batches([], 50)
    assert list(distributed.in_step(empty, [10, 12], None)) == []
    monkeypatch.setattr(distributed.dist, "is_initialized", lambda: True)     # a rank of a process group
    monkeypatch.setattr(distributed, "all_max", lambda n: max(n, 2))          # whose other rank has 2
    steps = [(index.tolist(), n, w) for index, n, w in distributed.in_step(empty, [10, 12], None)]
    assert steps == [([0], 10, 0.0), ([0], 10, 0.0)]


# ----------------------------------------------------------------------------- model_init

def saved_tiny_qwen2(path):
    tok = toy_tokenizer()
    config = Qwen2Config(vocab_size=len(tok), hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return config


def test_model_init_random_builds_the_architecture_without_weights(tmp_path):
    config = saved_tiny_qwen2(tmp_path)
    for f in glob.glob(str(tmp_path / "*.safetensors")):
        os.remove(f)                                          # the weights are gone: only the config is left
    with pytest.raises(ConfigError, match="cannot load the checkpoint"):
        checkpoint.load_policy(str(tmp_path))
    model, tok = checkpoint.load_policy(str(tmp_path), "cpu", "random")
    assert type(model) is Qwen2ForCausalLM and len(model.model.layers) == 3
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (2 * 12, 48)   # 2 kv heads x head dim 12
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for p in Qwen2ForCausalLM(config).parameters())
    assert model.model.embed_tokens.weight.std() > 0.01


def test_run_with_random_init_and_checkpointing_prints_the_memory_line(tmp_path, capsys, monkeypatch):
    saved_tiny_qwen2(tmp_path / "qwen")
    monkeypatch.setattr(format_plain, "task_reward", lambda e, t: float(len(e["ids"]) % 2))
    cfg = tiny_cfg(tmp_path, model=str(tmp_path / "qwen"), model_init="random", gradient_checkpointing=True,
                   rl_steps=1, sft_steps=2, n_test=4)
    assert train.run(cfg) == 0
    out = capsys.readouterr().out
    assert "memory estimate per process, on the CPU (unsharded" in out and "gradient checkpointing on" in out
    assert "; evaluation (512 tasks at once): KV cache " in out      # eval_batch_size 512 (DEFAULTS): one line
    saved = AutoModelForCausalLM.from_pretrained(os.path.join(cfg["out_dir"], "ckpt"))
    assert type(saved) is Qwen2ForCausalLM and saved.config.hidden_size == 48


# ----------------------------------------------------------------------------- FSDP on gloo

def _fsdp_worker(rank, world_size, init_file, out_dir):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=60))      # a collective out of step fails
    torch.set_num_threads(1)
    cfg = {**config.DEFAULTS, "micro_batch_tokens": BUDGET, "kl_coef": 0.0, "fsdp": True}
    tok, batch = fixed_batch(cfg, slice(rank * 6, (rank + 1) * 6))      # whole groups per rank
    model = tiny_llama(tok, seed=0)
    distributed.parallel_model(model, cfg, "cpu", world_size)
    assert isinstance(model.model.layers[0], distributed.FSDPModule) and isinstance(model, distributed.FSDPModule)
    opt = recording(torch.optim.AdamW)(model.parameters(), lr=1e-3)
    stats = train.rl_step(model, model, opt, batch, cfg, FP32)      # (the world size from the process group)
    assert stats["status"] == "updated"
    grads = step_grads(model, opt)
    with distributed.gathered(model):           # the ranks sample different numbers of steps: no collectives
        eps = sample_episodes(model, tok, PROMPTS if rank == 0 else PROMPTS[:1],
                              settings={"max_tokens": 40 if rank == 0 else 12},
                              generator=torch.Generator().manual_seed(3))
    weights, optimizer = distributed.full_state_dict(model), distributed.optimizer_state(model, opt)
    box = [optimizer]
    dist.broadcast_object_list(box, src=0)             # resume: every rank reads the full state
    model.zero_grad(set_to_none=True)                   # as after a restart
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = [p.to_local().clone() for p in model.parameters()]
    distributed.load_optimizer_state(model, fresh, box[0])
    assert all(torch.equal(a, p.to_local()) for a, p in zip(before, model.parameters()))
    for p in model.parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh.state[p][k].to_local(), opt.state[p][k].to_local())
    if rank == 0:
        save_checkpoint(model, tok, os.path.join(out_dir, "ckpt"), state_dict=weights)
        torch.save((grads, [e["ids"] for e in eps], optimizer), os.path.join(out_dir, "rank0.pt"))
    # the whole of train.run on this process group (as under torchrun): warm start, the frozen
    # reference sharded too, KL, checkpoints; then a resume that takes the optimizer back
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    format_plain.task_reward = lambda e, t: float(len(e["ids"]) % 2)    # every group has variance
    cfg = tiny_cfg(Path(out_dir), fsdp=True, gradient_checkpointing=True, env_mode="frozen", kl_coef=0.1,
                   rl_steps=2, save_every=1, n_test=4)
    assert train.run(cfg) == 0
    assert train.run({**cfg, "rl_steps": 3}, resume=True) == 0
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_two_ranks_make_the_one_rank_update_and_save_a_normal_folder(tmp_path):
    torch.set_num_threads(1)
    # forked: the ranks start with the modules already imported (spawn would import torch anew)
    run_ranks(_fsdp_worker, (2, str(tmp_path / "init"), str(tmp_path)), tmp_path, timeout=180)
    fsdp_grads, fsdp_ids, fsdp_opt = torch.load(tmp_path / "rank0.pt", weights_only=False)
    one_grads = one_rank_grads()
    assert_same_gradients(one_grads, fsdp_grads)        # the first step's gradient (helpers.GRAD_TOLERANCE)
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert saved.config.architectures == ["LlamaForCausalLM"]
    loaded = dict(saved.named_parameters())
    assert set(loaded) == set(one_grads) and set(fsdp_opt["state"]) == set(one_grads)   # keyed by name
    # AdamW's first step: exp_avg = (1 - beta1) g, the gradient compared above; the saved weights are
    # the start's after one step from the run's own state, w (1 - lr wd) - lr m^ / (sqrt(v^) + eps),
    # m^ = m / 0.1, v^ = v / 0.001 (float32 rounding of |w| <= 1 and of a step <= lr: 2e-7)
    assert_same_gradients(one_grads, {n: s["exp_avg"] / 0.1 for n, s in fsdp_opt["state"].items()})
    start = dict(tiny_llama(toy_tokenizer(), seed=0).named_parameters())
    lr, wd = 1e-3, config.DEFAULTS["weight_decay"]
    for name, s in fsdp_opt["state"].items():
        want = start[name].detach() * (1 - lr * wd) - lr * (s["exp_avg"] / 0.1) / ((s["exp_avg_sq"] / 1e-3).sqrt() + 1e-8)
        assert (loaded[name] - want).abs().max().item() < 2e-7, name
    assert max((loaded[k] - start[k]).abs().max().item() for k in loaded) > lr / 2     # (sign steps: ~lr)
    # rank 0 sampled alone with the gathered weights: what the saved weights sample, with one thread
    # like the rank (the same float operations: the same logits bit for bit, so the same draws)
    eps = sample_episodes(saved.eval(), toy_tokenizer(), PROMPTS, settings={"max_tokens": 40},
                          generator=torch.Generator().manual_seed(3))
    assert [e["ids"] for e in eps] == fsdp_ids
    lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(line["step"], line["status"]) for line in lines] == [(1, "updated"), (2, "updated"), (3, "updated")]
    assert len(assert_ratio_one(lines, kl_coef=0.1)) == 3       # one epoch at ratio 1, every step
    for line in lines:
        # frozen mode: the ACT tokens are the trained ones; the reference is the warm start: the
        # policy itself at step 1 (KL 0), away from it after an update (the resumed step too)
        assert line["tokens_act"] > 0 and line["tokens_rehearse"] == 0
        assert (line["kl_ref"] < 1e-9) == (line["step"] == 1) and line["kl_ref"] == pytest.approx(line["kl_ref_act"], rel=1e-4, abs=1e-12)
    state = torch.load(tmp_path / "run" / "ckpt" / "trainer_state.pt", weights_only=False)
    steps = {float(s["step"]) for s in state["optimizer"]["state"].values()}
    assert steps == {3.0} and set(state["optimizer"]["state"]) == set(one_grads)   # 2 steps resumed + 1
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "ckpt")
    warm = AutoModelForCausalLM.from_pretrained(tmp_path / "run" / "warmstart")
    # 3 AdamW steps of lr 1e-3 (tiny_cfg): an element moves by lr at the first (|m^ / sqrt(v^)| = 1), by
    # at most ~1.004 lr at the next two (the optimizer state resumed), plus weight decay (lr x 0.01 x |w|)
    diff = max((a - b).abs().max().item() for a, b in zip(final.parameters(), warm.parameters()))
    assert 1e-3 / 2 < diff <= 3 * 1e-3 * 1.03


# ----------------------------------------------------------------------------- configs

def test_qwen3_configs_have_the_paper_settings():
    # (every YAML under configs/ loads: tests/test_config.py::test_every_shipped_config_loads)
    for name, fsdp in (("qwen3-1.7b", False), ("qwen3-8b", True)):
        cfg = config.load_config(os.path.join(ROOT, "configs", f"{name}.yaml"))
        assert cfg["model"] == {"qwen3-1.7b": "Qwen/Qwen3-1.7B", "qwen3-8b": "Qwen/Qwen3-8B"}[name]
        assert (cfg["lr"], cfg["eps_low"], cfg["eps_high"], cfg["dual_clip"], cfg["kl_coef"]) == (1e-6, 0.2, 0.2, 3.0, 1e-4)
        assert (cfg["tasks_per_step"], cfg["group_size"], cfg["weight_decay"], cfg["grad_clip"]) == (16, 4, 0.01, 1.0)
        assert cfg["bf16"] and cfg["gradient_checkpointing"] and cfg["fsdp"] == fsdp
