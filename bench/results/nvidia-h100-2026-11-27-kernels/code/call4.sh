source scratch/dev/prefix.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p $OUT/r
timeout 520 python3 -m pytest -m gpu -v -rs tests/test_kt_gpu_mapped_experts.py tests/test_kt_gpu_streamed_experts.py tests/test_kt_gpu.py tests/test_kt_gpu_flashinfer.py tests/test_kt_expert_deferral.py tests/test_kt_causal_sdpa.py tests/test_runtime_sampler.py tests/test_kt_multi_gpu.py > $OUT/r/gpu_tests_x2.txt 2>&1
echo rc=$?
grep -n -m3 -B30 -A30 "Fatal Python\|Segmentation\|Aborted\|Timeout" $OUT/r/gpu_tests_x2.txt | head -90
grep -E "FAILED|ERROR" $OUT/r/gpu_tests_x2.txt | tail -5
tail -3 $OUT/r/gpu_tests_x2.txt
cd $OUT && tar czf r.tgz r && rm -rf r
