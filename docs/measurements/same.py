import sys, hashlib, json, torch
sys.path.insert(0, "."); sys.path.insert(0, "tests")
torch.set_num_threads(1)
import world
from machinery.checkpoint import load_policy
from machinery.config import DEFAULTS
from rollout import sample_episodes
from rehearsal.separate import sample_separate
model, tok = load_policy("/tmp/speed2_ckpt", "cpu"); model.eval()
tasks = world.make_splits(0, 10, 0, 200, 10)["rl"][:16]
prompts = [t["prompt"] for t in tasks for _ in range(8)]
kw = {k: DEFAULTS[k] for k in ("temperature", "top_p", "max_turns", "max_act_tokens", "max_env_tokens", "max_tokens")}
out = {}
for mode in ("rehearse", "real"):
    eps = sample_episodes(model, tok, prompts, mode, generator=torch.Generator().manual_seed(7), **kw)
    out[mode] = hashlib.md5(json.dumps([(e["ids"], [round(x, 5) for x in e["logprobs"]], e["cause"]) for e in eps]).encode()).hexdigest()
eps = sample_separate(model, tok, prompts, generator=torch.Generator().manual_seed(7), **kw)
out["separate"] = hashlib.md5(json.dumps([(e["ids"], [round(x, 5) for x in e["logprobs"]], [r["ids"] for r in e["rehearsals"]]) for e in eps]).encode()).hexdigest()
print(out)
