source scratch/dev/prefix.sh
mkdir -p $OUT/r
cp engines/kt/mapped_experts.py scratch/dev/new_mapped.py
for m in AMXINT4; do
  for v in old new old new; do
    cp scratch/dev/${v}_mapped.py engines/kt/mapped_experts.py
    echo "== $m $v"
    timeout 100 python3 -m bench.mapped_experts --method $m --tokens 1,16 --shares 32 --layers 4 --calls 120 > /tmp/ab.jsonl 2>/dev/null; cat /tmp/ab.jsonl >> $OUT/r/ab2_${m}_${v}.jsonl
    echo rc=$?; grep "^{" /tmp/ab.jsonl | grep -v summary | cut -c1-300
  done
done
cp scratch/dev/new_mapped.py engines/kt/mapped_experts.py
cd $OUT && tar czf r.tgz r && rm -rf r
