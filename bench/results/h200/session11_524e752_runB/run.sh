#!/usr/bin/env bash
# Session 11 run B: the norms' one-kernel dw/db sum (sum_partials) on the GPU: its tests and fuzz, an interleaved A/B
# against the old two-kernel sum, the comparative bench of the norms' backward; then issue 6's unmeasured rows
# (rope at decode, geglu's two noisy rows interleaved, first calls).
cd "$(dirname "$0")/.."
start=$SECONDS
st() { echo "$1 rc=$2 $((SECONDS-start))s" >> $OUT/status.txt; }
nvidia-smi -L > $OUT/status.txt 2>&1; echo "HEAD ${HEAD_SHA:-?}" >> $OUT/status.txt
timeout 170 python3 -m pytest tests -q -n 12 -rf -p no:cacheprovider -k "(rms_norm or layer_norm) and not ten_thousand" \
  > $OUT/pytest_norms.txt 2>&1; st pytest_norms $?
timeout 60 python3 .gpu/partials_ab.py $OUT/partials_ab.json > $OUT/partials_ab.log 2>&1; st partials_ab $?
timeout 200 python3 -m bench --ops rms_norm,layer_norm,add_rms_norm --modes bwd,fwd_bwd \
  --shapes 4096x4096,4096x8192,16384x4096,16384x8192 --backends auto,helion,triton,torch_compile \
  --no-plots --out $OUT/bench > $OUT/bench.log 2>&1; st bench $?
timeout 40 python3 -m bench.latency --rounds 9 --ops rope --backends auto,helion,triton,torch,torch_compile \
  --out $OUT/rope_latency > $OUT/rope_latency.log 2>&1; st rope_latency $?
timeout 40 python3 -m bench.latency --gpu-time --mode fwd_bwd --rounds 9 --ops geglu,swiglu \
  --backends auto,helion,triton,torch_compile --shapes 4096x14336,4096x28672 --out $OUT/glu_gpu > $OUT/glu_gpu.log 2>&1; st glu_gpu $?
rest=$((560 - (SECONDS - start)))
[ $rest -gt 30 ] && { timeout $rest python3 -m bench.first_call --dtypes bfloat16 --backends helion,triton --jobs 4 \
  --out $OUT/first_call > $OUT/first_call.log 2>&1; st first_call $?; }
tar czf $OUT/more.tgz -C $OUT bench rope_latency glu_gpu first_call 2>/dev/null; rm -rf $OUT/bench $OUT/rope_latency $OUT/glu_gpu $OUT/first_call
tail -3 $OUT/pytest_norms.txt; grep FAILED $OUT/pytest_norms.txt | head -5; tail -26 $OUT/partials_ab.log; cat $OUT/status.txt
