"""Devices and processes: one process, DDP over torchrun, or FSDP2; the memory estimate.

    torchrun --nproc_per_node=2 train.py --config small.yaml                 # DDP (gloo on CPU)
    torchrun --nproc_per_node=8 train.py --config configs/qwen3-8b.yaml      # FSDP2 (fsdp: true)

Chosen once at setup (`setup_distributed`, `parallel_model`); in one process every helper here
is the identity (all_sum returns its input, gathered does nothing), so train.py's loop has no
branch for it. Under torchrun every rank samples its slice of each step's tasks, DDP averages
the gradients, and the loss is divided by the GLOBAL count of trained tokens, so N ranks x B/N
rows make the same update as 1 rank x B rows. With `fsdp` the model is sharded instead of
replicated: sampling, the no-grad logprob passes and evaluation run on weights gathered once
per phase (`gathered`), and saves gather a full state dict to rank 0. Whether a shared prefix may
run once under the wrapping chosen here (not under FSDP; under gradient checkpointing when the
layers keep its cache) is asked here too: `can_share_prefix`, `keep_cache_when_checkpointing`.
"""
import contextlib
import ctypes
import ctypes.util
import os

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_optimizer_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers.modeling_layers import GradientCheckpointingLayer

from machinery.config import ConfigError


def pick_device(cfg):
    if cfg["device"] == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device: cuda was asked for, but torch sees no CUDA device")
    if cfg["device"] == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg["device"]


def _libc():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


LIBC = _libc()       # glibc (Linux), else None


def release_freed_memory():
    """Hand the CPU heap's free pages back to the system (glibc's malloc_trim; elsewhere nothing).
    The tensors a micro-batch's forward and backward free (activations and logits of a few MB each)
    leave holes in the heap that later tensors of other sizes do not fit, so without it the
    resident size grows by what the holes hold. Called after each backward and after each RL
    update; it changes no number. SmolLM2's warm start, 2 steps side by side on one thread each:
    peak 4,700,664 KiB against 5,137,288, 90.89 s a step against 86.47 (a fixed mmap threshold
    instead, MALLOC_MMAP_THRESHOLD_=131072: 3,537,812 KiB, but 109.08 s a step)."""
    if LIBC is not None:
        LIBC.malloc_trim(0)


def autocast(cfg, device):
    """bf16 autocast on CUDA (cfg bf16) or on the CPU (cfg cpu_bf16: faster only on a CPU with bf16
    instructions, avx512_bf16 or AMX; measure). Weights stay fp32; logprobs, softmax and the loss
    are taken in fp32 (envace.token_logprobs casts the logits before its log_softmax)."""
    if str(device).startswith("cuda") and cfg["bf16"]:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if str(device) == "cpu" and cfg["cpu_bf16"]:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def setup_distributed(cfg):
    """(rank, world_size, device). torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; NCCL on CUDA,
    gloo on CPU, picked from the device. A plain `python train.py` is rank 0 of 1."""
    device = pick_device(cfg)
    if "RANK" not in os.environ:
        return 0, 1, device
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        torch.cuda.set_device(device)
    return dist.get_rank(), dist.get_world_size(), device


def world():
    """(rank, world_size) of this process, read where a step needs it (as nanoGPT reads its ddp
    globals): torch.distributed's once torchrun's process group is up, else rank 0 of 1."""
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def all_sum(values):
    """Sum a list of numbers over ranks (identity in one process)."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return t.tolist()


def all_max(value):
    """The largest of a number over ranks (itself in one process)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def all_gather(obj):
    """A list with every rank's `obj` (a one-element list in one process)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class RankFailed(Exception):
    """On the other ranks: what rank 0 did alone (a save, an evaluation) raised; rank 0 says why
    in its one line, the others stop silently with the same exit status. `config`: it was a
    ConfigError (a user's mistake or a refused write: exit 2)."""

    def __init__(self, message, config=False):
        super().__init__(message)
        self.config = config


def from_rank0(fn):
    """Run fn() on rank 0 only (an evaluation, a save) and give its result to every rank. If fn
    raises, every rank raises, so that none waits alone at the next collective: rank 0 its own
    exception, the others KeyboardInterrupt for Ctrl-C / SIGTERM, else RankFailed."""
    if not dist.is_initialized():
        return fn()
    box = [None]
    if dist.get_rank() == 0:
        try:
            box = [("done", fn())]
        except BaseException as e:        # KeyboardInterrupt too: the others must stop with it
            failed = e
            box = [("interrupted" if isinstance(e, KeyboardInterrupt) else "failed",
                    ((str(e).strip().splitlines() or [""])[0], isinstance(e, ConfigError)))]
    try:
        dist.broadcast_object_list(box, src=0)
    except Exception:                     # another rank already ended (a signal reaches every rank): rank 0
        if dist.get_rank() == 0 and box[0][0] != "done":      # says what stopped it, not the lost connection
            raise failed from None
        raise
    outcome, value = box[0]
    if outcome == "done":
        return value
    if dist.get_rank() == 0:
        raise failed
    if outcome == "interrupted":
        raise KeyboardInterrupt
    raise RankFailed(*value)


def summed_over_ranks(sums):
    """A dict of metric sums added up over ranks (add_up of every rank's; itself in one process)."""
    return add_up(all_gather(sums)) if dist.is_initialized() else sums


def add_up(dicts):
    """Merge per-rank metric sums: numbers add, nested dicts merge, lists add elementwise."""
    out = {}
    for d in dicts:
        for k, v in d.items():
            if isinstance(v, dict):
                out[k] = add_up([out.get(k, {}), v])
            elif isinstance(v, list):
                out[k] = [a + b for a, b in zip(out.get(k, [0] * len(v)), v)]
            else:
                out[k] = out.get(k, 0) + v
    return out


ACTIVATION_BYTES = 34  # per token x layer x hidden unit kept for backward in bf16, no checkpointing


                       # (Korthikanti et al. 2022, 34sbh per layer; flash attention drops the s^2 term)
LOGIT_BYTES = 20       # per token x vocab entry in token_logprobs: bf16 logits + 4 fp32 copies
                       # (.float(), / temperature, log_softmax, exp for the entropy)
LOGIT_CHUNK = 2 ** 24  # vocabulary entries of logits per chunk (64 MiB fp32) in sharedprefix.head_logprobs,
                       # which holds one chunk's logits at a time


def dtype_bytes(cfg, device):
    """Bytes of one activation, KV-cache entry or gathered weight: 2 under bf16 autocast (cfg bf16
    on CUDA, cpu_bf16 on the CPU: `autocast`), else 4 (fp32)."""
    return 2 if cfg["bf16" if str(device).startswith("cuda") else "cpu_bf16"] else 4


def kv_cache_bytes(rows, cfg, model_config, device):
    """The KV cache of `rows` rows at max_tokens: rows x max_tokens x layers x (k, v) x KV heads x
    head dim x dtype_bytes."""
    heads, layers = model_config.num_attention_heads, model_config.num_hidden_layers
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    return rows * cfg["max_tokens"] * layers * 2 * kv_heads * head_dim * dtype_bytes(cfg, device)


def memory_estimate(n_params, cfg, model_config, world_size=1, first_target=0, device="cuda"):
    """A rough per-process memory budget in GiB on `device` (an estimate: allocator slack, CUDA
    context and temporaries are not counted). Training holds fp32 weights, fp32 gradients and
    AdamW's two fp32 moments (16 bytes per parameter; / world size under FSDP), activations of the
    largest micro-batch (micro_batch_tokens x layers x hidden x ACTIVATION_BYTES; with gradient
    checkpointing each layer keeps its input only, and one layer at a time is recomputed), and the
    logits of that micro-batch: the LM head runs only from the first trained target on
    (envace.token_logprobs(start=)), so of rows of max_tokens a share (max_tokens - first_target)
    / max_tokens of its positions; first_target 0 (not known: train.py at start) counts them all;
    and in chunks of LOGIT_CHUNK logits (sharedprefix.head_logprobs), so at most one chunk's.
    Sampling holds the KV cache of this rank's rows at max_tokens and, under FSDP, the gathered
    weights. Activations, KV cache and gathered weights take dtype_bytes (the run's autocast on
    `device`). `train` and `sample` are the two phases' totals."""
    gib = 2 ** 30
    shard = world_size if cfg["fsdp"] and world_size > 1 else 1
    half = dtype_bytes(cfg, device)                  # bytes of one activation / gathered weight
    tokens, layers, hidden = cfg["micro_batch_tokens"], model_config.num_hidden_layers, model_config.hidden_size
    embed = model_config.vocab_size * hidden * (1 if getattr(model_config, "tie_word_embeddings", False) else 2)
    per_layer = (n_params - embed) / layers
    e = {"params": 4 * n_params / shard, "grads": 4 * n_params / shard, "adam": 8 * n_params / shard,
         "reference": 4 * n_params / shard if cfg["kl_coef"] > 0 or cfg["env_mode"] == "frozen" else 0,
         "activations_full": tokens * layers * hidden * ACTIVATION_BYTES * half / 2,
         "activations_checkpointed": tokens * hidden * (layers * half + ACTIVATION_BYTES * half / 2),
         "logits": min(tokens * max(cfg["max_tokens"] - first_target, 0) / cfg["max_tokens"]
                       * model_config.vocab_size, LOGIT_CHUNK) * LOGIT_BYTES,
         # FSDP2 keeps the root (embeddings, lm_head) gathered from forward to backward, plus
         # the layer computing and the one prefetched
         "fsdp_unsharded": (embed + 2 * per_layer) * half if shard > 1 else 0,
         "kv_cache": kv_cache_bytes(cfg["tasks_per_step"] // world_size * cfg["group_size"], cfg, model_config, device),
         "gathered_weights": n_params * half if shard > 1 else 0}
    e = {k: v / gib for k, v in e.items()}
    resident = e["params"] + e["grads"] + e["adam"] + e["reference"]
    act = e["activations_checkpointed" if cfg["gradient_checkpointing"] else "activations_full"]
    e["train"] = resident + act + e["logits"] + e["fsdp_unsharded"]
    e["sample"] = resident + e["kv_cache"] + e["gathered_weights"]
    return e


def eval_memory_estimate(e, cfg, model_config, device="cuda"):
    """Evaluation's budget in GiB beside memory_estimate's `e`: rank 0 evaluates alone, sampling
    eval_batch_size tasks at once, one row of up to max_tokens each ("kv_cache"), while what
    sampling in RL keeps resident stays (weights, gradients, AdamW, the reference; under FSDP the
    gathered weights): "evaluate", the total."""
    kv = kv_cache_bytes(cfg["eval_batch_size"], cfg, model_config, device) / 2 ** 30
    return {"kv_cache": kv, "evaluate": e["sample"] - e["kv_cache"] + kv}


def memory_line(e, cfg, world_size, device="cuda", evaluation=None):
    """memory_estimate (and eval_memory_estimate, `evaluation`) as the one line printed at start."""
    ckpt = cfg["gradient_checkpointing"]
    how = f"FSDP over {world_size}" if cfg["fsdp"] and world_size > 1 else "unsharded"
    where = "per GPU" if str(device).startswith("cuda") else "per process, on the CPU"
    line = (f"memory estimate {where} ({how}, GiB, rough): weights {e['params']:.1f} + grads "
            f"{e['grads']:.1f} + AdamW {e['adam']:.1f} + reference {e['reference']:.1f} + activations "
            f"{e['activations_checkpointed' if ckpt else 'activations_full']:.1f} (gradient checkpointing "
            f"{'on' if ckpt else 'off'}; {e['activations_full' if ckpt else 'activations_checkpointed']:.1f} "
            f"{'off' if ckpt else 'on'}) + logits {e['logits']:.1f} + FSDP gathered "
            f"{e['fsdp_unsharded']:.1f} = train {e['train']:.1f}; sampling: KV cache {e['kv_cache']:.1f} "
            f"+ gathered weights {e['gathered_weights']:.1f} = {e['sample']:.1f}")
    if evaluation is None:
        return line
    return (line + f"; evaluation ({cfg['eval_batch_size']} tasks at once): KV cache {evaluation['kv_cache']:.1f} "
            f"= {evaluation['evaluate']:.1f}")


def parallel_model(model, cfg, device, world_size):
    """The module the training forwards go through: the model itself (one process), DDP, or,
    with `fsdp`, the model sharded in place by FSDP2 (`shard`). With gradient_checkpointing the
    decoder layers recompute their activations in backward, the shared-prefix caches kept
    (`keep_cache_when_checkpointing`); transformers does it only in training mode with grad
    enabled, so the no-grad KV-cached sampler runs exactly as without it."""
    if cfg["gradient_checkpointing"]:
        model.activation_checkpointing_enable()     # transformers 5.x name of gradient_checkpointing_enable
        keep_cache_when_checkpointing(model)        # the shared prefix still runs once
    if world_size == 1:
        return model
    if cfg["fsdp"]:
        return shard(model, device, world_size, isinstance(autocast(cfg, device), torch.autocast))
    return DDP(model, device_ids=[device] if device.startswith("cuda") else None)


def can_share_prefix(model):
    """Whether machinery.sharedprefix.token_logprobs may run a shared prefix once for `model`
    (unwrapped from DDP), given the wrapping and checkpointing `parallel_model` set up.
    Not under FSDP: a second forward of every sharded layer before one backward would gather its
    weights and register its gradient reduce-scatter twice, which is not tested here.
    Under gradient checkpointing with gradients, only when every checkpointed layer keeps its cache
    (`keep_cache_when_checkpointing`): transformers otherwise passes `cache=None` to a checkpointed
    layer, and the suffix would run without the prefix."""
    if isinstance(model, FSDPModule):
        return False
    if not (model.training and torch.is_grad_enabled()):
        return True
    return all(m._can_checkpoint_with_cache for m in model.modules()
               if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing)


def keep_cache_when_checkpointing(model):
    """Let the checkpointed decoder layers of a transformers model keep the cache they are passed,
    so that a shared prefix runs once under gradient checkpointing too. Safe because the only
    caches a training forward passes are the shared-prefix ones (machinery/sharedprefix.py's
    RecordingCache, ReadOnlyCache), which never change what a layer already holds: the recompute
    in backward reads the same keys and values as the forward did. (Sampling runs without
    gradients, where nothing is checkpointed.)"""
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m._can_checkpoint_with_cache = True


def shard(model, device, world_size, bf16=False):
    """FSDP2 in place: every decoder layer its own unit, then the root (embeddings, norm, lm_head).
    Weights, gradients and AdamW states are split over the ranks; each layer is gathered for its
    forward and backward. Gradients are reduce-scattered (averaged, as DDP does) after every
    backward. With bf16 (on CUDA) layers are gathered in bf16 and gradients reduced in fp32."""
    mesh = init_device_mesh("cuda" if str(device).startswith("cuda") else "cpu", (world_size,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
        MixedPrecisionPolicy()
    for layer in [m for m in model.modules() if type(m).__name__ in model._no_split_modules]:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


@contextlib.contextmanager
def gathered(model):
    """Under FSDP: all ranks gather the full weights once (a collective), and keep them until the
    block ends, so that forwards inside make no collective at all: the lock-step sampler, the
    no-grad logprob passes and rank 0's evaluation may then run a different number of forwards
    on each rank. Anything else (a plain or DDP model, None): nothing to do."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)] if model is not None else []
    for unit in units:
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()
            if unit is not model:       # FSDP2 never reshards the root after forward: leave it so
                unit.set_reshard_after_forward(True, recurse=False)


def full_state_dict(model):
    """Under FSDP the whole model's weights, gathered to rank 0 on the CPU (a collective: every
    rank calls it; the others get {}), for save_pretrained. None for an unsharded model."""
    if not isinstance(model, FSDPModule):
        return None
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def adamw(model, lr, cfg):
    """AdamW over `model`'s parameters (plain, DDP-wrapped or FSDP-sharded), fused: one kernel per
    parameter updates it in place, where torch's default (foreach) makes parameter-sized
    temporaries. A step over SmolLM2-135M's 134.5M fp32 parameters on this repo's 2-core CPU: 0.08 s
    against 0.72 s, and 2.48 GB peak resident against 3.00 GB for the step alone (docs/speed.md).
    Same update rule, same state_dict."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=cfg["weight_decay"], fused=True)


def optimizer_state(model, opt):
    """opt.state_dict(); under FSDP the full one, gathered to rank 0 and keyed by parameter name
    (a collective). Before the first step it stays opt.state_dict(): torch's gather would make up
    the missing state by taking an AdamW step with lr 0, which counts in Adam's bias correction."""
    if not isinstance(model, FSDPModule) or not opt.state:
        return opt.state_dict()
    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_optimizer_state(model, opt, saved):
    """The inverse of optimizer_state: each FSDP rank takes its shard of the full state."""
    if isinstance(model, FSDPModule) and saved["state"]:
        set_optimizer_state_dict(model, opt, saved, options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(saved)


def in_step(batches, lengths, ddp_model):
    """Yield (row index, longest length, weight) per micro-batch, the same number of times on
    every rank, as DDP needs: a rank with fewer micro-batches than another (or none) repeats
    its first one (or row 0) with weight 0, a forward/backward that adds nothing. Under DDP the
    gradient all-reduce fires on the last micro-batch only (nanoGPT's flag: no_sync() would
    split this loop in two). Under FSDP every backward reduce-scatters, the same number of times
    on every rank: set_requires_gradient_sync(False) would keep whole unsharded gradients, the
    memory that FSDP is there to save. After each micro-batch's forward and backward the CPU heap's
    freed pages go back to the system (`release_freed_memory`: it changes no number)."""
    batches = [b for b in batches if b]          # micro_batches([]) is [[]]: a rank with no kept rows
    n = len(batches) if not dist.is_initialized() else int(all_max(len(batches)))
    for j in range(n):
        if isinstance(ddp_model, DDP):
            ddp_model.require_backward_grad_sync = j == n - 1
        index = batches[j] if j < len(batches) else (batches + [[0]])[0]
        yield torch.tensor(index), max(lengths[i] for i in index), float(j < len(batches))
        release_freed_memory()


def load_device(cfg, device, world_size):
    """Where a model is loaded: the CPU under FSDP (each rank moves its own shard), else `device`."""
    return "cpu" if cfg["fsdp"] and world_size > 1 else device
