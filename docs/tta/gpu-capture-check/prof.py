"""Case a's captured step on the GPU, in parts: replay time, eager step time, and the
sum of the GPU kernels' times of one eager step (the floor of a replay), per setting."""
import json, os, sys, time
import torch
from layerpar.apps.train import build_net, load_data
from layerpar.mgrit.options import MGRITOptions
from layerpar.parallel import LayerParallel
from layerpar.parallel.capture import capture_step

dev = os.environ.get("DEV", "cuda")
x_tr, y_tr, _, _ = load_data("mnist1d", 0, torch.float32)
x, y = x_tr[:128].to(dev), y_tr[:128].to(dev)
ce = torch.nn.functional.cross_entropy
out = {}
if os.environ.get("TUNE", "1") == "1":  # where auto's tuning time goes (cProfile)
    import cProfile, pstats, io
    torch.manual_seed(0)
    net = build_net("mnist1d", 1024, 32, arch="dense", t_final=1.0).to(dev)
    m = LayerParallel(net, None, "auto")
    pr = cProfile.Profile()
    t0 = time.perf_counter()
    pr.enable()
    m.tune(x, y, ce, steps=1000, online=True)
    pr.disable()
    print("tune_s", time.perf_counter() - t0, flush=True)
    sio = io.StringIO()
    st = pstats.Stats(pr, stream=sio).sort_stats("cumulative")
    st.print_stats(r"layerpar.*(autotune|kernels|batched|accuracy|model|capture|timing)", 45)
    print(sio.getvalue()[-9000:], flush=True)
    m.close()
    del m, net
for name, lv, cf, fi in (("serial", 1, 2, 1), ("L3cf8", 3, 8, 1), ("L4cf4", 4, 4, 1),
                         ("L3cf4", 3, 4, 1), ("L2cf16", 2, 16, 1), ("L3cf16", 3, 16, 1)):
    t0 = time.perf_counter()
    torch.manual_seed(0)
    net = build_net("mnist1d", 1024, 32, arch="dense", t_final=1.0).to(dev)
    o = MGRITOptions(max_levels=lv, cfactor=cf, max_iter=fi, tol=0.0, rtol=0.0)
    m = LayerParallel(net, None, o, o, check_finite=False)
    opt = torch.optim.Adam(m.parameters(), lr=torch.tensor(1e-3, device=dev), capturable=dev == "cuda")

    def eager():
        opt.zero_grad(set_to_none=True)
        loss = ce(m(x), y)
        loss.backward()
        opt.step()
    for _ in range(3):
        eager()
    (torch.cuda.synchronize() if dev == "cuda" else None)
    t = time.perf_counter()
    for _ in range(10):
        eager()
    (torch.cuda.synchronize() if dev == "cuda" else None)
    eager_ms = (time.perf_counter() - t) / 10 * 1e3
    from torch.profiler import profile, ProfilerActivity
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as p:
        eager()
        (torch.cuda.synchronize() if dev == "cuda" else None)
    ev = [e for e in p.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kern_ms = sum(e.device_time for e in ev) / 1e3
    top = {}
    for e in ev:
        top[e.name] = top.get(e.name, 0) + e.device_time
    top = sorted(top.items(), key=lambda kv: -kv[1])[:8]
    step = capture_step(m, opt, ce, x, y, warmup=3) if dev == "cuda" else (lambda a, b: eager())
    for _ in range(5):
        step(x, y)
    (torch.cuda.synchronize() if dev == "cuda" else None)
    t = time.perf_counter()
    for _ in range(100):
        step(x, y)
    (torch.cuda.synchronize() if dev == "cuda" else None)
    rep_ms = (time.perf_counter() - t) / 100 * 1e3
    out[name] = dict(eager_ms=eager_ms, replay_ms=rep_ms, kernels=len(ev),
                     kernel_ms=kern_ms, top=[(n[:70], us / 1e3) for n, us in top],
                     build_s=time.perf_counter() - t0)
    print(name, json.dumps(out[name]), flush=True)
    del step, m, opt, net
    (torch.cuda.empty_cache() if dev == "cuda" else None)
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "prof.json"), "w"), indent=1)
