#!/bin/bash
# toy bench, 1 thread, before (e42c8a3) and after (this stop) alternating, twice
out=/tmp/bench_ab; mkdir -p $out
run() {
  dir=/tmp/wt-before; [ $1 = after ] && dir=/tmp/wt-after
  echo "== $1 $2 $(date -u +%H:%M:%S) $(uptime)" >> $out/log.txt
  (cd $dir && OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 python bench.py --workload toy --ckpt /tmp/speed2_ckpt --repeats 5 --min_seconds 1 --out $out/toy_${1}_$2.json) >> $out/log.txt 2>&1
  echo "   done $(date -u +%H:%M:%S)" >> $out/log.txt
}
run before 1; run after 1; run before 2; run after 2
echo ALL DONE >> $out/log.txt
