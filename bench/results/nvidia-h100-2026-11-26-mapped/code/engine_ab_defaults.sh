#!/bin/bash
# Engine-level A/B of kt_gpu_read_experts at the defaults (no streamed-copy flags): off first (it builds the checkpoint), then the default.
# usage: bash engine_ab_defaults.sh OUTDIR "0 default"
out=$1; settings=$2
for s in $settings; do
  extra=(); [ "$s" = default ] || extra=(--setting "kt_gpu_read_experts=$s")
  timeout 280 python3 -m bench.run --shape v2-lite --only decode,ttft,http --methods AMXINT8 --budget 230 \
    "${extra[@]}" \
    --out "$out/read-experts-$s" > "$out/read-experts-$s.log" 2>&1
  echo "== kt_gpu_read_experts=$s rc=$?"
  grep -ih 'decode steps' "$out/read-experts-$s.log" "$out/read-experts-$s/engines.log" | head -4
  python3 - "$out/read-experts-$s/bench.json" <<'PY'
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
