"""A probe, end to end: open the device, build the workload, search, plan, and report.

`ProbeRequest` is everything a probe needs, as plain data (`autotune.request`, re-exported here):
the CLI builds one from its flags, the service from a request body, and the isolated child receives
one over a pipe. `run_probe` runs it in this process; `autotune.engine.isolation.run_isolated` runs it in a
fresh child interpreter.

`probe_workload` probes a Workload *object* (live objects, `Workload.from_model`, or a framework's
own loop through `train=`) in this process, with the request's fields as keywords: a fresh process
cannot re-create live objects, so its confirmation is marked skipped and says why. A framework loop
may hold more per accumulation window than two micro-steps show (the Trainer fetches a window's
micro-batches before the first forward), so its plan is settled in the plan's own loop.

The one-micro-step loop is searched first, then the accumulating loop from its answer down
(`_search_below`): accumulating never needs less memory, so no size above that answer is tried.
"""

from __future__ import annotations

import dataclasses
import gc
import platform
import time
from collections.abc import Callable

import torch

from autotune import __version__
from autotune.devices import cuda, nvml
from autotune.devices.budget import BudgetDevice
from autotune.devices.device import ProbeDevice
from autotune.engine.lock import WaitCallback, device_lock
from autotune.engine.objective import time_and_choose
from autotune.engine.predict import CurveModel, largest_fitting, predicted_search
from autotune.engine.search import SearchOutcome, nothing_fits, search, search_from_guess
from autotune.engine.trial import TrainLoop, TrialRunner
from autotune.errors import ConfigError, InsufficientMemoryError, NothingFitsError
from autotune.parallel import sharding_name
from autotune.progress import ProgressCallback
from autotune.request import ProbeRequest, TrialCallback, parse_device, with_plan  # (re-exported)
from autotune.results import (
    CurvePoint,
    DeviceInfo,
    LoopAnswer,
    LoopShape,
    Prediction,
    ProbeResult,
    TrialRecord,
    Versions,
    WorkloadRef,
)
from autotune.settings import get_settings
from autotune.units import format_bytes, headroom_bytes
from autotune.workloads import checkpointing as activation_checkpointing
from autotune.workloads import fingerprint
from autotune.workloads.targets import resolve
from autotune.workloads.workload import Workload


def device_spec(device: torch.device) -> str:
    """The `device` field for a torch device a framework trains on (parse_device's inverse)."""
    return "cpu" if device.type == "cpu" else f"cuda:{device.index or 0}"


def resolve_device_kind(request: ProbeRequest) -> tuple[str, int]:
    if request.device is None:
        return ("cuda", 0) if cuda.cuda_available() else ("cpu", 0)
    return parse_device(request.device)


def open_device(request: ProbeRequest) -> tuple[ProbeDevice, str, int, int]:
    """Open the probing device. Returns (device, budget policy, budget bytes, headroom bytes)."""
    settings = get_settings()
    kind, index = resolve_device_kind(request)
    headroom = settings.headroom if request.headroom is None else request.headroom
    policy = request.budget or settings.budget
    if kind == "cpu":
        budget = request.memory or settings.cpu_memory
        policy_name = "memory" if request.memory else "total"
        room = headroom_bytes(budget, headroom)
        _check_limit(budget, room)
        device = BudgetDevice(
            budget,
            budget - room,
            allocator=request.allocator,
            allocator_config=request.allocator_config or cuda.allocator_config(),
            card=request.card,
        )
        return device, policy_name, budget, room

    cuda.refuse_uncached()
    cuda.apply_allocator_config(request.allocator_config)
    free, total = cuda.card_memory(index)
    if policy == "free":
        budget, policy_name = free, "free"
    else:
        budget, policy_name = total, "total"
    if request.memory is not None:
        if request.memory > total:
            raise ConfigError(
                f"--memory {format_bytes(request.memory)} is more than cuda:{index} has ({format_bytes(total)})"
            )
        budget, policy_name = min(budget, request.memory), "memory"
    minimum = settings.min_free_memory if request.min_free_memory is None else request.min_free_memory
    if free < minimum:
        raise InsufficientMemoryError(
            f"cuda:{index} has only {format_bytes(free)} free ({nvml.holders_note(index)}); "
            f"a probe needs at least {format_bytes(minimum)}: wait for them or lower "
            "--min-free-memory"
        )
    room = headroom_bytes(budget, headroom)
    _check_limit(budget, room)
    return cuda.CudaDevice(index, budget - room), policy_name, budget, room


def _check_limit(budget: int, room: int) -> None:
    if room >= budget:
        raise ConfigError(
            f"headroom {format_bytes(room)} leaves nothing of the budget {format_bytes(budget)}: lower --headroom"
        )


def versions() -> Versions:
    return Versions(
        autotune=__version__,
        torch=torch.__version__,
        cuda=torch.version.cuda,
        python=platform.python_version(),
    )


def device_info(device: ProbeDevice) -> DeviceInfo:
    return DeviceInfo(
        kind="cuda" if device.kind == "cuda" else "cpu-budget",
        name=device.name,
        index=getattr(device, "index", None),
        uuid=getattr(device, "uuid", None),
        total_bytes=device.total_bytes,
    )


def load_workload(request: ProbeRequest) -> Workload:
    return as_requested(resolve(request.target, request.options), request)


def as_requested(workload: Workload, request: ProbeRequest) -> Workload:
    """`workload` with the request's precision, optimizer, checkpointing and parallel setup (a request
    that chooses among checkpointing settings leaves the workload's: each candidate is its own request)."""
    workload = workload.with_overrides(precision=request.precision, optimizer=request.optimizer)
    if request.checkpointing_settings() is None:
        workload = workload.with_checkpointing(request.checkpointing)
    spec = request.parallel_spec()
    if spec.strategy == "fsdp" and workload.shard is not None:
        if not spec.reshard_after_forward:
            raise ConfigError(
                f"reshard_after_forward=False applies to autotune's own sharding; {workload.name!r} shards with its "
                "own function, which passes reshard_after_forward to fully_shard itself: drop the option"
            )
        spec = spec.model_copy(update={"sharding": sharding_name(workload.shard)})
    return workload if spec == workload.parallel else dataclasses.replace(workload, parallel=spec)


def result_fingerprint(workload: Workload, request: ProbeRequest, info: DeviceInfo, device: ProbeDevice) -> str:
    """The result's fingerprint. `autotune.workloads.fingerprint.result_environment` reads the same
    environment back from the result, so that the service can check a published result's model."""
    environment = fingerprint.probe_environment(
        steps=request.steps,
        device_kind=info.kind,
        device_name=info.name,
        total_bytes=info.total_bytes,
        limit_bytes=device.limit_bytes,
        max_batch=request.max_batch,
        granularity=request.granularity,
        prefetch=request.prefetch,
        torch_version=torch.__version__,
        cuda_version=torch.version.cuda,
        allocator=device.allocator_config,
        parallel=workload.parallel,
        checkpointing=workload.checkpointing,
    )
    return fingerprint.fingerprint(workload, **environment)


# The loop shapes a probe verifies: one micro-step per optimizer step, and accumulation. Two
# micro-steps stand for any number: from the second on, each runs with the same gradients alive.
ACCUMULATING_MICRO_STEPS = 2


def run_probe(
    request: ProbeRequest,
    on_trial: TrialCallback | None = None,
    *,
    workload: Workload | None = None,
    train: Callable[[TrialRunner], TrainLoop] | None = None,
    on_progress: ProgressCallback | None = None,
    holds_window: bool = True,
) -> ProbeResult:
    """Search both loop shapes in this process; the fresh-process confirmation is
    `autotune.engine.confirm`'s. Raises ConfigError, WorkloadError or ProbeError.

    `workload`: probe this object rather than the request's target. `train`: makes the job's own
    loop for the runner (a framework's), run instead of the workload's step. `holds_window`: that
    loop holds a whole accumulation window of micro-batches at once (the Trainer), so its plan is
    verified in its own number of micro-steps (`settle_plan`); False for a loop that holds one
    micro-batch at a time, which two micro-steps stand for. `on_progress`: told as each micro-step
    of a trial begins (every one: throttle it for a pipe). Holds the device's lock
    (`autotune.engine.lock`), waiting for another probe that holds it; a probe's isolated child
    runs under its parent's."""
    with device_lock(request.device):
        settings = request.checkpointing_settings()
        if settings is not None:
            from autotune.engine.checkpointing import choose_checkpointing

            def probe_one(one: ProbeRequest, seed: AccumulationSeed | None) -> ProbeResult:
                return _run_probe(
                    one,
                    on_trial,
                    workload=workload,
                    train=train,
                    on_progress=on_progress,
                    holds_window=holds_window,
                    seed=seed,
                    time_plan=True,
                    # The first setting's accumulating loop records its own timelines: what it added
                    # there, measured, seeds the next setting's (`seed_from`).
                    seed_accumulation=False,
                )

            return choose_checkpointing(request, settings, probe_one)
        return _run_probe(
            request, on_trial, workload=workload, train=train, on_progress=on_progress, holds_window=holds_window
        )


@dataclasses.dataclass(frozen=True)
class AccumulationSeed:
    """What accumulating adds to one micro-step's peak at the same micro-batch (the gradients alive in
    the second micro-step): measured in a probe of the same job with another checkpointing setting
    (`setting`), or, where no such probe ran, the gradients this loop's own peak did not hold
    (`setting` None: a lower bound, see `_gradients_seed`). With this setting's one-micro-step curve
    it predicts the accumulating answer, so that loop's search starts there instead of recording
    timelines of its own."""

    extra_bytes: int
    setting: str | None

    def describe(self) -> str:
        if self.setting is None:
            return (
                f"this loop's one-micro-step curve plus the {format_bytes(self.extra_bytes)} of gradients its peak did "
                "not hold, which accumulating keeps alive from the first micro-step on"
            )
        return (
            f"this setting's one-micro-step curve plus the {format_bytes(self.extra_bytes)} that accumulating added "
            f"with checkpointing {self.setting}"
        )


def _gradients_seed(model: torch.nn.Module, answer: TrialRecord | None) -> AccumulationSeed | None:
    """What accumulating adds at least, from the one-micro-step loop's own trial at its answer: in the
    second micro-step every gradient is alive from the forward on (the first micro-step's, not set to
    None before it), where one micro-step per optimizer step holds, at its peak, only the gradients its
    breakdown counts. Every op of the second micro-step holds at least what the same op of a
    one-micro-step step holds plus the gradients that one did not hold yet, so the accumulating peak
    is at least the one-micro-step peak plus those bytes. None where the trial's breakdown is not
    known or the peak held every gradient (the accumulating search then starts at the one-micro-step
    answer, as it does without a seed). A guess only: the search verifies it as it verifies any."""
    if answer is None or answer.breakdown is None:
        return None
    from autotune.devices.budget import local_storages, rounded

    storages = {id(s): s.nbytes() for p in model.parameters() if p.requires_grad for s in local_storages(p)}
    gradients = sum(rounded(n) for n in storages.values())
    extra = gradients - answer.breakdown.gradients
    return AccumulationSeed(extra_bytes=extra, setting=None) if extra > 0 else None


def _run_probe(
    request: ProbeRequest,
    on_trial: TrialCallback | None,
    *,
    workload: Workload | None,
    train: Callable[[TrialRunner], TrainLoop] | None,
    on_progress: ProgressCallback | None,
    holds_window: bool = True,
    seed: AccumulationSeed | None = None,
    time_plan: bool = False,
    seed_accumulation: bool = True,
) -> ProbeResult:
    started = time.perf_counter()
    workload = load_workload(request) if workload is None else as_requested(workload, request)
    device, policy, budget, room = open_device(request)
    info = device_info(device)
    key = result_fingerprint(workload, request, info, device)
    runner = TrialRunner(
        workload,
        device,
        steps=request.steps,
        prefetch=request.prefetch,
        train=train,
        on_progress=on_progress,
        max_steps=request.max_steps,
    )
    single = LoopShape(micro_steps=1, steps=request.steps, prefetch=request.prefetch)
    accumulating = single.model_copy(update={"micro_steps": ACCUMULATING_MICRO_STEPS})

    ran: list[TrialRecord] = []  # every trial, in order: a search that finds nothing returns none

    def trial_in(loop: LoopShape) -> Callable[[int], TrialRecord]:
        run = runner.trial_fn(loop)

        def trial(batch: int) -> TrialRecord:
            record = run(batch)
            ran.append(record)
            if on_trial is not None:
                on_trial(record)
            return record

        return trial

    answers: list[LoopAnswer] = []
    trials: list[TrialRecord] = []
    outcomes: dict[int, SearchOutcome] = {}
    curve: CurveModel | None = None  # the one-micro-step loop's predicted curve, for a seeded accumulating search
    for loop in (single, accumulating):
        before = len(ran)
        try:
            if loop.accumulates:
                # Not under DDP: its reducer is reset after every trial and re-makes its buckets in
                # the next, and one seeded DDP probe (a suite run, 2026-12-02) failed the kept-memory
                # check after an out-of-memory trial; its unseeded order has held in every run.
                ddp = workload.parallel.strategy == "ddp"
                if seed is None and curve is not None and seed_accumulation and not ddp:
                    answer = answers[0].max_micro_batch
                    at = [t for t in outcomes[1].trials if t.fits and t.batch == answer]
                    seed = _gradients_seed(runner.model, at[-1] if at else None)
                outcome, prediction = _search_below(
                    trial_in(loop), device, request, answers[0], seed=None if curve is None else (seed, curve)
                )
            else:
                outcome, prediction, curve = _search_modelled(trial_in(loop), device, request)
        except NothingFitsError as exc:
            if not loop.accumulates:
                raise
            # One micro-step fits and accumulation fits at no size (its gradients alive in forward
            # leave no room): an answer for the one loop, and the reason for the other.
            trials += ran[before:]
            answers.append(LoopAnswer(loop=loop, max_micro_batch=None, capped=False, reason=str(exc)))
            continue
        outcomes[loop.micro_steps] = outcome
        trials += outcome.trials
        answers.append(
            LoopAnswer(loop=loop, max_micro_batch=outcome.max_micro_batch, capped=outcome.capped, prediction=prediction)
        )
    safe = answers[-1]
    throughput = None
    if request.objective == "throughput" and safe.max_micro_batch is not None:
        # Timed in the accumulating loop: a plan that needs throughput tuning accumulates.
        searched = len(outcomes[ACCUMULATING_MICRO_STEPS].trials)
        throughput = time_and_choose(
            trial_in(accumulating),
            outcomes[ACCUMULATING_MICRO_STEPS].trials,
            safe.max_micro_batch,
            request.granularity,
            request.effective_batch,
            request.world_size,
            request.policy,
        )
        trials += outcomes[ACCUMULATING_MICRO_STEPS].trials[searched:]
    result = ProbeResult(
        fingerprint=key,
        workload=WorkloadRef(
            target=request.target,
            options=request.options,
            precision=workload.precision.value,
            optimizer=workload.optimizer_name,
            steps=request.steps,
            input_spec=dict(workload.input_spec),
            parallel=workload.parallel,
            checkpointing=None if workload.checkpointing == "none" else workload.checkpointing,
        ),
        device=info,
        budget_policy=policy,  # type: ignore[arg-type]
        budget_bytes=budget,
        headroom_bytes=room,
        limit_bytes=device.limit_bytes,
        max_micro_batch=safe.max_micro_batch,
        accumulation_failure=None if safe.reason is None else f"no micro-batch fits with accumulation: {safe.reason}",
        capped=safe.capped,
        loop=safe.loop,
        max_micro_batch_without_accumulation=answers[0].max_micro_batch,
        answers=answers,
        max_batch_cap=request.max_batch,
        granularity=request.granularity,
        search=request.search,
        prediction=safe.prediction,
        objective=request.objective,
        throughput=throughput,
        trials=trials,
        batch_norm=any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in runner.model.modules()),
        notes=[] if runner.kept_once is None else [_kept_once_note(runner.kept_once)],
        allocator_config=device.allocator_config,
        versions=versions(),
        duration_seconds=time.perf_counter() - started,
    )
    result = with_plan(result, request)
    if train is not None and holds_window:
        result = settle_plan(result, request, trial_in)
    if time_plan:
        result = _plan_timed(result, trial_in)
    return result.model_copy(update={"duration_seconds": time.perf_counter() - started})


# The optimizer steps of the trial that times a plan's micro-batch for the checkpointing choice: its
# last step is timed, and the fastest of it and the search's trial at that size is taken (one step's
# time is noisy on a loaded machine, and load only ever slows a step down).
TIMING_STEPS = 4


def _plan_timed(result: ProbeResult, trial_in: Callable[[LoopShape], Callable[[int], TrialRecord]]) -> ProbeResult:
    """The result with one more trial: its plan's micro-batch (or, without a plan, the accumulating
    answer) in the plan's loop for TIMING_STEPS optimizer steps, timed for the checkpointing choice."""
    made = result.plan
    size = made.micro_batch if made is not None else result.max_micro_batch
    if size is None:
        return result
    loop = plan_loop(result)
    record = trial_in(loop.model_copy(update={"steps": max(loop.steps, TIMING_STEPS)}))(size)
    return result.model_copy(update={"trials": [*result.trials, record]})


def plan_loop(result: ProbeResult) -> LoopShape:
    """The loop the result's plan runs: one micro-step, or the loop of the accumulating answer."""
    made = result.plan
    if made is not None and made.accumulation_steps == 1:
        return next((a.loop for a in result.answers if not a.loop.accumulates), result.loop)
    return result.loop


def _kept_once_note(kept: str) -> str:
    return (
        f"memory kept from the first trials: {kept}; counted as the job's own from then on (a cache built once, "
        "cuBLAS's workspaces), and no later trial kept more"
    )


def settle_plan(
    result: ProbeResult, request: ProbeRequest, trial_in: Callable[[LoopShape], Callable[[int], TrialRecord]]
) -> ProbeResult:
    """Verify an accumulating plan in its own number of micro-steps, lowering it until it holds.

    Two micro-steps stand for any number in autotune's loop, not in a framework's that holds the
    window's micro-batches at once: the plan's micro-batch count is searched again in its loop
    (one trial when the answer holds, since more micro-steps never need less), and a lower answer
    plans again, with as many or more micro-steps."""
    for _ in range(8):  # each round adds micro-steps, so it ends; more rounds than this is a bug
        made = result.plan
        if made is None or made.accumulation_steps <= ACCUMULATING_MICRO_STEPS:
            return result
        loop = result.loop.model_copy(update={"micro_steps": made.accumulation_steps})
        if any(a.loop == loop for a in result.answers):
            return result
        trial = trial_in(loop)
        outcome = search_from_guess(
            trial,
            made.max_micro_batch,
            cap=made.max_micro_batch,
            granularity=request.granularity,
            limit_bytes=result.limit_bytes,
        )
        answer = LoopAnswer(loop=loop, max_micro_batch=outcome.max_micro_batch, capped=result.capped)
        result = result.model_copy(
            update={
                "max_micro_batch": answer.max_micro_batch,
                "loop": loop,
                "answers": [*result.answers, answer],
                "trials": [*result.trials, *outcome.trials],
            }
        )
        result = with_plan(result, request)
    raise AssertionError("the plan did not settle in its own loop")


def probe_workload(
    workload: Workload,
    *,
    on_trial: TrialCallback | None = None,
    train: Callable[[TrialRunner], TrainLoop] | None = None,
    on_progress: ProgressCallback | None = None,
    wait_for_device: bool = True,
    on_wait: WaitCallback | None = None,
    holds_window: bool = True,
    **fields: object,
) -> ProbeResult:
    """Probe a Workload object in this process; `fields` are ProbeRequest's (memory="6GiB",
    effective_batch=256, world_size=...). Its trials restore the model; it is not confirmed in a
    fresh process, which cannot re-create the objects. While another probe holds the device, waits
    for it (`on_wait` hears who holds it; the log by default), or raises DeviceBusyError with
    `wait_for_device=False`. `train` and `holds_window`: as `run_probe`'s."""
    from autotune.results import Confirmation

    fields.setdefault("target", f"live:{workload.name}")
    request = ProbeRequest.model_validate(fields)
    # Frameworks collect garbage between runs (Accelerate's free_memory: ~0.2 s a call with
    # transformers imported, several per trial). Objects older than the probe cannot be a trial's
    # garbage, so freezing them leaves each collection the trials' objects alone.
    # (Not when the application froze its own objects: unfreeze() would thaw them too.)
    freeze = gc.get_freeze_count() == 0
    # The job gets its model back as it had it: trials train it on the probing device.
    model = workload.build_model()
    if request.parallel == "fsdp" and workload.build_model() is model:
        raise ConfigError(
            "parallel='fsdp' shards the model in place (fully_shard changes its class and parameters), and this "
            "workload's model is the job's own object: probe a workload that builds its model "
            "(`autotune probe module:workload --parallel fsdp`, or a Workload with build_model)"
        )
    training = model.training
    where = next((p.device for p in model.parameters()), None)
    if freeze:
        gc.freeze()
    try:
        with (
            device_lock(request.device, wait=wait_for_device, on_wait=on_wait),
            activation_checkpointing.kept_as_it_was(model),  # the settings probed are undone
        ):
            result = run_probe(
                request, on_trial, workload=workload, train=train, on_progress=on_progress, holds_window=holds_window
            )
    finally:
        if freeze:
            gc.unfreeze()
        if request.parallel != "none":
            from autotune import parallel

            parallel.release()  # the job may make its own process group next
        model.train(training)
        if where is not None and next(model.parameters()).device != where:
            model.to(where)
    note = (
        "not confirmed in a fresh process: live objects are probed in this one (every trial restored the "
        "model); on a GPU, run `autotune probe module:workload` for that confirmation"
    )
    confirmation = Confirmation(
        status="skipped", passed=False, steps=request.confirmation_steps(result.device.kind), note=note
    )
    return result.model_copy(update={"confirmation": confirmation})


def _search(
    trial: Callable[[int], TrialRecord], device: ProbeDevice, request: ProbeRequest, cap: int | None = None
) -> tuple[SearchOutcome, Prediction | None]:
    outcome, prediction, _ = _search_modelled(trial, device, request, cap)
    return outcome, prediction


def _search_modelled(
    trial: Callable[[int], TrialRecord], device: ProbeDevice, request: ProbeRequest, cap: int | None = None
) -> tuple[SearchOutcome, Prediction | None, CurveModel | None]:
    """`_search`, with the predictor's curve when it made one."""
    cap = request.max_batch if cap is None else cap
    if request.search == "predict":
        predicted = predicted_search(
            trial,
            device,
            start=min(request.start_batch, cap) if cap is not None else request.start_batch,
            cap=cap,
            granularity=request.granularity,
            limit_bytes=device.limit_bytes,
        )
        return predicted.outcome, predicted.prediction, predicted.model
    outcome = search(
        trial,
        start=min(request.start_batch, cap) if cap is not None else request.start_batch,
        cap=cap,
        granularity=request.granularity,
        limit_bytes=device.limit_bytes,
    )
    return outcome, None, None


def _search_below(
    trial: Callable[[int], TrialRecord],
    device: ProbeDevice,
    request: ProbeRequest,
    single: LoopAnswer,
    *,
    seed: tuple[AccumulationSeed | None, CurveModel] | None = None,
) -> tuple[SearchOutcome, Prediction | None]:
    """The accumulating loop, from the one-micro-step answer down. Accumulating never needs less
    memory than one micro-step (the gradients are alive in forward), so a size above that answer
    already failed with less memory, and is never tried; the answer itself is tried first (most
    jobs' peak is in backward, where the gradients are alive in both loops: one trial). Below it, the
    request's search (the predictor's, or the plain walk down from the answer) with the answer as
    its cap. An accumulating answer above the one-micro-step answer was the allocator's placement
    luck in a few steps (5415 > 5413 on an H100, and 5415 then ran out of memory at step 3): this
    search cannot give one.

    `seed`: (what accumulating added in a probe of another checkpointing setting, this setting's
    one-micro-step curve): the answer is predicted from them and verified from there (`_seeded_below`)."""
    ceiling = single.max_micro_batch
    assert ceiling is not None  # the one-micro-step search raised otherwise
    if seed is not None and seed[0] is not None:
        seeded = _seeded_below(trial, device, request, single, seed[0], seed[1])
        if seeded is not None:
            return seeded
    first = trial(ceiling)
    if first.fits:
        return SearchOutcome(ceiling, single.capped, [first]), None
    below = ceiling - request.granularity
    if below < request.granularity:
        raise nothing_fits(first, device.limit_bytes)
    if request.search == "predict":
        outcome, prediction = _search(trial, device, request, cap=below)
    else:
        outcome, prediction = (
            search_from_guess(trial, below, cap=below, granularity=request.granularity, limit_bytes=device.limit_bytes),
            None,
        )
    # Its cap fitting is no cap of the job's: the size above it (the ceiling) failed in this loop.
    return SearchOutcome(outcome.max_micro_batch, False, [first, *outcome.trials]), prediction


def _seeded_below(
    trial: Callable[[int], TrialRecord],
    device: ProbeDevice,
    request: ProbeRequest,
    single: LoopAnswer,
    seed: AccumulationSeed,
    curve: CurveModel,
) -> tuple[SearchOutcome, Prediction] | None:
    """The accumulating answer predicted as the largest size whose one-micro-step peak (this setting's
    curve) plus what accumulating added under `seed.setting` fits the limit, then verified from there
    as any prediction is (it fits, the size above does not; the one-micro-step answer is the cap).
    None when the prediction is the one-micro-step answer itself (the plain path tries it first)."""
    ceiling = single.max_micro_batch
    assert ceiling is not None
    granularity = request.granularity
    guess = min(largest_fitting(curve, device.limit_bytes - seed.extra_bytes, ceiling), ceiling)
    guess = guess // granularity * granularity
    if guess >= ceiling or guess < granularity:
        return None
    outcome = search_from_guess(trial, guess, cap=ceiling, granularity=granularity, limit_bytes=device.limit_bytes)
    capped = single.capped if outcome.capped else False
    single_curve = [] if single.prediction is None else single.prediction.curve
    prediction = Prediction(
        predicted_max_micro_batch=guess,
        probe_batches=[],
        exact=guess == outcome.max_micro_batch,
        # What was predicted: the one-micro-step curve raised by the seed's bytes.
        curve=[CurvePoint(batch=p.batch, peak_bytes=p.peak_bytes + seed.extra_bytes) for p in single_curve],
        seeded_from=seed.describe(),
    )
    return SearchOutcome(outcome.max_micro_batch, capped, outcome.trials), prediction
