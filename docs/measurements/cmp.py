"""process-time of sample_separate vs sample_episodes (rehearse) on bench's workloads, 1 thread."""
import sys, time, torch, statistics, argparse
sys.path.insert(0, "."); sys.path.insert(0, "tests")
torch.set_num_threads(1)
import bench
from rollout import sample_episodes
from rehearsal.separate import sample_separate
which = sys.argv[1]; tasks = int(sys.argv[2]); reps = int(sys.argv[3])
args = argparse.Namespace(ckpt="/tmp/speed2_ckpt", device="cpu", tasks=tasks, group_size=None, size="tiny", pad_tools=6, max_new=320)
model, tok, w, cfg, name = (bench.toy_workload if which == "toy" else bench.chat_workload)(args)
run = dict(world=w["worlds"], tags=w["tags"], plans=w["plans"], **{k: cfg[k] for k in ("temperature", "top_p", "max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")})
fns = {"inline": lambda g: sample_episodes(model, tok, w["prompts"], "rehearse", generator=g, **run),
       "separate": lambda g: sample_separate(model, tok, w["prompts"], "rehearse", generator=g, **run)}
res = {k: [] for k in fns}
for k in fns: fns[k](torch.Generator().manual_seed(0))
for rep in range(reps):
    for k, fn in fns.items():
        t = time.process_time(); fn(torch.Generator().manual_seed(rep)); res[k].append(time.process_time() - t)
med = {k: statistics.median(v) for k, v in res.items()}
print(which, {k: f"{v*1e3:.0f} ms (cpu, {min(res[k])*1e3:.0f}-{max(res[k])*1e3:.0f})" for k, v in med.items()}, f"separate/inline {med['separate']/med['inline']:.2f}x", flush=True)
