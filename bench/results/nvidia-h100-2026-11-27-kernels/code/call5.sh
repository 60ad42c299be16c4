source scratch/dev/prefix.sh
mkdir -p $OUT/r
cp engines/kt/mapped_experts.py scratch/dev/new_mapped.py
for m in AMXINT4 AMXINT8; do
  for v in new old; do
    cp scratch/dev/${v}_mapped.py engines/kt/mapped_experts.py
    echo "== $m $v"
    timeout 100 python3 -m bench.mapped_experts --method $m --tokens 1,16 --shares 32 --layers 4 --calls 120 > $OUT/r/ab_${m}_${v}.jsonl 2>$OUT/r/ab_${m}_${v}.err
    echo rc=$?; grep -v '^{"summary' $OUT/r/ab_${m}_${v}.jsonl | cut -c1-300
  done
done
cp scratch/dev/new_mapped.py engines/kt/mapped_experts.py
cd $OUT && tar czf r.tgz r && rm -rf r
