#!/bin/bash
# Engine-level A/B of kt_gpu_decode_from_host with streamed copies of half the experts (7.5 GB for V2-Lite).
# usage: bash scratch/zc/engine_ab.sh OUTDIR "false true"
out=$1; settings=$2
for s in $settings; do
  timeout 280 python3 -m bench.run --shape v2-lite --only decode,ttft,http --methods AMXINT8 --budget 230 \
    --gpu-prefill-tokens 1024 --setting kt_gpu_prefill_memory=7.5 --setting kt_gpu_decode_from_host=$s \
    --out "$out/from-host-$s" > "$out/from-host-$s.log" 2>&1
  echo "== decode_from_host=$s rc=$?"
  grep -i 'decode steps\|streamed\|prompt chunks' "$out/from-host-$s.log" | head -4
  python3 - "$out/from-host-$s/bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
v = lambda x: x.get("value") if isinstance(x, dict) else x
kt = d.get("kt", {}).get("AMXINT8", {})
dec = kt.get("decode", {})
print("decode", {k: v(dec.get(k)) for k in ("decode_throughput", "tpot_median", "tpot_p99", "fraction_of_ceiling")}, dec.get("step_breakdown"))
print("ttft", [(p["prompt_tokens"], v(p["ttft"])) for p in d.get("ttft", {}).get("points", [])])
for r in d.get("http", {}).get("rounds", []):
    print("http", r.get("concurrency"), v(r.get("output_throughput")), v(r.get("tpot_median")), v(r.get("decode_rate")), v(r.get("ttft_median")))
print("memory", kt.get("memory"), kt.get("host_rss_after_stop"), kt.get("engine_details"))
PY
done
