"""Time the sampler of the checkout it runs in, on the demo's checkpoint: run from two worktrees
in turn (before / after a change) to A/B it directly, without bench.py's generate baselines.

    cd /tmp/wt-before && OMP_NUM_THREADS=1 python /work/main/docs/measurements/ab_sampler.py inline 10
    cd /tmp/wt-after  && OMP_NUM_THREADS=1 python /work/main/docs/measurements/ab_sampler.py separate 20
16 toy tasks x 8 rows, rehearse mode, seed i for call i; the first two calls are not timed. Prints
the median, min and max of the timed calls and the last call's tokens (the same code gives the
same episodes, so equal tokens before and after say the change kept the draws)."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import rollout, world
from rehearsal import separate
from transformers import AutoModelForCausalLM, AutoTokenizer
layout, calls = sys.argv[1], int(sys.argv[2])
torch.set_num_threads(1)
tok = AutoTokenizer.from_pretrained("/tmp/speed2_ckpt")
model = AutoModelForCausalLM.from_pretrained("/tmp/speed2_ckpt").eval()
prompts = [t["prompt"] for t in world.make_splits(0, 10, 0, 16, 4)["rl"][:16] for _ in range(8)]
sample = separate.sample_separate if layout == "separate" else rollout.sample_episodes
times = []
for i in range(calls + 2):
    t = time.perf_counter()
    episodes = sample(model, tok, prompts, "rehearse", generator=torch.Generator().manual_seed(i))
    times.append(time.perf_counter() - t)
times = sorted(times[2:])
print(f"{os.getcwd()} {layout}: median {times[len(times) // 2]:.3f} s, min {times[0]:.3f}, max {times[-1]:.3f}, "
      f"tokens {sum(len(e['ids']) for e in episodes)}")
