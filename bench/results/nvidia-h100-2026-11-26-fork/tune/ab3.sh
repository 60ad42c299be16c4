#!/bin/bash
out=$OUT; root=$PWD; start=$SECONDS
run() {  # name dir args...
  local name=$1 dir=$2; shift 2
  (cd "$dir" && PYTHONPATH=/tmp/site:$dir timeout 220 python3 "$@") > "$out/$name.log" 2>&1
  echo "== $name rc=$? t=$((SECONDS - start))"
}
summ() {
python3 - "$1" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
v = lambda x: x.get("value") if isinstance(x, dict) else x
dec = d.get("kt", {}).get("AMXINT8", {}).get("decode", {})
sb = dec.get("step_breakdown", {})
print("decode", {k: v(dec.get(k)) for k in ("decode_throughput", "tpot_median", "tpot_p99")},
      {k: v(sb.get(k)) for k in ("step", "gpu", "expert_wait", "expert", "other")},
      d.get("kt", {}).get("AMXINT8", {}).get("engine_details", {}).get("gpu_read_experts"))
PY
}
PYTHONPATH=/tmp/site:$root timeout 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_kt_gpu_mapped_experts.py > "$out/gpu-tests.txt" 2>&1
echo "== tests rc=$?"; tail -2 "$out/gpu-tests.txt"
run layer-new "$root" -m bench.mapped_experts --tokens 1,4,16,32 --shares 0,auto --layers 6 --calls 240
grep -h '"summary"' "$out/layer-new.log"
run layer-base "$root/scratch/ab_base" -m bench.mapped_experts --tokens 1,4,16,32 --shares 0,auto --layers 6 --calls 240
grep -h '"summary"' "$out/layer-base.log"
i=0
for v in base new base new; do
  [ $((SECONDS - start)) -gt 470 ] && { echo "out of time at $v $i"; break; }
  i=$((i+1)); d=$root; extra=(); [ $v = base ] && d=$root/scratch/ab_base; [ $v = new26 ] && extra=(--setting kt_gpu_read_experts=26)
  run decode-$i-$v "$d" -m bench.run --shape v2-lite --only decode --methods AMXINT8 --budget 150 "${extra[@]}" --out "$out/decode-$i-$v"
  summ "$out/decode-$i-$v/bench.json"
done
