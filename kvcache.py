"""The sampler's KV cache (the speed extension of issue 16; docs/speed.md): a cache that grows in
place, and rows of a batch's cache saved and restored (separate rounds: no re-prefill).

transformers' DynamicLayer concatenates the whole cache at every decode step (a copy of every
layer's keys and values per step); at 2k-token chat prompts that copy was a third of a sampling
call in cProfile (`torch.cat` 3.8 of 11.1 s, real mode, 2 chat tasks x 4), with GrowingLayer 0.07
of 3.1 s. GrowingLayer keeps keys and values in a buffer with room to grow (doubled when full)
and writes each step into it.

save_row / restore_rows keep the cache of a separate-layout actor row paused at its call
(rollout._save_paused) for the next round of separate.sample_separate, which then feeds it only
the ids appended since (the copied response), where it was re-prefilled every round before
(test_actor_rows_keep_their_cache_across_rounds: 3 prefills instead of 7). Only for caches of
full-attention layers (else the rows are prefilled again).
"""
import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class GrowingLayer(DynamicLayer):
    """A KV cache layer whose keys and values live in a buffer with room to grow (doubled when
    full): appending a step writes into it, where transformers' DynamicLayer concatenates."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.buffers, self.length = None, 0
        n = self.length + key_states.shape[-2]
        if self.buffers is None or n > self.buffers[0].shape[-2]:
            room = max(2 * n, 64)
            grown = []
            for old, new in ((self.keys, key_states), (self.values, value_states)):
                buf = new.new_empty(*new.shape[:-2], room, new.shape[-1])   # read only up to n
                if self.length:
                    buf[..., :self.length, :] = old
                grown.append(buf)
            self.buffers = grown
        self.buffers[0][..., self.length:n, :] = key_states
        self.buffers[1][..., self.length:n, :] = value_states
        self.length = n
        self.keys, self.values = self.buffers[0][..., :n, :], self.buffers[1][..., :n, :]
        return self.keys, self.values

    def batch_select_indices(self, indices):
        if self.length:
            self.buffers = [b[indices, ...] for b in self.buffers]
            self.keys, self.values = self.buffers[0][..., :self.length, :], self.buffers[1][..., :self.length, :]


def new_cache(config):
    """A DynamicCache of GrowingLayer (the plain one where a model has other kinds of layers)."""
    cache = DynamicCache(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [GrowingLayer() for _ in cache.layers]
    return cache


def save_row(cache, mask, pos, j):
    """Batch row j of a sampler's cache as plain tensors (keys and values per layer, mask, next
    position), for restore_rows; None where the cache has layers of another kind (sliding)."""
    if not all(isinstance(layer, DynamicLayer) and not layer.is_sliding for layer in cache.layers):
        return None
    return {"kv": [(layer.keys[j:j + 1].clone(), layer.values[j:j + 1].clone()) for layer in cache.layers],
            "mask": mask[j:j + 1], "pos": pos[j:j + 1]}


def restore_rows(config, saved, device):
    """(cache, mask, positions) of rows from save_row, left-padded to the longest (pads masked)."""
    T = max(s["mask"].shape[1] for s in saved)

    def left_pad(x, dim):                         # zeros on the left of dimension `dim`
        pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [T - x.shape[dim], 0]
        return F.pad(x, pad)
    cache = new_cache(config)
    for l, layer in enumerate(cache.layers):
        layer.update(torch.cat([left_pad(s["kv"][l][0], -2) for s in saved]),
                     torch.cat([left_pad(s["kv"][l][1], -2) for s in saved]))
    return (cache, torch.cat([left_pad(s["mask"], 1) for s in saved]).to(device),
            torch.cat([s["pos"] for s in saved]).to(device))
