"""The memory-curve predictor: exact on the budget device, verified by real trials, and a plain
search (with the reason) when the op sequence depends on the batch size."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from autotune.devices.budget import BudgetDevice
from autotune.engine.predict import EnvelopeModel, StorageModel, Timeline, predict, record_trial
from autotune.engine.probe import ProbeRequest, run_probe
from autotune.engine.search import search
from autotune.engine.trial import TrialRunner
from autotune.results import Prediction, ProbeResult
from autotune.workloads.targets import resolve
from tests import predict_workloads

MIB = 2**20


def _assert_verified(result: ProbeResult) -> None:
    """The engine's guarantee, whatever the search: the answer fitted, one more did not (in its loop,
    or with one micro-step, which needs less memory), and no size ran twice in a loop."""
    for micro_steps in (1, 2):
        tried = [t.batch for t in result.loop_trials(micro_steps)]
        assert len(set(tried)) == len(tried), f"a size was tried twice: {tried}"
    shown = {(t.batch, t.fits) for t in result.evidence()}
    assert (result.max_micro_batch, True) in shown
    assert (result.max_micro_batch + result.granularity, False) in shown


def _predicted(result: ProbeResult) -> Prediction | None:
    """The prediction of the one-micro-step loop, which the predictor searches from scratch (the
    accumulating loop starts at that loop's answer: `_assert_from_the_single_answer`)."""
    return result.answers[0].prediction


def _assert_from_the_single_answer(result: ProbeResult) -> None:
    """No accumulating trial is above the one-micro-step answer. Where the gradients that loop's peak
    did not hold put the prediction below it (`seeded_from`), the search starts at that prediction and
    records no timelines; else its first trial is that answer (the only one when it fits with
    accumulation), and the predictor searches below it."""
    single = result.max_micro_batch_without_accumulation
    tried = [t.batch for t in result.loop_trials(2)]
    assert single is not None and max(tried) <= single, tried
    prediction = result.prediction
    if prediction is not None and prediction.seeded_from is not None:
        assert "gradients its peak did not hold" in prediction.seeded_from
        assert tried[0] == prediction.predicted_max_micro_batch < single, tried
        if prediction.exact:  # the prediction and the size above it: nothing else
            answer = result.max_micro_batch
            assert tried == [answer, answer + 1] or tried == [answer, single], tried
        return
    assert tried[0] == single and max(tried) == single, tried
    if result.max_micro_batch == single:
        assert tried == [single]
    else:
        assert result.prediction is not None, tried
        if result.prediction.fallback_reason is None:
            assert len(tried) <= 5, (tried, result.prediction)  # the answer, two timelines, two verifying


@pytest.mark.parametrize(("name", "mib"), [("gpt", 128), ("cnn", 64), ("mlp", 64)])
def test_prediction_is_exact_on_the_budget_device_for_the_examples(
    name: str, mib: int, capsys: pytest.CaptureFixture[str]
) -> None:
    result = run_probe(ProbeRequest(target=name, device="cpu", memory=mib * MIB))
    assert result.search == "predict"
    single = result.answers[0]
    assert single.loop.micro_steps == 1
    prediction = single.prediction
    assert prediction is not None
    assert prediction.fallback_reason is None
    assert prediction.predicted_max_micro_batch == single.max_micro_batch
    assert prediction.exact is True
    _assert_verified(result)
    # Two timeline trials (listed first, counted) and the two verifying trials: nothing else.
    assert prediction.probe_trials == 2
    answer = single.max_micro_batch
    assert [t.batch for t in result.loop_trials(1)] == [4, 2, answer, answer + 1]
    assert prediction.curve, "the predicted curve is reported"
    assert result.max_micro_batch_without_accumulation == answer >= result.max_micro_batch
    # The accumulating loop, from that answer down: predicted exactly below it when it does not fit.
    _assert_from_the_single_answer(result)
    if result.max_micro_batch < answer:
        assert result.prediction is not None and result.prediction.exact is True
        assert result.prediction.predicted_max_micro_batch == result.max_micro_batch
    # The summary says where each prediction came from: a seeded one from the other loop's timelines.
    from autotune.cli.summary import print_summary

    print_summary(result)
    printed = " ".join(capsys.readouterr().out.split())
    seeded = result.prediction is not None and result.prediction.seeded_from is not None
    assert seeded == (name == "gpt")  # the gradients gpt's peak did not hold put its answer lower
    if seeded:
        assert f"predicted {result.max_micro_batch} from this loop's one-micro-step curve plus" in printed
        assert f"that curve: predicted {answer} without accumulation from timelines at 4, 2 (exact;" in printed
    assert "from timelines at  (" not in printed


@pytest.mark.parametrize(("name", "mibs"), [("mlp", (58, 59, 60, 62)), ("cnn", (40, 52, 80))])
def test_one_recording_predicts_every_budget_and_trials_confirm_it(name: str, mibs: tuple[int, ...]) -> None:
    workload = resolve(name)
    big = BudgetDevice(1024 * MIB)
    runner = TrialRunner(workload, big, steps=2)
    _, high = record_trial(runner, big, 4)
    _, low = record_trial(runner, big, 2)
    assert low is not None and high is not None
    for mib in mibs:
        predicted, _ = predict(low, high, mib * MIB)
        assert predicted is not None and predicted > 4
        device = BudgetDevice(mib * MIB)
        check = TrialRunner(workload, device, steps=2)
        assert check(predicted).fits, f"{name} at {mib} MiB: predicted {predicted} does not fit"
        assert not check(predicted + 1).fits, f"{name} at {mib} MiB: {predicted + 1} fits too"


def test_rounding_each_storage_beats_extrapolating_rounded_sums() -> None:
    """The mlp's per-sample tensors are small (int64 targets: 8 bytes a sample), so rounded live
    bytes are not affine: the envelope over-predicts by one at 59 MiB; the storage model is exact."""
    workload = resolve("mlp")
    big = BudgetDevice(1024 * MIB)
    runner = TrialRunner(workload, big, steps=2)
    _, high = record_trial(runner, big, 4)
    _, low = record_trial(runner, big, 2)
    assert low is not None and high is not None
    envelope, _ = predict(low, high, 59 * MIB, exact_storages=False)
    exact, model = predict(low, high, 59 * MIB)
    assert isinstance(model, StorageModel)
    assert envelope == exact + 1  # type: ignore[operator]
    check = TrialRunner(workload, BudgetDevice(59 * MIB), steps=2)
    assert check(exact).fits and not check(envelope).fits  # type: ignore[arg-type]


def test_the_storage_model_reproduces_its_own_recordings() -> None:
    workload = resolve("cnn")
    device = BudgetDevice(1024 * MIB)
    runner = TrialRunner(workload, device, steps=2)
    records = {b: record_trial(runner, device, b) for b in (2, 4, 6)}
    timelines = {b: t for b, (_, t) in records.items()}
    assert all(t is not None for t in timelines.values())
    low, high, third = timelines[2], timelines[4], timelines[6]
    assert low is not None and high is not None and third is not None
    assert max(low.live) == records[2][0].peak_allocated_bytes
    model = StorageModel.fit(low, high)
    assert model is not None
    # A third size it never saw, op by op.
    assert model.timeline(6).tolist() == list(third.live)


# Batch-dependent op sequences ---------------------------------------------------------------
def _probe(target: str, **kwargs: object) -> ProbeResult:
    request = ProbeRequest(
        target=f"tests.predict_workloads:{target}",
        device="cpu",
        memory=MIB,
        headroom=0,
        **kwargs,  # type: ignore[arg-type]
    )
    return run_probe(request)


def test_differing_first_pair_predicts_from_the_next_pair() -> None:
    result = _probe("branchy")
    prediction = _predicted(result)
    assert prediction is not None
    assert prediction.probe_batches == [4, 2, 8] and prediction.probe_trials == 3
    assert prediction.fallback_reason is None
    assert prediction.exact is True
    _assert_verified(result)
    assert result.max_micro_batch == _probe("branchy", search="plain").max_micro_batch


def test_a_first_trial_with_once_only_work_predicts_from_the_other_two() -> None:
    result = _probe("warms_up")
    # The first loop searched is one micro-step's: its first trial is the process's first.
    (prediction,) = [a.prediction for a in result.answers if a.loop.micro_steps == 1]
    assert prediction is not None
    assert prediction.probe_batches == [4, 2, 8] and prediction.fallback_reason is None
    assert prediction.exact is True
    _assert_verified(result)


def test_op_sequences_that_always_differ_fall_back_to_the_plain_search() -> None:
    result = _probe("loopy")
    prediction = _predicted(result)
    assert prediction is not None
    assert prediction.predicted_max_micro_batch is None and prediction.exact is None
    assert prediction.fallback_reason is not None and "differ" in prediction.fallback_reason
    # The reason names the code whose ops grow with the batch (the model's loop over bits), not "the step".
    source, first = inspect.getsourcelines(predict_workloads._Net.forward)
    line = first + next(i for i, text in enumerate(source) if "x = x * 1.0" in text)
    single = result.answers[0].prediction
    assert single is not None and single.fallback_reason is not None
    assert f"the code at tests/predict_workloads.py:{line} in forward runs 4/6/8 ops at batch 2/4/8" in (
        single.fallback_reason
    )
    _assert_verified(result)
    # The timeline trials are reused by the plain search, never repeated.
    assert [t.batch for t in result.loop_trials(1)][:4] == [4, 2, 8, 1]
    _assert_from_the_single_answer(result)
    assert result.max_micro_batch == _probe("loopy", search="plain").max_micro_batch


def test_a_probe_that_does_not_fit_falls_back() -> None:
    tiny = run_probe(ProbeRequest(target="gpt", device="cpu", memory=80 * MIB, headroom=0))
    prediction = _predicted(tiny)
    assert prediction is not None and prediction.fallback_reason is not None
    assert "did not fit" in prediction.fallback_reason
    _assert_verified(tiny)


def test_a_cap_below_the_probes_is_never_exceeded() -> None:
    result = _probe("plain", max_batch=3)
    prediction = _predicted(result)
    assert prediction is not None and "cap" in (prediction.fallback_reason or "")
    assert max(t.batch for t in result.trials) == 3 and result.capped


def test_a_cap_below_the_prediction_is_tried_and_reported() -> None:
    result = _probe("plain", max_batch=20)
    assert result.capped and result.max_micro_batch == 20
    prediction = _predicted(result)
    assert prediction is not None and prediction.predicted_max_micro_batch == 20
    assert [t.batch for t in result.loop_trials(1)] == [4, 2, 20]
    assert [t.batch for t in result.loop_trials(2)] == [20]  # the cap, where the accumulating loop starts


def test_granularity_probes_and_answers_on_multiples() -> None:
    result = _probe("plain", granularity=8)
    assert all(t.batch % 8 == 0 for t in result.trials)
    prediction = _predicted(result)
    assert prediction is not None and prediction.probe_batches == [16, 8]
    _assert_verified(result)
    assert result.max_micro_batch == _probe("plain", granularity=8, search="plain").max_micro_batch


def test_plain_search_is_kept_on_request() -> None:
    result = _probe("plain", search="plain")
    assert result.search == "plain" and all(a.prediction is None for a in result.answers)
    assert [t.batch for t in result.loop_trials(1)][:3] == [1, 2, 4]
    assert result.loop_trials(2)[0].batch == result.max_micro_batch_without_accumulation


# The envelope as pure arithmetic --------------------------------------------------------------
def _timeline(batch: int, live: list[int]) -> Timeline:
    return Timeline(batch, tuple("op" for _ in live), tuple(live))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 3_000)), min_size=1, max_size=12),
    st.integers(0, 200_000),
)
def test_envelope_answer_is_the_largest_batch_under_the_limit(lines: list[tuple[int, int]], limit: int) -> None:
    """live_t(B) = a_t + b_t·B: the answer is the brute-force largest B whose every op fits."""
    low = _timeline(2, [a + 2 * b for a, b in lines])
    high = _timeline(4, [a + 4 * b for a, b in lines])
    model = EnvelopeModel.fit(low, high)
    answer = model.largest(limit)

    def fits(batch: int) -> bool:
        return all(a + b * batch <= limit for a, b in lines)

    if all(b == 0 for _, b in lines):
        assert answer == (None if fits(1) else 0)
        return
    assert answer is not None
    assert answer == 0 or fits(answer)
    assert not fits(answer + 1)
    assert all(not fits(b) for b in range(answer + 1, answer + 50))


# A device that reserves more than it allocates, as CUDA's caching allocator does ----------------
class _CachingBudgetDevice(BudgetDevice):
    """Reports 25% more reserved than allocated bytes; its limit on allocated bytes is the
    reserved limit / 1.25, so trials fail exactly where reserved bytes would pass the limit."""

    FACTOR = 1.25

    def __init__(self, reserved_limit: int) -> None:
        super().__init__(reserved_limit, int(reserved_limit / self.FACTOR))

    def peak_reserved_bytes(self) -> int:
        return int(self.peak_allocated_bytes() * self.FACTOR)


def test_a_caching_allocator_is_handled_by_one_refining_trial() -> None:
    from autotune.engine.predict import predicted_search

    limit = 64 * MIB
    device = _CachingBudgetDevice(limit)
    runner = TrialRunner(resolve("cnn"), device, steps=2)
    found = predicted_search(runner, device, limit_bytes=limit)
    prediction, outcome = found.prediction, found.outcome
    # Allocated bytes alone over-predict; the first guess's trial measured allocated/reserved.
    assert prediction.first_guess is not None
    assert prediction.first_guess > outcome.max_micro_batch
    assert prediction.exact is True
    by_batch = {t.batch: t for t in outcome.trials}
    assert not by_batch[prediction.first_guess].fits
    assert by_batch[outcome.max_micro_batch].fits and not by_batch[outcome.max_micro_batch + 1].fits
    assert len(outcome.trials) == len(by_batch) == 5  # 2 probes, the first guess, 2 verifying trials
    # The same answer as a plain search on a device capped at the allocated equivalent.
    plain = search(TrialRunner(resolve("cnn"), BudgetDevice(limit, int(limit / 1.25)), steps=2))
    assert plain.max_micro_batch == outcome.max_micro_batch


def test_the_budget_device_needs_no_refining_trial() -> None:
    result = _probe("plain")
    prediction = _predicted(result)
    assert prediction is not None and prediction.first_guess is None


# Memory that does not show, or does not grow (issue 12) -----------------------------------------
def test_tiny_per_sample_tensors_are_predicted_from_their_raw_sizes() -> None:
    """8 floats a sample: the live bytes, rounded to 512-byte blocks, are the same at batch 2 and 4,
    but the storages' raw sizes grow: the storage model predicts exactly (26 trials a loop before,
    from the plain search's doubling)."""
    result = run_probe(ProbeRequest(target="tests.workloads:tiny", device="cpu", memory=MIB, headroom=0))
    prediction = _predicted(result)
    assert prediction is not None and prediction.fallback_reason is None and prediction.exact is True
    answer = result.max_micro_batch_without_accumulation
    assert [t.batch for t in result.loop_trials(1)] == [4, 2, answer, answer + 1]
    _assert_verified(result)
    _assert_from_the_single_answer(result)


def test_a_flat_curve_is_an_error_after_the_two_timeline_trials() -> None:
    from autotune.errors import FlatMemoryError

    for cap in (None, 10**12):
        request = ProbeRequest(target="tests.guard_workloads:flat", device="cpu", memory=MIB, max_batch=cap)
        with pytest.raises(FlatMemoryError, match=r"timeline trials at batch 2 and 4 both peak at .* make_batch"):
            run_probe(request)


class _TimelineWithoutStorages:
    """A device that records live bytes per op only (as CUDA's timeline does): no raw sizes."""

    kind = "cuda"

    def __init__(self) -> None:
        self.events: list[tuple[str, object, int]] | None = None

    def live_bytes(self) -> int:
        return 0

    @contextmanager
    def record_timeline(self) -> Iterator[list[tuple[str, object, int]]]:
        self.events = []
        yield self.events
        self.events = None


def test_a_flat_timeline_without_raw_sizes_falls_back_and_the_plain_search_stops() -> None:
    """Without raw sizes a flat timeline may be rounding: the plain search runs (even under a cap
    of 10**12, which it used to answer at once) and stops at 1024 times its first size."""
    from autotune.engine.predict import predicted_search
    from autotune.errors import FlatMemoryError
    from autotune.results import TrialRecord

    device = _TimelineWithoutStorages()
    asked: list[int] = []

    def trial(batch: int) -> TrialRecord:
        asked.append(batch)
        if device.events is not None:
            device.events += [("op", "mm", 1000), ("op", "add", 2000)]
        return TrialRecord(batch=batch, fits=True, peak_allocated_bytes=2000, peak_reserved_bytes=2000, seconds=0.0)

    with pytest.raises(FlatMemoryError, match=r"batch 1 peaked at 2\.0 KiB and batch 1024 at 2\.0 KiB"):
        predicted_search(trial, device, cap=10**12, limit_bytes=10**6)  # type: ignore[arg-type]
    assert asked == [4, 2, 1, 8, 16, 32, 64, 128, 256, 512, 1024]


def test_with_the_allocator_model_the_replayed_trace_predicts_the_reserved_answer_exactly() -> None:
    """On the budget device with the CUDA allocator's model, the limit bites on reserved memory: the
    two timeline trials' allocations, replayed through the model at each size, predict the answer
    exactly (two more trials verify it), as counting live bytes does without it. The accumulating loop
    starts below that answer, at the curve raised by the gradients its peak did not hold: bytes the
    tensors add, which the cache's slack partly absorbs, so the guess is low here and the walk up
    from it finds the answer in three trials (four without the seed: the answer, two timelines, one)."""
    request = ProbeRequest(target="gpt", device="cpu", memory=128 * MIB, headroom=0, allocator="cuda")
    result = run_probe(request)
    assert any(t.peak_reserved_bytes > t.peak_allocated_bytes for t in result.trials if t.peak_reserved_bytes)
    single, accumulating = result.answers
    assert single.prediction is not None and single.prediction.exact, single
    assert len(result.loop_trials(1)) == 4
    _assert_from_the_single_answer(result)
    assert accumulating.prediction is not None and accumulating.prediction.seeded_from, accumulating
    assert accumulating.prediction.predicted_max_micro_batch <= accumulating.max_micro_batch  # low here: the slack
    assert len(result.loop_trials(2)) <= 3


# Trials the settle rule ran for different numbers of steps (issue 37) -------------------------
def test_timeline_trials_that_settled_in_different_steps_are_compared_over_the_same_steps() -> None:
    """With the caching allocator's model (AUTOTUNE_ALLOCATOR=cuda) a trial runs until the allocator
    settles: here batch 4's in 3 optimizer steps and batch 2's in 4. Their timelines are compared
    over the 3 steps both ran (the steps an optimizer hook marked), so they pair, and the prediction
    is exact: four trials, where the op counts used to differ by a step, the reason blamed the
    workload ("runs 4/3 ops at batch 2/4 ... a loop over the rows?"), batch 8 was probed (it did not
    fit at 32 MiB) and the plain search took seven."""
    request = ProbeRequest(
        target="tests.settle_workloads:unequal_steps", device="cpu", memory=32 * MIB, headroom=0, allocator="cuda"
    )
    result = run_probe(request)
    single = result.loop_trials(1)
    assert [(t.batch, t.steps) for t in single[:2]] == [(4, 3), (2, 4)]  # the case in point
    prediction = _predicted(result)
    assert prediction is not None and prediction.fallback_reason is None and prediction.exact is True
    answer = result.max_micro_batch_without_accumulation
    assert [t.batch for t in single] == [4, 2, answer, answer + 1]
    _assert_verified(result)
    _assert_from_the_single_answer(result)


def test_a_timeline_marks_each_optimizer_step_and_is_cut_to_the_steps_another_ran() -> None:
    from autotune.engine.predict import cut, paired, same_steps

    device = BudgetDevice(32 * MIB, allocator="cuda")
    runner = TrialRunner(resolve("tests.settle_workloads:unequal_steps"), device, steps=2)
    (_, high), (_, low) = (record_trial(runner, device, b) for b in (4, 2))
    assert high is not None and low is not None
    assert (len(high.step_ends), high.steps, len(low.step_ends), low.steps) == (3, 3, 4, 4)
    assert high.ops != low.ops
    # Both cut after their third step (what each ran after its last step, undoing the trial, goes).
    two, four = same_steps(low, high)
    assert len(two.ops) == len(four.ops) == high.step_ends[-1] == low.step_ends[2] < len(high.ops)
    assert (two.steps, four.steps) == (3, 3) and two.ops == four.ops == high.ops[: len(two.ops)]
    assert paired(low, high) == (two, four)
    # A cut keeps the storages born before it, alive where they died after it.
    assert two.storages is not None and low.storages is not None
    assert len(two.storages.born_at) < len(low.storages.born_at) and max(two.storages.died_at) < len(two.ops)
    assert cut(low, len(low.ops)) is low


def _logged(batch: int, sizes: list[tuple[int, int, int]], ops: int = 3) -> Timeline:
    """A timeline from (op made it, op freed it or -1, bytes) per storage, in the order they were made;
    its live bytes counted from them as the budget device counts them (512-byte blocks)."""
    from autotune.devices.budget import ROUNDING
    from autotune.engine.predict import StorageLog

    live = [0] * ops
    for born, died, nbytes in sizes:
        for op in range(born, ops if died < 0 else died):
            live[op] += -(-nbytes // ROUNDING) * ROUNDING
    log = StorageLog(0, tuple(b for b, _, _ in sizes), tuple(d for _, d, _ in sizes), tuple(n for _, _, n in sizes), ())
    return Timeline(batch, tuple(f"op{i}" for i in range(ops)), tuple(live), log)


def test_storages_pair_by_op_and_size_class_and_the_larger_trial_s_temporaries_keep_their_size() -> None:
    """The rule: within an op, each of the smaller trial's storages pairs with the next of the larger
    one's of its size class (as large, by at most the batch ratio) and lifetime; what is left over must
    be a temporary of its op (a reduction's workspace from some size on), kept at its size."""
    from autotune.engine.predict import pair_by_op

    small = _logged(4, [(0, -1, 4096), (1, 2, 768)])
    # Batch 8: a 1.5 MiB workspace and an 8-byte counter in op 1, freed there, before its 768 bytes.
    large = _logged(8, [(0, -1, 8192), (1, 1, 1572864), (1, 1, 8), (1, 2, 768)])
    partners = pair_by_op(small, large)
    assert partners is not None and partners.tolist() == [4096, 1572864, 8, 768]
    model = StorageModel.fit(small, large)
    assert model is not None and not model.one_to_one
    assert model.raw_sizes(100).tolist() == [102400, 1572864, 8, 768]
    # A storage left over that outlives its op is no temporary: the trials do not pair.
    kept = _logged(8, [(0, -1, 8192), (1, -1, 1024), (1, 2, 768)])
    assert pair_by_op(small, kept) is None and StorageModel.fit(small, kept) is None
    # Nor one grown by more than the batch ratio (or shrunk): another kind of storage.
    grown = _logged(8, [(0, -1, 4096 * 3), (1, 2, 768)])
    assert pair_by_op(small, grown) is None


def test_where_trials_differ_is_said_over_the_steps_both_ran() -> None:
    """Two trials of 3 and 4 steps whose steps also differ (batch 4 runs a `mul` the other does not):
    the reason names the `mul`'s code, counted over the 3 steps both ran, not the matmul's, whose
    count differs only by the step one of them ran more."""
    from autotune.engine.predict import aligned, where_ops_differ

    mm, add, mul, undo = ("model.py", 1, "forward"), ("model.py", 2, "forward"), ("model.py", 3, "forward"), None

    def steps(batch: int, count: int, step: list[tuple[str, tuple[str, int, str] | None]]) -> Timeline:
        ops = [*(step * count), ("copy", undo)]
        return Timeline(
            batch,
            tuple(name for name, _ in ops),
            tuple(0 for _ in ops),
            sites=tuple(site for _, site in ops),
            step_ends=tuple(len(step) * (k + 1) for k in range(count)),
        )

    low = steps(2, 3, [("mm", mm), ("add", add)])
    high = steps(4, 4, [("mm", mm), ("mul", mul), ("add", add)])
    assert "model.py:1 in forward runs 3/4 ops at batch 2/4" in where_ops_differ([low, high])
    assert "model.py:3 in forward runs 0/3 ops at batch 2/4" in where_ops_differ(aligned([low, high]))
