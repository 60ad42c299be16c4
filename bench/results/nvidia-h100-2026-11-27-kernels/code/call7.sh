source scratch/dev/prefix.sh
mkdir -p $OUT/r
timeout 280 python3 -m pytest -m gpu -v -rs tests/test_kt_gpu_mapped_experts.py tests/test_kt_gpu_streamed_experts.py tests/test_kt_gpu.py tests/test_kt_gpu_flashinfer.py tests/test_kt_expert_deferral.py tests/test_kt_causal_sdpa.py tests/test_runtime_sampler.py > $OUT/r/gpu_tests_fresh.txt 2>&1
echo rc=$?
grep -n -m3 -B3 -A40 "Fatal Python\|Segmentation\|Aborted" $OUT/r/gpu_tests_fresh.txt | head -80
grep -cE "PASSED" $OUT/r/gpu_tests_fresh.txt; grep -E "FAILED|ERROR" $OUT/r/gpu_tests_fresh.txt | head -5
tail -2 $OUT/r/gpu_tests_fresh.txt
cd $OUT && tar czf r.tgz r && rm -rf r
