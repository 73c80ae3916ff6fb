"""Shared test fixtures: the toy tokenizer, a tiny random Llama, and a scripted fake model."""
from types import SimpleNamespace

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import world
from envace import build_tokenizer
from train import DEFAULTS


def toy_tokenizer():
    return build_tokenizer(world.WORDS)


def tiny_llama(tokenizer, seed=0, layers=2, width=32):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=256, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


class ScriptedModel(torch.nn.Module):
    """A fake causal LM for the sampler: for row i it puts all probability on scripts[i][k] at
    the k-th generated position (k = 0 right after the prompt), whatever it is fed. Scripts are
    whitespace-separated token strings and include the forced tags, which the sampler must
    insert itself (the script's choice there is ignored)."""

    def __init__(self, tokenizer, scripts):
        super().__init__()
        self.config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))   # gives the sampler a device
        self.scripts = [tokenizer.convert_tokens_to_ids(s.split()) for s in scripts]
        self.vocab = len(tokenizer)
        self.k = -1

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        self.k = 0 if input_ids.shape[1] > 1 or self.k < 0 else self.k + 1
        logits = torch.full((input_ids.shape[0], input_ids.shape[1], self.vocab), -1e4)
        for i, script in enumerate(self.scripts):
            logits[i, -1, script[min(self.k, len(script) - 1)]] = 0.0
        return SimpleNamespace(logits=logits)


def tiny_cfg(tmp_path, **kw):
    return {**DEFAULTS, "out_dir": str(tmp_path / "run"), "n_layer": 2, "n_embd": 32,
            "n_head": 2, "n_logged": 40, "n_new_logged": 2, "n_rl_tasks": 40, "n_test": 16,
            "snippet_repeats": 1, "sft_steps": 5, "sft_batch_size": 8, "rl_steps": 3,
            "tasks_per_step": 4, "group_size": 4, "micro_batch_size": 6, "max_tokens": 48,
            "min_fidelity": 0.0, "lr": 1e-3, **kw}
