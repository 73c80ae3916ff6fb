"""Forwards and fed tokens (incl. holes) per toy call: our sampler vs bench's generate baselines."""
import sys, time, torch, collections, argparse
sys.path.insert(0, "."); sys.path.insert(0, "tests")
torch.set_num_threads(1)
import bench
from rollout import sample_episodes
args = argparse.Namespace(ckpt="/tmp/speed2_ckpt", device="cpu", tasks=16, group_size=None, size="tiny", pad_tools=6, max_new=320)
model, tok, w, cfg, name = bench.toy_workload(args)
stat = collections.Counter()
def pre(m, a, k):
    ids = k["input_ids"]; stat["forwards"] += 1; stat["tokens"] += ids.numel()
    c = k.get("past_key_values", k.get("cache")); T = c.get_seq_length() if c is not None else 0
    stat["attended"] += ids.shape[0] * ids.shape[1] * (T + ids.shape[1])
model.register_forward_pre_hook(pre, with_kwargs=True)
run = dict(world=w["worlds"], tags=w["tags"], plans=w["plans"], **{k: cfg[k] for k in ("temperature", "top_p", "max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")})
for mode in ("rehearse", "real"):
    for who, fn in (("sampler", lambda: sample_episodes(model, tok, w["prompts"], mode, generator=torch.Generator().manual_seed(0), **run)),
                    ("generate", lambda: bench.generate_episodes(model, tok, w["prompts"], mode, cfg, 0, w["worlds"], w["tags"], w["plans"]))):
        stat.clear(); t = time.process_time(); eps = fn(); dt = time.process_time() - t
        print(mode, who, dict(stat), f"new tokens {bench.new_tokens(eps)}", f"cpu {dt*1e3:.0f} ms", flush=True)
eps = sample_episodes(model, tok, w["prompts"], "rehearse", generator=torch.Generator().manual_seed(0), **run)
steps = max(len(e["ids"]) - e["prompt_len"] for e in eps)
stat.clear(); t = time.process_time(); bench.one_call(model, [e["ids"][:e["prompt_len"]] for e in eps], steps, 1); dt = time.process_time() - t
print("one generate call", dict(stat), f"steps {steps}", f"cpu {dt*1e3:.0f} ms")
