set -x
source scratch/dev/prefix.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep 'Model name'; git log --oneline -1 2>/dev/null
mkdir -p $OUT/r
timeout 330 python3 -m pytest -m gpu -q -rs tests/test_kt_gpu_mapped_experts.py tests/test_kt_gpu_streamed_experts.py tests/test_kt_gpu.py tests/test_kt_gpu_flashinfer.py tests/test_kt_expert_deferral.py tests/test_kt_causal_sdpa.py tests/test_runtime_sampler.py --durations=8 2>&1 | tail -30 | tee $OUT/r/gpu_tests.txt
timeout 200 python3 -m bench.run --shape v2-lite --only baseline --out $OUT/r/build > $OUT/r/build.log 2>&1; echo build rc=$?
tail -5 $OUT/r/build.log
cd $OUT && tar czf r.tgz r && rm -rf r
