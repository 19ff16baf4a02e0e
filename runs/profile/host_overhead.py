"""Host (Python) time per call of our forward/backward vs SDPA at a short sequence (seq 1024, d 64, bf16, B=1, one head),
plus cProfile of 200 calls each. One-off script kept with its output (host_overhead.txt); run on the H200 with OUT set."""
import cProfile, pstats, io, os, time, torch, triton
from cs336_systems.flash_triton import flash_attention
import torch.nn.functional as F
out = os.environ["OUT"]
q, k, v = (torch.randn(1, 1024, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
do = torch.randn_like(q)
o = flash_attention(q, k, v, is_causal=True); o.backward(do)  # tune + compile
torch.cuda.synchronize()
lines = []
def host_us(f, n=200):
    f(); torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): f()
    host = (time.perf_counter() - t) / n * 1e6; torch.cuda.synchronize()
    return host
o = flash_attention(q, k, v, is_causal=True)
lines.append(f"ours fwd host us/call: {host_us(lambda: flash_attention(q, k, v, is_causal=True)):.1f}")
lines.append(f"ours bwd host us/call: {host_us(lambda: o.backward(do, retain_graph=True)):.1f}")
q4, k4, v4 = (t.detach().unsqueeze(0).requires_grad_() for t in (q, k, v))
o4 = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
lines.append(f"sdpa fwd host us/call: {host_us(lambda: F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)):.1f}")
lines.append(f"sdpa bwd host us/call: {host_us(lambda: o4.backward(do.unsqueeze(0), retain_graph=True)):.1f}")
for name, f in [("fwd", lambda: flash_attention(q, k, v, is_causal=True)), ("bwd", lambda: o.backward(do, retain_graph=True))]:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200): f()
    pr.disable(); torch.cuda.synchronize()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    lines.append(f"--- cProfile {name} x200 (tottime)\n" + s.getvalue())
open(f"{out}/profile.txt", "w").write("\n".join(lines))
print("\n".join(lines[:4]))
