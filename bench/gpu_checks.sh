#!/usr/bin/env bash
# The GPU checks of one device session, as one bounded script (the device tool lends a GPU machine
# for minutes): the `cuda`-marked tests, bench/cuda_truth.py's capped cases side by side (each case
# caps its own process, so they do not see each other's memory; each gets its own lock directory
# so that their probes do not queue for the card), the H100's allocator traces for the CPU to
# replay (bench/record_cuda_trace.py), then the whole-card case alone. Everything lands in
# $OUT/gpu.tgz; $OUT/summary.log says what ran and how long.
#
#     PYTHONPATH=. bench/gpu_checks.sh [SECONDS]     # SECONDS: the whole run's deadline, default 540
#
# Without pydantic on the machine, carry its wheels in .whl (docs/measurements.md says which).
set -u
deadline=${1:-540}
OUT=${OUT:-/tmp/gpu-out}
R=/tmp/gpu
mkdir -p "$R" "$OUT"
start=$(date +%s)
log() { echo "[t+$(($(date +%s) - start))s] $*" | tee -a "$R/summary.log"; }
finish() {
	log "end"
	tar czf "$OUT/gpu.tgz" -C /tmp gpu
	cp "$R/summary.log" "$OUT/summary.log"
}
trap finish EXIT

if ls .whl/*.whl >/dev/null 2>&1; then
	python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
	export PYTHONPATH=/tmp/site:${PYTHONPATH:-.}
fi
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2
log "commit ${AUTOTUNE_COMMIT:-unknown}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1 | tee -a "$R/summary.log"
python3 -c "import torch, transformers, accelerate, pydantic, typer; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'pydantic', pydantic.__version__, 'typer', typer.__version__)" 2>&1 | tee -a "$R/summary.log"
python3 -m pytest -p no:cacheprovider -q tests/test_cli.py::test_every_long_flag_is_named_in_lower_case 2>&1 | tail -1 | tee -a "$R/summary.log"

own_locks() { AUTOTUNE_LOCK_DIR=$(mktemp -d) "$@"; }
truth() { # case steps
	local name=${1//:/_}
	own_locks timeout 290 python3 bench/cuda_truth.py --case "$1" --steps "$2" --json "$R/truth_$name.json" \
		--results "$R/results" >"$R/truth_$name.log" 2>&1
	log "truth $1 ($2 steps): rc $?"
}

log "group 1: the cuda tests, the traces, the capped cases, side by side"
(
	timeout 290 python3 -m pytest -m cuda -p no:cacheprovider -W default -q -rA \
		tests/test_gpu.py tests/test_trial.py tests/test_cuda_trace.py tests/test_breakdown.py >"$R/pytest_cuda.log" 2>&1
	log "pytest -m cuda: rc $? ($(tail -1 "$R/pytest_cuda.log"))"
) &
(
	for memory in 512MiB 2GiB; do
		own_locks timeout 140 python3 bench/record_cuda_trace.py --memory $memory \
			--out "$R/h100_trace_$memory.pkl.gz" >"$R/trace_$memory.log" 2>&1
		log "trace $memory: rc $? ($(tail -1 "$R/trace_$memory.log" | cut -c1-300))"
	done
) &
truth gpt:512MiB 200 &
truth gpt:512MiB:expandable 200 &
truth gpt:2GiB 200 &
truth trainer:2GiB 100 &
wait
log "group 1 done"

left=$((deadline - ($(date +%s) - start) - 10))
if [ "$left" -gt 60 ]; then
	log "the whole card, alone (${left}s left)"
	AUTOTUNE_LOCK_DIR=$(mktemp -d) timeout "$left" python3 bench/cuda_truth.py --case gpt:card --steps 10 \
		--json "$R/truth_gpt_card.json" --results "$R/results" >"$R/truth_gpt_card.log" 2>&1
	log "truth gpt:card (10 steps): rc $?"
else
	log "no time left for the whole card"
fi
for f in "$R"/truth_*.log; do
	echo "== $f" >>"$R/summary.log"
	grep -E "^\|" "$f" >>"$R/summary.log"
done
