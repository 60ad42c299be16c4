source scratch/dev/prefix.sh
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
mkdir -p $OUT/r
timeout 580 python3 -m bench.run --shape v2-lite --only baseline,decode,ttft,http,threads,avx2,load,hf,offload --budget 530 --out $OUT/r/one-run > $OUT/r/one-run.log 2>&1
echo rc=$?
tail -30 $OUT/r/one-run.log
cd $OUT && tar czf r.tgz r && rm -rf r
