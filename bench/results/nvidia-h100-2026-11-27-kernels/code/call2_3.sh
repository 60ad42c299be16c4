source scratch/dev/prefix.sh
mkdir -p $OUT/r
rm -rf ~/.triton ~/.cache/flashinfer; ls ~/.cache; timeout 300 python3 -m pytest -m gpu -v -rs tests/test_kt_gpu_mapped_experts.py tests/test_kt_gpu_streamed_experts.py tests/test_kt_gpu.py tests/test_kt_gpu_flashinfer.py tests/test_kt_expert_deferral.py tests/test_kt_causal_sdpa.py tests/test_runtime_sampler.py > $OUT/r/gpu_tests_full.txt 2>&1
echo rc=$?
grep -n -m3 -B3 -A25 "Fatal Python\|Segmentation\|Aborted" $OUT/r/gpu_tests_full.txt | head -60
grep -E "PASSED|FAILED|ERROR" $OUT/r/gpu_tests_full.txt | tail -5
tail -3 $OUT/r/gpu_tests_full.txt
cd $OUT && tar czf r.tgz r && rm -rf r
