#!/usr/bin/env bash
# The GPU checks of one device session, as one bounded script (the device tool lends a GPU machine
# for minutes): the `cuda`-marked tests, bench/cuda_truth.py's capped cases side by side (each case
# caps its own process, so they do not see each other's memory; each gets its own lock directory
# so that their probes do not queue for the card), the H100's allocator traces for the CPU to
# replay (bench/record_cuda_trace.py), then the whole-card case alone. Everything lands in
# $OUT/gpu.tgz; $OUT/summary.log says what ran and how long.
#
#     PYTHONPATH=. bench/gpu_checks.sh [SECONDS [CHECK...]]
#
# SECONDS: the whole run's deadline (default 540). CHECKs (default: tests traces capped trainer card):
# tests, traces (bench/record_cuda_trace.py at 512 MiB and 2 GiB), capped (cuda_truth's gpt cases at
# 512 MiB, 512 MiB with expandable segments and 2 GiB), trainer (cuda_truth's trainer:2GiB), loops
# (bench/trace_loops.py: the plain loop and the trial runner's near the 2 GiB answer), card.
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

shift || true
checks=${*:-tests traces capped trainer card}
want() { [[ " $checks " == *" $1 "* ]]; }
loops() { # the plain loop and the trial runner's at 2 GiB, one micro-step, near the answer
	for spec in plain:137 trial:137 plain:136 plain:135; do
		(
			own_locks timeout 200 python3 bench/trace_loops.py --loop "${spec%%:*}" --batch "${spec##*:}" \
				--memory 2GiB --steps 20 --out "$R/loop_${spec/:/_}.pkl.gz" >"$R/loop_${spec/:/_}.log" 2>&1
			log "loop $spec: rc $? ($(tail -1 "$R/loop_${spec/:/_}.log" | cut -c1-300))"
		) &
	done
	wait
}

log "group 1 ($checks): side by side"
if want tests; then
	(
		timeout 290 python3 -m pytest -m cuda -p no:cacheprovider -W default -q -rA \
			tests/test_gpu.py tests/test_trial.py tests/test_cuda_trace.py tests/test_breakdown.py >"$R/pytest_cuda.log" 2>&1
		log "pytest -m cuda: rc $? ($(tail -1 "$R/pytest_cuda.log"))"
	) &
fi
if want traces; then
	(
		for memory in 512MiB 2GiB; do
			own_locks timeout 140 python3 bench/record_cuda_trace.py --memory $memory \
				--out "$R/h100_trace_$memory.pkl.gz" >"$R/trace_$memory.log" 2>&1
			log "trace $memory: rc $? ($(tail -1 "$R/trace_$memory.log" | cut -c1-300))"
		done
	) &
fi
if want capped; then
	truth gpt:512MiB 200 &
	truth gpt:512MiB:expandable 200 &
	truth gpt:2GiB 200 &
fi
want trainer && truth trainer:2GiB 100 &
want loops && loops &
wait
log "group 1 done"

left=$((deadline - ($(date +%s) - start) - 10))
if ! want card; then
	:
elif [ "$left" -gt 60 ]; then
	log "the whole card, alone (${left}s left)"
	AUTOTUNE_LOCK_DIR=$(mktemp -d) timeout "$left" python3 bench/cuda_truth.py --case gpt:card --steps 10 \
		--json "$R/truth_gpt_card.json" --results "$R/results" >"$R/truth_gpt_card.log" 2>&1
	log "truth gpt:card (10 steps): rc $?"
else
	log "no time left for the whole card"
fi
for f in "$R"/truth_*.log; do
	[ -e "$f" ] || continue
	echo "== $f" >>"$R/summary.log"
	grep -E "^\|" "$f" >>"$R/summary.log"
done
