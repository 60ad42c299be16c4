#!/bin/bash
# TTFT and batch-1 decode by streamed-experts budget, one AMXINT8 engine per setting (bench.run --only decode,ttft).
# usage: bash scratch/budget/sweep.sh OUTDIR "off 1 2.5" [threshold]
out=$1; budgets=$2; tokens=${3:-1024}
for b in $budgets; do
  case $b in
    off) extra=() ;;
    all) extra=(--gpu-prefill-tokens "$tokens") ;;
    *) extra=(--gpu-prefill-tokens "$tokens" --setting "kt_gpu_prefill_memory=$b") ;;
  esac
  python3 -m bench.run --shape v2-lite --only baseline,decode,ttft --methods AMXINT8 --budget 280 "${extra[@]}" \
    --out "$out/budget-$b" > "$out/budget-$b.log" 2>&1
  echo "== budget $b rc=$?"
  python3 - "$out/budget-$b/bench.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
v = lambda x: x.get("value") if isinstance(x, dict) else x
kt = d.get("kt", {}).get("AMXINT8", {})
dec = kt.get("decode", {})
mem = kt.get("memory", {})
print(json.dumps({"copy_gbps": v(d.get("cpu_bandwidth", {}).get("copy_bandwidth", {})),
                  "details": {k: x for k, x in kt.get("engine_details", {}).items() if "prefill" in k},
                  "decode_tok_s": v(dec.get("decode_throughput", {})), "tpot_median": v(dec.get("tpot_median", {})),
                  "rss_gb": v(mem.get("host_rss", {})), "gpu_smi_gb": v(mem.get("gpu_used_nvidia_smi", {})),
                  "ttft": {p["prompt_tokens"]: [v(p.get("ttft")), v(p.get("ttft_first"))] for p in d.get("ttft", {}).get("points", [])},
                  "phases": {k: x.get("status") for k, x in d.get("phases", {}).items()}}))
PY
done
