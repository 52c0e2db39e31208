"""The Lightning callback, for real: a CNN with BatchNorm fitted by Lightning's own loop on the budget
device, and a 2-process DDP (gloo) job whose ranks both receive rank 0's values."""

from __future__ import annotations

import gc
import json
import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from autotune.devices.budget import BudgetDevice  # noqa: E402
from autotune.errors import ConfigError  # noqa: E402
from autotune.integrations.lightning import AutotuneBatchSize  # noqa: E402
from tests import lightning_job  # noqa: E402
from tests.lightning_job import EFFECTIVE_BATCH, MEMORY, Net  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::lightning.fabric.utilities.warnings.PossibleUserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
]
ROOT = Path(__file__).resolve().parent.parent


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


LOGGED = _Records()


@pytest.fixture(scope="module")
def tuned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[AutotuneBatchSize, Any, Net]]:
    gc.freeze()  # Lightning collects garbage between runs: leave it only the new objects to walk
    logging.getLogger("autotune").addHandler(LOGGED)
    callback = AutotuneBatchSize(effective_batch=EFFECTIVE_BATCH, memory=MEMORY, headroom=0)
    module = Net()
    trainer = lightning_job.trainer(tmp_path_factory.mktemp("fit"), max_steps=3, callbacks=[callback])
    try:
        trainer.fit(module)
    finally:
        logging.getLogger("autotune").removeHandler(LOGGED)
    yield callback, trainer, module
    gc.unfreeze()


def fits(root: Path, micro: int, accumulation: int, steps: int = 3) -> bool:
    """Lightning's own fit loop at (micro, accumulation) under the probe's limit: True if it fits."""
    module = Net(batch_size=micro)
    job = lightning_job.trainer(root, max_steps=steps, accumulate_grad_batches=accumulation)
    device = BudgetDevice(MEMORY)
    device.track([*module.parameters(), *module.buffers()])
    try:
        with device.active():
            job.fit(module)
    except torch.OutOfMemoryError:
        return False
    assert job.global_step == steps
    return True


def test_the_callback_sets_batch_size_and_accumulation(tuned: tuple[AutotuneBatchSize, Any, Net]) -> None:
    callback, trainer, module = tuned
    plan = callback.result.plan
    assert plan is not None and plan.accumulation_steps > 1
    assert (module.batch_size, trainer.accumulate_grad_batches) == (plan.micro_batch, plan.accumulation_steps)
    assert plan.micro_batch * plan.accumulation_steps == EFFECTIVE_BATCH
    assert trainer.global_step == 3  # the fit went on with the new values
    assert callback.result.workload.optimizer == "AdamW"
    assert callback.result.workload.precision == "fp32"


def test_the_batchnorm_warning_is_in_the_plan_and_logged(tuned: tuple[AutotuneBatchSize, Any, Net]) -> None:
    callback, _trainer, _module = tuned
    plan = callback.result.plan
    warning = next(w for w in plan.warnings if "BatchNorm" in w)
    assert f"micro-batches of at most {plan.micro_batch} samples" in warning
    assert f"autotune: {warning}" in LOGGED.messages


def test_tuned_values_hold_in_lightnings_loop_and_one_more_runs_out(
    tmp_path: Path, tuned: tuple[AutotuneBatchSize, Any, Net]
) -> None:
    callback, _trainer, _module = tuned
    plan, answer = callback.result.plan, callback.result.max_micro_batch
    assert fits(tmp_path, plan.micro_batch, plan.accumulation_steps)
    assert fits(tmp_path, answer, plan.accumulation_steps)
    assert not fits(tmp_path, answer + 1, plan.accumulation_steps)


def test_under_two_process_ddp_both_ranks_get_rank_zeros_values(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "lightning_job.py"), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [r["probed"] for r in ranks] == [True, False]  # probed once, on rank 0
    values = {(r["batch_size"], r["accumulate_grad_batches"]) for r in ranks}
    assert len(values) == 1, ranks
    (micro, accumulation) = values.pop()
    assert micro * accumulation * 2 == EFFECTIVE_BATCH and accumulation >= 1
    assert [r["steps"] for r in ranks] == [2, 2]


# The job as configured ------------------------------------------------------------------------
def _fit(root: Path, module: Net, **kwargs: Any) -> tuple[AutotuneBatchSize, Any]:
    tuner = kwargs.pop("tuner", None) or AutotuneBatchSize(memory=MEMORY, headroom=0)
    trainer = lightning_job.trainer(root, max_steps=1, callbacks=[*kwargs.pop("callbacks", []), tuner], **kwargs)
    trainer.fit(module)
    return tuner, trainer


def test_no_effective_batch_keeps_the_jobs_8_x_4(tmp_path: Path) -> None:
    module = Net(batch_size=8)
    tuner, trainer = _fit(tmp_path, module, accumulate_grad_batches=4)
    result = tuner.result
    tuning = result.framework
    assert tuning.effective_batch_from == "job"
    assert (tuning.job.micro_batch, tuning.job.accumulation_steps, tuning.job.effective_batch) == (8, 4, 32)
    assert result.plan.effective_batch == 32
    assert module.batch_size * trainer.accumulate_grad_batches == 32
    assert (tuning.tuned.micro_batch, tuning.tuned.accumulation_steps) == (
        module.batch_size,
        trainer.accumulate_grad_batches,
    )
    # Lightning's loop holds one micro-batch at a time: no trial beyond two micro-steps (the
    # plan's own number of micro-steps is not searched again), and the trials and seconds are in the result.
    assert max(t.micro_steps for t in result.trials) == 2
    assert tuning.trials == len(result.trials) and tuning.seconds > 0


def test_an_accumulation_schedule_is_refused(tmp_path: Path) -> None:
    from lightning.pytorch.callbacks import GradientAccumulationScheduler

    with pytest.raises(
        ConfigError, match=r"changes it by epoch \(\{0: 1, 2: 4\}\): remove the GradientAccumulationScheduler"
    ):
        _fit(tmp_path, Net(), callbacks=[GradientAccumulationScheduler({0: 1, 2: 4})])


def test_a_loader_that_ignores_the_batch_size_attribute_is_refused(tmp_path: Path) -> None:
    class Fixed(Net):
        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(lightning_job.Images(), batch_size=16)

    with pytest.raises(ConfigError, match=r"sets 'batch_size' \(4\), and the train dataloader has batches of 16"):
        _fit(tmp_path, Fixed())


class SummedLoss(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return torch.nn.functional.cross_entropy(self.net(images), labels, reduction="sum")


def test_a_summed_loss_is_warned_with_the_factor_and_a_mean_is_not(tmp_path: Path) -> None:
    summed, _trainer = _fit(tmp_path / "sum", SummedLoss(batch_size=8), accumulate_grad_batches=16)
    check = summed.result.framework.gradient_check
    steps = summed.result.plan.accumulation_steps
    assert not check.equivalent and check.factor == pytest.approx(1 / steps, rel=1e-3), check
    warning = next(w for w in summed.result.plan.warnings if "accumulation does not train like" in w)
    assert f"gave {check.factor:.2f}x the gradient" in warning and "not a sum" in warning
    mean, _trainer = _fit(tmp_path / "mean", Net(batch_size=8), accumulate_grad_batches=16)
    assert mean.result.framework.gradient_check.equivalent
