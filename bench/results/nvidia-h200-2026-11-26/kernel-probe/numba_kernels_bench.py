import sys, time, json, os
threads = int(sys.argv[1]); tokens = [int(t) for t in sys.argv[2].split(",")]; L = int(sys.argv[3]) if len(sys.argv) > 3 else 8
import numba, numpy as np
numba.set_num_threads(threads)
sys.path.insert(0, os.path.dirname(__file__))
from nbk import moe_f32, moe_i8
H, I, E, K = 2048, 1408, 64, 6
rng = np.random.default_rng(0)
gu = [rng.integers(-127, 128, (E, 2 * I, H), dtype=np.int8) for _ in range(L)]
dn = [rng.integers(-127, 128, (E, H, I), dtype=np.int8) for _ in range(L)]
sgu = (rng.random((E, 2 * I)) * 1e-3).astype(np.float32)
sdn = (rng.random((E, H)) * 1e-3).astype(np.float32)
for T in tokens:
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = np.full((T, K), 0.1, np.float32)
    calls = max(20, 200 // T)
    ids = [np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int32) for _ in range(calls)]
    out = np.zeros((T, H), np.float32)
    # reference for the first token of the first call
    e = ids[0][0]; ref = np.zeros(H, np.float32)
    for k in range(K):
        h = (gu[0][e[k]].astype(np.float32) @ x[0]) * sgu[e[k]]
        g, u = h[:I], h[I:]
        ref += 0.1 * (dn[0][e[k]].astype(np.float32) @ (g / (1 + np.exp(-g)) * u)) * sdn[e[k]]
    for name, fn in (("f32", moe_f32), ("i8", moe_i8)):
        t0 = time.perf_counter(); fn(x, ids[0], w, gu[0], sgu, dn[0], sdn, out); first = time.perf_counter() - t0
        err = float(np.abs(out[0] - ref).max() / np.abs(ref).max())
        for i in range(4): fn(x, ids[i], w, gu[i % L], sgu, dn[i % L], sdn, out)
        t0 = time.perf_counter()
        for i in range(calls): fn(x, ids[i], w, gu[i % L], sgu, dn[i % L], sdn, out)
        dt = (time.perf_counter() - t0) / calls
        distinct = np.mean([len(np.unique(a)) for a in ids])
        print(json.dumps({"kernel": name, "threads": threads, "tokens": T, "ms": round(dt * 1e3, 3), "first_s": round(first, 2),
                          "GB_s": round(3 * H * I * distinct / dt / 1e9, 1), "rel_err": round(err, 5)}), flush=True)
