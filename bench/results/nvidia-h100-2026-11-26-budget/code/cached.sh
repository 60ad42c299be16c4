#!/bin/bash
# The cached-prefix TTFT (a 2,048-token prompt, 1,920 tokens cached) by streamed-experts budget, FlashInfer attention.
out=$1
run() { name=$1; shift; python3 -m bench.attention --out "$out/$name" --backends flashinfer --contexts "" "$@" \
          > "$out/$name.log" 2>&1; echo "== $name rc=$?"; tail -1 "$out/$name.log" | cut -c1-900; }
run off
run budget-2.5 --gpu-prefill-tokens 32 --setting kt_gpu_prefill_memory=2.5
run all --gpu-prefill-tokens 32
