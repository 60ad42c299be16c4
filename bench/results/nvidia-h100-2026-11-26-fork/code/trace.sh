#!/bin/bash
out=$OUT; root=$PWD
for v in base new; do
  d=$root; [ $v = base ] && d=$root/scratch/ab_base
  (cd $d && PYTHONPATH=/tmp/site:$d timeout 200 python3 $root/scratch/fork/seq.py --layers 4 --steps 16 --sequence) > $out/trace-$v.log 2>&1
  echo "== $v rc=$?"
  grep "^{" $out/trace-$v.log | tail -1 | python3 -c "
import json,sys
d=json.loads(sys.stdin.read())
print({k:v for k,v in d.items() if k not in ('one_step','top_us_per_step')})
for r in d['one_step']: print(r)
"
done
