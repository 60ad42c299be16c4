source scratch/dev/prefix.sh
mkdir -p $OUT/r
timeout 200 python3 -m bench.run --shape v2-lite --only decode --methods BF16,AMXINT4 --budget 180 --out $OUT/r/fresh-bf16 > $OUT/r/fresh-bf16.log 2>&1
tail -8 $OUT/r/fresh-bf16.log
timeout 330 python3 -m pytest -m gpu -q -rs tests/test_kt_gpu_streamed_experts.py tests/test_kt_gpu.py tests/test_kt_gpu_flashinfer.py tests/test_kt_expert_deferral.py tests/test_kt_causal_sdpa.py tests/test_runtime_sampler.py 2>&1 | tail -15 | tee $OUT/r/gpu_others.txt
cd $OUT && tar czf r.tgz r && rm -rf r
