set -x
source scratch/dev/prefix.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; lscpu | grep 'Model name'
mkdir -p $OUT/r
timeout 200 python3 -m pytest -m gpu -q -rs tests/test_kt_gpu_mapped_experts.py 2>&1 | tail -15 | tee $OUT/r/gpu_mapped.txt
timeout 330 python3 -m bench.run --shape v2-lite --only baseline,decode,ttft,http --methods AMXINT4 --primary AMXINT4 --budget 300 --out $OUT/r/int4-primary > $OUT/r/int4-primary.log 2>&1
tail -40 $OUT/r/int4-primary.log
cd $OUT && tar czf r.tgz r && rm -rf r
