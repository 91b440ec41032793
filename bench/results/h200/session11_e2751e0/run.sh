#!/usr/bin/env bash
# Session 11 run A: issue 8's last evidence on the GPU — the linear loss past 2^31 elements (both backends), then the
# whole suite (no fuzz, no heavy groups) at HEAD, which holds session 10's dispatcher-test fix.
cd "$(dirname "$0")/.."
start=$SECONDS
st() { echo "$1 rc=$2 $((SECONDS-start))s" >> $OUT/status.txt; }
nvidia-smi -L > $OUT/status.txt 2>&1; echo "HEAD ${HEAD_SHA:-?}" >> $OUT/status.txt
timeout 170 python3 -m pytest tests/test_bad_inputs.py -q -p no:cacheprovider -rf -k "linear_loss_more or linear_loss_rows" \
  --durations=5 > $OUT/linear_loss_2_31.txt 2>&1; st linear_loss_2_31 $?
timeout 330 python3 -m pytest tests -q -n 12 -rf -k "not more_than_2_31 and not ten_thousand" \
  --ignore=tests/test_fuzz.py > $OUT/pytest.txt 2>&1; st pytest $?
tail -8 $OUT/linear_loss_2_31.txt; grep -E "passed|failed" $OUT/pytest.txt | tail -3; grep FAILED $OUT/pytest.txt | head; cat $OUT/status.txt
