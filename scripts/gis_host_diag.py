"""Where group_index_select's forward time goes, on the benchmark's default case (32 x 4096 x 512 fp32,
4096 sorted indices from 1024 rows per member): the event time as benchmarks/group_index_select.py
measures it, with and without the Python autograd layer (inference mode), the host time of one call on an
idle GPU, and the kernel's own time from the profiler. Diagnostic, prints only; needs a GPU:

    python scripts/gis_host_diag.py
"""
import statistics, sys, time
import torch, hipdlrm  # noqa: F401
sys.path.insert(0, "benchmarks")
from common import time_fn

dev = torch.device("cuda")
g = torch.Generator(device="cpu").manual_seed(0)
M, R, C, N, U = 32, 4096, 512, 4096, 1024
inputs = [torch.randn(R, C, device=dev) for _ in range(M)]
idx = []
for _ in range(M):
    u = torch.randperm(R, generator=g)[:U]
    idx.append(torch.sort(u[torch.randint(0, U, (N,), generator=g)])[0].to(dev))
op = torch.ops.hipdlrm.group_index_select_dim0
fns = {
    "op": lambda: op(inputs, idx),
    "torch loop": lambda: [torch.index_select(x, 0, i) for x, i in zip(inputs, idx)],
}
for name in fns:
    t = time_fn(fns[name], device=dev, iters=50)
    print(f"{name:24s} event median {t['median_ms']*1e3:7.1f} us  min {t['min_ms']*1e3:7.1f}  max {t['max_ms']*1e3:7.1f}")
with torch.inference_mode():
    t = time_fn(lambda: op(inputs, idx), device=dev, iters=50)
    print(f"{'op inference_mode':24s} event median {t['median_ms']*1e3:7.1f} us  min {t['min_ms']*1e3:7.1f}  max {t['max_ms']*1e3:7.1f}")
# host time of one call with the GPU idle, and its parts
for mode in ["grad", "inference"]:
    ctx = torch.inference_mode() if mode == "inference" else torch.enable_grad()
    with ctx:
        ts = []
        for _ in range(30):
            torch.cuda.synchronize()
            t0 = time.perf_counter(); op(inputs, idx); ts.append((time.perf_counter() - t0) * 1e6)
        print(f"host us per call, GPU idle before ({mode}): median {statistics.median(ts):.1f} min {min(ts):.1f}")
# kernel time from the profiler
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(20):
        op(inputs, idx)
    torch.cuda.synchronize()
for e in prof.key_averages():
    if e.device_type.name == "CUDA" or "kernel" in e.key:
        n = max(e.count, 1)
        print(f"kernel {e.key[:60]:60s} count {e.count} avg {getattr(e, 'device_time_total', getattr(e, 'cuda_time_total', 0))/n:.1f} us")

# The host path of one call, op by op (CPU and runtime-API time), with the GPU idle before each call.
if "--profile" in sys.argv:
    from torch.profiler import record_function
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            torch.cuda.synchronize()
            with record_function("one call"):
                op(inputs, idx)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
    # Pieces the op does 32 times, timed alone from Python.
    def host(fn, n=200):
        for _ in range(20): fn()
        t0 = time.perf_counter()
        for _ in range(n): fn()
        return (time.perf_counter() - t0) / n * 1e6
    print(f"32 x torch.empty: {host(lambda: [torch.empty(4096, 512, device=dev) for _ in range(32)]):.1f} us")
    print(f"1 x torch.empty (all 32 outputs): {host(lambda: torch.empty(32 * 4096, 512, device=dev)):.1f} us")
    print(f"32 x torch.empty, inference mode: ", end="")
    with torch.inference_mode():
        print(f"{host(lambda: [torch.empty(4096, 512, device=dev) for _ in range(32)]):.1f} us")
    print(f"cuda launch of a tiny kernel (torch.zeros(1) add_): {host(lambda: z.add_(1)) if (z := torch.zeros(1, device=dev)) is not None else 0:.1f} us")
