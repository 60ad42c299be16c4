source scratch/dev/prefix.sh
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/r
timeout 330 python3 -m bench.run --shape v2-lite --only baseline,decode,avx2 --budget 320 --out $OUT/r/children > $OUT/r/children.log 2>&1
echo rc=$?
grep -A30 '== summary' $OUT/r/children.log
cd $OUT && tar czf r.tgz r && rm -rf r
