"""Tuning leaves the job's process as it found it, in each framework: torch's CPU random state (and
CUDA's on a GPU), numpy's and `random`'s, every module's train/eval mode, the model's device and its
weights. Before, tuning advanced torch's global random state, and a seeded run afterwards differed
from the same run untuned.

Each framework is tuned once (a plan that accumulates, so the gradient check runs too), with a model
whose modules are in mixed modes; each test compares one state before and after."""

from __future__ import annotations

import gc
import logging
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
]
FRAMEWORKS = ["transformers", "lightning", "accelerate"]


def _states(model: nn.Module) -> dict[str, Any]:
    return {
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "numpy": np.random.get_state(),
        "random": random.getstate(),
        "modes": [m.training for m in model.modules()],
        "device": {p.device for p in model.parameters()},
        "weights": [t.detach().clone() for t in (*model.parameters(), *model.buffers())],
    }


def _mixed_modes(model: nn.Module) -> None:
    """Some modules in eval mode, as a job that freezes part of its model keeps them."""
    model.train()
    for i, module in enumerate(model.modules()):
        if i % 3 == 1:
            module.eval()


def _seeded() -> None:
    torch.manual_seed(1234)
    np.random.seed(1234)
    random.seed(1234)


def _transformers(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    pytest.importorskip("transformers")
    from autotune.integrations.transformers import tune_trainer
    from tests.test_integration_transformers import MEMORY, examples, make_trainer

    trainer = make_trainer(tmp_path, examples(32), per_device_train_batch_size=8, gradient_accumulation_steps=4)
    _mixed_modes(trainer.model)
    _seeded()
    before = _states(trainer.model)
    result = tune_trainer(trainer, memory=MEMORY, headroom=0)
    assert result.framework.gradient_check is not None
    return before, _states(trainer.model)


def _lightning(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    pl = pytest.importorskip("lightning.pytorch")
    from autotune.integrations.lightning import AutotuneBatchSize
    from tests import lightning_job

    seen: dict[str, dict[str, Any]] = {}

    class Look(pl.Callback):
        def __init__(self, when: str) -> None:
            self.when = when

        def on_fit_start(self, trainer: Any, module: Any) -> None:
            if self.when == "before":
                _mixed_modes(module)
                _seeded()
            seen[self.when] = _states(module)

    tuner = AutotuneBatchSize(memory=lightning_job.MEMORY, headroom=0)
    module = lightning_job.Net(batch_size=8)
    trainer = lightning_job.trainer(
        tmp_path, max_steps=1, accumulate_grad_batches=8, callbacks=[Look("before"), tuner, Look("after")]
    )
    trainer.fit(module)
    assert tuner.result is not None and tuner.result.framework.gradient_check is not None
    return seen["before"], seen["after"]


def _accelerate(tmp_path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    from autotune.integrations.accelerate import tune_accelerator
    from tests.test_integration_accelerate import MEMORY, Rows, mlp, mse

    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=16)
    model = mlp()
    model.append(nn.Dropout(0.1))  # a module that draws from the random state in train mode
    _mixed_modes(model)
    _seeded()
    before = _states(model)
    loader = torch.utils.data.DataLoader(Rows(), batch_size=64)
    try:
        result = tune_accelerator(
            accelerator, model, torch.optim.AdamW(model.parameters()), loader, loss=mse, memory=MEMORY, headroom=0
        )
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    assert result.framework.gradient_check is not None
    return before, _states(model)


TUNES: dict[str, Callable[[Path], tuple[dict[str, Any], dict[str, Any]]]] = {
    "transformers": _transformers,
    "lightning": _lightning,
    "accelerate": _accelerate,
}


@pytest.fixture(scope="module", params=FRAMEWORKS)
def tuned(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    logging.getLogger("transformers").setLevel(logging.ERROR)
    gc.freeze()
    try:
        yield TUNES[request.param](tmp_path_factory.mktemp(request.param))
    finally:
        gc.unfreeze()


def test_torch_cpu_random_state(tuned: tuple[dict[str, Any], dict[str, Any]]) -> None:
    before, after = tuned
    assert torch.equal(before["cpu"], after["cpu"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_torch_cuda_random_states(tuned: tuple[dict[str, Any], dict[str, Any]]) -> None:
    before, after = tuned
    assert all(torch.equal(a, b) for a, b in zip(before["cuda"], after["cuda"], strict=True))


def test_numpy_random_state(tuned: tuple[dict[str, Any], dict[str, Any]]) -> None:
    before, after = tuned
    assert all(np.array_equal(a, b) for a, b in zip(before["numpy"], after["numpy"], strict=True))


def test_python_random_state(tuned: tuple[dict[str, Any], dict[str, Any]]) -> None:
    before, after = tuned
    assert before["random"] == after["random"]


def test_every_modules_train_or_eval_mode(tuned: tuple[dict[str, Any], dict[str, Any]]) -> None:
    before, after = tuned
    assert False in before["modes"] and True in before["modes"]
    assert before["modes"] == after["modes"]


def test_the_models_device(tuned: tuple[dict[str, Any], dict[str, Any]]) -> None:
    before, after = tuned
    assert before["device"] == after["device"]


def test_the_models_weights_and_buffers(tuned: tuple[dict[str, Any], dict[str, Any]]) -> None:
    before, after = tuned
    assert all(torch.equal(a, b) for a, b in zip(before["weights"], after["weights"], strict=True))
