source scratch/dev/prefix.sh
mkdir -p $OUT/r
for n in 32 38 32 38; do
  timeout 140 python3 -m bench.run --shape v2-lite --only decode,http --methods AMXINT4 --primary AMXINT4 --budget 130 --setting kt_gpu_read_experts=$n --out $OUT/r/share-$n-$RANDOM > /tmp/log 2>&1
  echo "== share $n"; grep -E 'kt AMXINT4 +[0-9]|per step|HTTP' /tmp/log
done
cd $OUT && tar czf r.tgz r && rm -rf r
