#!/bin/bash
# 1 thread (OMP_NUM_THREADS=1: 2 threads collapsed under load ~10), toy old/new alternating twice, then chat 4x4 old/new
out=/tmp/speed2/bench1; mkdir -p $out
run() {  # $1 workload, $2 old|new, $3 extra args, $4 tag
  dir=/work/wt-speed2; [ $2 = old ] && dir=/work/wt-speed2-base
  echo "== $1 $2 $4 $(date -u +%H:%M:%S) $(uptime)" >> $out/log.txt
  (cd $dir && OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE=1 nice -n 0 python bench.py --workload $1 --ckpt /tmp/speed2_ckpt $3 --out $out/${1}_${2}_$4.json) >> $out/log.txt 2>&1
  echo "   done $(date -u +%H:%M:%S) $(uptime)" >> $out/log.txt
}
run toy old "--repeats 5 --min_seconds 1" 1
run toy new "--repeats 5 --min_seconds 1" 1
run chat old "--tasks 4 --repeats 3 --min_seconds 1" 1
run chat new "--tasks 4 --repeats 3 --min_seconds 1" 1
run toy old "--repeats 5 --min_seconds 1" 2
run toy new "--repeats 5 --min_seconds 1" 2
echo ALL DONE >> $out/log.txt
