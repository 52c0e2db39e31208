"""The gradient check on the job's own samples (issue 36, item 4). It made every micro-batch of the
window from worst-case samples of one length, so a loss that is a mean over each micro-batch's
tokens passed it (a difference of 4e-7) while on the job's samples of unequal lengths one window's
gradient differed from one batch's by 17.4%. It now builds the window from the job's samples,
shortest to longest, collated by the job's collate function: a token-mean loss is warned, with the
fix (token weights, or the sum over the window's tokens), and a loss that weighs every sample alike,
or the Trainer's num_items_in_batch path, is not.

A tiny language model (an embedding and a linear head) on sequences of 4 to 47 tokens, padded, the
padding out of the loss; each framework's own step; the budget device sized for a plan that
accumulates."""

from __future__ import annotations

import gc
import runpy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore:.*LeafSpec.*is deprecated:FutureWarning"),
]
ROOT = Path(__file__).resolve().parent.parent
VOCAB = 64
MEMORY = "1MiB"
EFFECTIVE_BATCH = 32
WEIGHED = "more than a scale: the micro-batches are weighed unlike the batch weighs their samples"


class Sequences(Dataset[dict[str, list[int]]]):
    def __init__(self, count: int = 96) -> None:
        generator = torch.Generator().manual_seed(0)
        lengths = torch.randint(4, 48, (count,), generator=generator).tolist()
        self.items = [{"input_ids": torch.randint(1, VOCAB, (n,), generator=generator).tolist()} for n in lengths]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, list[int]]:
        return self.items[i]


def pad(samples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Pads to the longest sequence; padding is left out of the loss (-100)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[row, :n] = torch.tensor(sample["input_ids"])
        labels[row, :n] = ids[row, :n]
    return {"input_ids": ids, "labels": labels}


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(input_ids)))


def token_mean(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The mean over the micro-batch's tokens (a causal LM's loss with ignore_index padding)."""
    logits = model(batch["input_ids"])
    return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def sample_mean(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Each sequence's token mean, then the mean over the sequences: every sample weighs alike."""
    logits = model(batch["input_ids"])
    per_token = nn.functional.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
    kept = batch["labels"] != -100
    return ((per_token * kept).sum(1) / kept.sum(1)).mean()


def _weighed_wrong(result: Any) -> str:
    check = result.framework.gradient_check
    assert check is not None and check.accumulation_steps == result.plan.accumulation_steps > 1, result.plan
    assert check.equivalent is False and check.difference > 10 * check.tolerance, check
    warning = next(w for w in result.plan.warnings if "accumulation does not train like" in w)
    assert WEIGHED in warning and f"differs by {check.difference:.1%}" in warning
    assert "of the job's first 64 samples, from the smallest to the largest" in warning
    return warning


def _equivalent(result: Any) -> None:
    check = result.framework.gradient_check
    assert check is not None and check.accumulation_steps > 1 and check.equivalent, check
    assert not [w for w in result.plan.warnings if "accumulation does not train like" in w]


# Accelerate (the `accelerate` fixture: tests/conftest.py) ----------------------------------------


@pytest.mark.parametrize("data", ["dataset", "loader"])
def test_accelerate_a_token_mean_loss_is_warned_and_a_sample_mean_is_not(accelerate: Any, data: str) -> None:
    from autotune.integrations.accelerate import tune_accelerator

    def tune(loss: Any) -> Any:
        model = LM()
        given: Any = (
            (Sequences(), pad) if data == "dataset" else (DataLoader(Sequences(), batch_size=8, collate_fn=pad), None)
        )
        return tune_accelerator(
            accelerate.Accelerator(cpu=True), model, torch.optim.SGD(model.parameters(), lr=0.1), given[0],
            EFFECTIVE_BATCH, loss=loss, collate=given[1], memory=MEMORY, headroom=0,
        )  # fmt: skip

    warning = _weighed_wrong(tune(token_mean))
    assert "autotune.accumulate(loader, plan, count=" in warning and "step.scale(loss)" in warning
    assert "divided by the tokens of the whole window" in warning
    _equivalent(tune(sample_mean))


# Lightning --------------------------------------------------------------------------------------
def _lightning_result(tmp_path: Path, loss: Any) -> Any:
    pl = pytest.importorskip("lightning.pytorch")
    from autotune.integrations.lightning import AutotuneBatchSize
    from tests import lightning_job

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.batch_size = 8
            self.lm = LM()

        def train_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Sequences(), batch_size=self.batch_size, collate_fn=pad)

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return loss(self.lm, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    tuner = AutotuneBatchSize(EFFECTIVE_BATCH, memory=MEMORY, headroom=0)
    trainer = lightning_job.trainer(tmp_path, max_steps=1, callbacks=[tuner])
    gc.freeze()
    try:
        trainer.fit(Module())
    finally:
        gc.unfreeze()
    return tuner.result


def test_lightning_a_token_mean_loss_is_warned_and_a_sample_mean_is_not(tmp_path: Path) -> None:
    warning = _weighed_wrong(_lightning_result(tmp_path / "token", token_mean))
    assert "manual optimization with autotune.accumulate's token weights" in warning
    _equivalent(_lightning_result(tmp_path / "sample", sample_mean))


# The Trainer ------------------------------------------------------------------------------------
class TokenMeanLM(LM):
    """A model whose forward takes no num_items_in_batch: the Trainer divides its loss by the steps."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(input_ids)
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)}


class WindowTokensLM(LM):
    """As a Hugging Face language-model head: its forward takes **kwargs, and with the Trainer's
    num_items_in_batch (the window's tokens) its loss is the sum over its tokens divided by it."""

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor, **kwargs: Any) -> dict[str, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(input_ids)
        summed = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
        count = kwargs.get("num_items_in_batch")
        return {"loss": summed / (count if count is not None else (labels != -100).sum())}


def _trainer_result(tmp_path: Path, model: nn.Module) -> Any:
    transformers = pytest.importorskip("transformers")
    from autotune.integrations.transformers import tune_trainer

    transformers.logging.set_verbosity_error()
    arguments = transformers.TrainingArguments(
        output_dir=str(tmp_path), report_to="none", save_strategy="no", logging_strategy="no", disable_tqdm=True,
        use_cpu=True, per_device_train_batch_size=8, gradient_accumulation_steps=4,
    )  # fmt: skip
    trainer = transformers.Trainer(model=model, args=arguments, train_dataset=Sequences(), data_collator=pad)
    return tune_trainer(trainer, memory=MEMORY, headroom=0)


def test_trainer_a_token_mean_loss_is_warned_and_num_items_in_batch_is_not(tmp_path: Path) -> None:
    warning = _weighed_wrong(_trainer_result(tmp_path / "token", TokenMeanLM()))
    assert "divide by num_items_in_batch" in warning and "compute_loss_func=" in warning
    _equivalent(_trainer_result(tmp_path / "window", WindowTokensLM()))


def test_the_docs_trainer_case_passes_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/trainer_autotune.py (docs/frameworks.md's Trainer block): GPT-2 on 256 sequences of 8 to
    47 tokens, 8 x 8 accumulation steps, a loss the Trainer normalizes by the window's tokens. Its cost
    is `bench/gradient_check.py`'s to measure (a benchmark, not a timed test)."""
    pytest.importorskip("transformers")
    monkeypatch.setenv("AUTOTUNE_CPU_MEMORY", "8MiB")
    monkeypatch.setenv("AUTOTUNE_HEADROOM", "0")
    monkeypatch.chdir(ROOT)
    script = runpy.run_path(str(ROOT / "examples" / "trainer_autotune.py"), run_name="__main__")
    result = script["trainer"].autotune_result
    check = result.framework.gradient_check
    assert check.accumulation_steps == 8 and check.equivalent, check
    assert check.seconds > 0  # what it cost is in the result
    assert not [w for w in result.plan.warnings if "accumulation does not train like" in w]
