import sys, time, torch, collections
sys.path.insert(0, "."); sys.path.insert(0, "tests")
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 2)
import world
from machinery.checkpoint import load_policy
from machinery.config import DEFAULTS
from rollout import sample_episodes
from rehearsal.separate import sample_separate
model, tok = load_policy("/tmp/speed2_ckpt", "cpu"); model.eval()
tasks = world.make_splits(0, 10, 0, 200, 10)["rl"][:16]
prompts = [t["prompt"] for t in tasks for _ in range(8)]
kw = {k: DEFAULTS[k] for k in ("temperature", "top_p", "max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
acc = collections.defaultdict(float); t0 = [0]
def pre(m, a, k):
    t0[0] = time.perf_counter(); t0.append(k["cache"].get_seq_length() == 0); t0.append(k["input_ids"].numel())
def post(m, a, k, o):
    kind = "prefill" if t0[1] else "decode"
    acc[kind] += time.perf_counter() - t0[0]; acc[kind + "_tok"] += t0[2]; acc[kind + "_n"] += 1; del t0[1:]
model.register_forward_pre_hook(pre, with_kwargs=True); model.register_forward_hook(post, with_kwargs=True)
fns = {"inline": lambda g: sample_episodes(model, tok, prompts, "rehearse", generator=g, **kw),
       "separate": lambda g: sample_separate(model, tok, prompts, "rehearse", generator=g, **kw)}
res = collections.defaultdict(list)
for name in fns: fns[name](torch.Generator().manual_seed(0))
for rep in range(3):
    for name, fn in fns.items():
        acc.clear()
        t = time.perf_counter(); fn(torch.Generator().manual_seed(rep)); dt = time.perf_counter() - t
        res[name].append(dt)
        print(name, f"{dt*1e3:.0f} ms", {k: round(v * 1e3) if not k.endswith(("_tok", "_n")) else int(v) for k, v in acc.items()}, flush=True)
import statistics
print({k: round(statistics.median(v) * 1e3) for k, v in res.items()}, "ratio", statistics.median(res["separate"]) / statistics.median(res["inline"]))
