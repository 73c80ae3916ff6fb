#!/bin/bash
# side by side: old = main at 3bf4b92 (/work/wt-speed2-base), new = speed2 (/work/wt-speed2); alternating
out=/tmp/speed2/bench; mkdir -p $out
for w in toy chat; do
  for run in 1 2; do
    for which in old new; do
      dir=/work/wt-speed2; [ $which = old ] && dir=/work/wt-speed2-base
      echo "== $w $which run $run $(date -u +%H:%M:%S) $(uptime)" >> $out/log.txt
      (cd $dir && PYTHONDONTWRITEBYTECODE=1 nice -n 0 python bench.py --workload $w --ckpt /tmp/speed2_ckpt --repeats 5 --min_seconds 1 --out $out/${w}_${which}_${run}.json) >> $out/log.txt 2>&1
      echo "   done $(date -u +%H:%M:%S) $(uptime)" >> $out/log.txt
    done
    [ $w = chat ] && break
  done
done
echo ALL DONE >> $out/log.txt
