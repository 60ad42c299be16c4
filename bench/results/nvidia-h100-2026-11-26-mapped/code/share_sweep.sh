#!/bin/bash
# Engine-level sweep of kt_gpu_read_experts (the GPU's share of each layer's 64 experts), one machine, one run each.
# usage: bash share_sweep.sh OUTDIR "24 31 40"
out=$1
for n in $2; do
  timeout 200 python3 -m bench.run --shape v2-lite --only decode,http --methods AMXINT8 --budget 170 \
    --setting kt_gpu_read_experts=$n --out "$out/share-$n" > "$out/share-$n.log" 2>&1
  echo "== share $n rc=$?"
  python3 - "$out/share-$n/bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
v = lambda x: x.get("value") if isinstance(x, dict) else x
dec = d["kt"]["AMXINT8"]["decode"]
sb = dec["step_breakdown"]
print("decode", v(dec["decode_throughput"]), v(dec["tpot_median"]), v(dec["tpot_p99"]), "gpu/wait", v(sb["gpu"]), v(sb["expert_wait"]))
print("http", [(r["concurrency"], v(r["output_throughput"]), v(r["tpot_median"])) for r in d["http"]["rounds"]])
print("copy GB/s", v(d["cpu_bandwidth"]["copy_bandwidth"]) if "cpu_bandwidth" in d else None)
PY
done
