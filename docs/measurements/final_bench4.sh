#!/bin/bash
# chat 4 tasks x 4, 1 thread, old then new
out=/tmp/speed2/bench1
run() {
  dir=/work/wt-speed2; [ $2 = old ] && dir=/work/wt-speed2-base
  echo "== $1 $2 $4 $(date -u +%H:%M:%S) $(uptime)" >> $out/log.txt
  (cd $dir && OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 nice -n 0 python bench.py --workload $1 --ckpt /tmp/speed2_ckpt $3 --out $out/${1}_${2}_$4.json) >> $out/log.txt 2>&1
  echo "   done $(date -u +%H:%M:%S) $(uptime)" >> $out/log.txt
}
run chat old "--tasks 4 --repeats 3 --min_seconds 1" 1
run chat new "--tasks 4 --repeats 3 --min_seconds 1" 1
echo ALL DONE >> $out/log.txt
