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
    """A fake causal LM for the sampler: for the row whose task prompt is P it puts all
    probability on scripts[P][k] at the k-th generated position (k = 0 right after the prefix),
    whatever it is fed. Scripts are whitespace-separated tokens and include the forced tags,
    which the sampler must insert itself (the script's choice there is ignored). Which prompt a
    batch row holds is written into the real KV cache, so it follows the sampler's prefix
    sharing and its dropping of finished rows exactly as real keys and values would."""

    def __init__(self, tokenizer, scripts):
        super().__init__()
        self.config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=8, num_hidden_layers=1,
                                  num_attention_heads=1, num_key_value_heads=1)
        self.anchor = torch.nn.Parameter(torch.zeros(1))   # gives the sampler a device
        self.tokenizer = tokenizer
        self.prompts = list(scripts)
        self.scripts = [tokenizer.convert_tokens_to_ids(s.split()) for s in scripts.values()]
        self.vocab = len(tokenizer)

    def _prompt_index(self, ids):
        words = self.tokenizer.convert_ids_to_tokens(ids)
        words = [w for w in words if w not in ("<pad>", "<bos>")]
        end = words.index("<act>") if "<act>" in words else len(words)
        return self.prompts.index(" ".join(words[:end]))

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=None):
        B, T = input_ids.shape
        if cache is None:                           # a teacher-forced pass: it knows no script there
            return SimpleNamespace(logits=torch.zeros(B, T, self.vocab))
        if T > 1:                                   # prefill: identify each row, start counting
            self.k = 0
            who = torch.tensor([float(self._prompt_index(row.tolist())) for row in input_ids])
            who = who[:, None, None, None].expand(B, 1, T, 1)
        else:
            self.k += 1
            who = cache.layers[0].keys[:, :, -1:, :]  # the row identities, as the cache holds them
        cache.update(who.contiguous(), who.contiguous(), 0)
        logits = torch.full((B, T, self.vocab), -1e4)
        for b, i in enumerate(cache.layers[0].keys[:, 0, -1, 0].long().tolist()):
            script = self.scripts[i]
            logits[b, -1, script[min(self.k, len(script) - 1)]] = 0.0
        return SimpleNamespace(logits=logits)


def tiny_cfg(tmp_path, **kw):
    return {**DEFAULTS, "out_dir": str(tmp_path / "run"), "n_layer": 2, "n_embd": 32,
            "n_head": 2, "n_logged": 40, "n_new_logged": 2, "n_rl_tasks": 40, "n_test": 16,
            "snippet_repeats": 1, "sft_steps": 5, "sft_batch_size": 8, "rl_steps": 3,
            "tasks_per_step": 4, "group_size": 4, "micro_batch_tokens": 200, "max_tokens": 48,
            "min_fidelity": 0.0, "lr": 1e-3, **kw}
