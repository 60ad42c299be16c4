#!/bin/bash
out=$OUT; root=$PWD; start=$SECONDS
PYTHONPATH=/tmp/site:$root timeout 330 python3 -m pytest -m gpu -q -rs -p no:cacheprovider tests/test_kt_gpu_mapped_experts.py tests/test_runtime_sampler.py tests/test_kt_causal_sdpa.py tests/test_kt_gpu.py tests/test_kt_gpu_flashinfer.py tests/test_kt_gpu_streamed_experts.py tests/test_kt_expert_deferral.py tests/test_kt_multi_gpu.py > "$out/gpu-tests-final.txt" 2>&1
echo "== gpu tests rc=$? t=$((SECONDS - start))"; grep -E "passed|failed|error" "$out/gpu-tests-final.txt" | tail -3
for v in base new; do
  [ $((SECONDS - start)) -gt 400 ] && { echo "out of time at $v"; break; }
  d=$root; [ $v = base ] && d=$root/scratch/ab_base
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 190 python3 -m bench.run --shape v2-lite --only http --methods AMXINT8 --budget 170 --out "$out/http-$v") > "$out/http-$v.log" 2>&1
  echo "== http $v rc=$? t=$((SECONDS - start))"; grep -h "clients:" "$out/http-$v.log" | head -4
done
