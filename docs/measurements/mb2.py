import sys, time, torch
sys.path.insert(0, ".")
torch.set_num_threads(1)
from machinery.checkpoint import load_policy
from machinery.kvcache import Decoder
model, tok = load_policy("/tmp/speed2_ckpt", "cpu"); model.eval()
V = model.config.vocab_size
for B, P, W in ((1, 10, 1), (128, 10, 1), (128, 30, 1), (128, 30, 4), (16, 30, 1), (16, 1, 30), (32, 1, 30), (128, 1, 30)):
    ts = []
    for rep in range(5):
        d = Decoder(model, [list(range(5, 5 + P)) for _ in range(B)], 1)
        t = time.perf_counter()
        with torch.no_grad():
            d.step([[7] * W for _ in range(B)])
        ts.append(time.perf_counter() - t)
    print(B, P, W, f"{sorted(ts)[2]*1e3:.1f} ms")
