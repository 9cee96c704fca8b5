#!/usr/bin/env bash
# On the GPU host (it has torch, transformers and safetensors; this machine does not): runs every
# fixture generator and packs the results into $OUT/fixtures.tgz, with a log per generator.
# The DFlash fixtures (reference/fixtures/dflash) need the public dflash/model.py in .gpu/dflash/
# (`node tools/gpu/bundle.mjs dflash`, carried as .gpu); without it they are skipped, saying so.
#   tools/gpu/make-fixtures.sh    (OUT set by the device runner)
set -u
out=${OUT:?set OUT}
work=$(mktemp -d)
python3 -c 'import torch, transformers, safetensors, numpy; print("torch", torch.__version__, "transformers", transformers.__version__, "safetensors", safetensors.__version__, "numpy", numpy.__version__)' | tee "$out/versions.txt"
status=0
for gen in safetensors:format quant:quant deepseek:hf; do
  script=${gen%%:*}; dir=${gen##*:}
  if python3 "tools/fixtures/gen_${script}_fixtures.py" "$work/$dir" > "$out/$script.log" 2>&1; then
    echo "ok   $script"; tail -n 8 "$out/$script.log"
  else
    status=1; echo "FAIL $script"; tail -n 40 "$out/$script.log"
  fi
done
if [ -f .gpu/dflash/model.py ]; then
  if python3 tools/fixtures/gen_dflash_fixtures.py .gpu/dflash "$work/dflash" > "$out/dflash.log" 2>&1; then
    echo "ok   dflash"; tail -n 4 "$out/dflash.log"
  else
    status=1; echo "FAIL dflash"; tail -n 40 "$out/dflash.log"
  fi
else
  echo "skip dflash: .gpu/dflash/model.py absent (node tools/gpu/bundle.mjs dflash)"
fi
tar -C "$work" -czf "$out/fixtures.tgz" .
ls -la "$out"
exit $status
