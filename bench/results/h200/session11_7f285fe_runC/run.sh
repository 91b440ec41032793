#!/usr/bin/env bash
# Session 11 run C: the final sum_partials (Helion's twin now sums across rows once): the norms' tests and fuzz to
# the end, the A/B against the old two-kernel sum, and the norms' backward bench at the final code.
cd "$(dirname "$0")/.."
start=$SECONDS
st() { echo "$1 rc=$2 $((SECONDS-start))s" >> $OUT/status.txt; }
nvidia-smi -L > $OUT/status.txt 2>&1; echo "HEAD ${HEAD_SHA:-?}" >> $OUT/status.txt
timeout 290 python3 -m pytest tests -q -n 14 -rf -p no:cacheprovider \
  -k "(rms_norm or layer_norm or routes_stay_bounded) and not ten_thousand" > $OUT/pytest_norms.txt 2>&1; st pytest_norms $?
timeout 130 python3 .gpu/partials_ab.py $OUT/partials_ab.json > $OUT/partials_ab.log 2>&1; st partials_ab $?
rest=$((575 - (SECONDS - start)))
timeout $rest python3 -m bench --ops rms_norm,layer_norm,add_rms_norm --modes bwd,fwd_bwd \
  --shapes 4096x4096,4096x8192,16384x4096,16384x8192 --backends auto,helion,triton,torch_compile \
  --no-plots --out $OUT/bench > $OUT/bench.log 2>&1; st bench $?
tar czf $OUT/bench.tgz -C $OUT bench 2>/dev/null; rm -rf $OUT/bench
tail -2 $OUT/pytest_norms.txt; grep FAILED $OUT/pytest_norms.txt | head -5; tail -26 $OUT/partials_ab.log | cut -c1-90; cat $OUT/status.txt
