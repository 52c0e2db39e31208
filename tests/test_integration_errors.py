"""Errors from the integrations as the user reads them (issue 24, item 4): a `KeyError` in the user's
forward is raised as that KeyError, with the user's frames and a note of autotune's, in a traceback
of at most 15 lines whose first frame is the user's script (it was 33 to 52 lines through autotune's
internals, none of them the user's); autotune's own errors keep no frame of autotune's internals; a
Dataset given to Accelerate without collate= is named when torch's default_collate did not make the
batch the model needs."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

ROOT = Path(__file__).resolve().parent.parent

# The forward reads a field the batch does not have. Each script is a job as a user writes it.
MODEL = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 1)

    def forward(self, batch):
        return self.body(batch["features"])
"""
SCRIPTS = {
    "accelerate": (
        "accelerate",
        f"""import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import TensorDataset

from autotune.integrations.accelerate import tune_accelerator
{MODEL}

def loss_fn(model, batch):
    return model({{"inputs": batch[0]}}).mean()


model = Net()
data = TensorDataset(torch.randn(64, 16))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
tune_accelerator(Accelerator(cpu=True), model, optimizer, data, "max", loss=loss_fn, memory="1MiB")
""",
    ),
    "lightning": (
        "lightning",
        """import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune.integrations.lightning import AutotuneBatchSize


class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.batch_size = 4
        self.body = nn.Linear(16, 1)

    def forward(self, batch):
        return self.body(batch["features"])

    def training_step(self, batch, batch_idx):
        return self({"inputs": batch[0]}).mean()

    def train_dataloader(self):
        return DataLoader(TensorDataset(torch.randn(64, 16)), batch_size=self.batch_size)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False,
                     callbacks=[AutotuneBatchSize("max", memory="1MiB")])
trainer.fit(Net())
""",
    ),
    "transformers": (
        "transformers",
        """import torch
import transformers
from torch import nn

from autotune.integrations.transformers import tune_trainer


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 1)

    def forward(self, features, labels):
        return {"loss": self.body({"inputs": features}["features"]).mean()}


data = [{"features": torch.randn(16), "labels": torch.tensor(0.0)} for _ in range(32)]
args = transformers.TrainingArguments(output_dir="out", report_to="none", use_cpu=True, disable_tqdm=True)
trainer = transformers.Trainer(model=Net(), args=args, train_dataset=data)
tune_trainer(trainer, "max", memory="1MiB")
""",
    ),
}


def printed_traceback(script: Path) -> list[str]:
    """Run a job script as a user does; the traceback Python printed for its failure, line by line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
    env.pop("AUTOTUNE_DEBUG", None)
    done = subprocess.run(
        [sys.executable, script.name], cwd=script.parent, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 1, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    return lines[lines.index("Traceback (most recent call last):") :]


@pytest.mark.parametrize("framework", list(SCRIPTS))
def test_a_key_error_in_the_users_forward_prints_their_frames_in_at_most_15_lines(
    framework: str, tmp_path: Path
) -> None:
    needs, code = SCRIPTS[framework]
    pytest.importorskip(needs)
    script = tmp_path / "job.py"
    script.write_text(code)

    printed = printed_traceback(script)

    assert len(printed) <= 15, "\n".join(printed)
    assert printed[1].startswith(f'  File "{script}", line '), printed  # the first frame: the user's script
    raised_at = next(n for n, line in enumerate(code.splitlines(), 1) if '["features"]' in line)
    where = f"job.py:{raised_at} in forward"
    assert printed[-2:] == [
        "KeyError: 'features'",
        f"autotune: batch 4 failed with an error that is not out-of-memory: KeyError: 'features' (at {where})",
    ], printed
    frames = [line for line in printed if line.startswith("  File ")]
    assert frames[-1].endswith("in forward") and str(script) in frames[-1]  # where it was raised
    # autotune's own frames: at most the one the user called (nothing of the search or the trial).
    assert len([f for f in frames if "/autotune/" in f]) <= 1, printed


# In the test's process: what a caller catches ---------------------------------------------------
accelerate = pytest.importorskip("accelerate")


class Padded(Dataset[dict[str, torch.Tensor]]):
    """Token sequences of one length, so that torch's default_collate stacks them; the job's own
    collate_fn would add the `lengths` the loss reads."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"tokens": torch.randint(0, 50, (12,), generator=torch.Generator().manual_seed(i)),
                "label": torch.tensor(i % 2)}  # fmt: skip


class GRU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.gru = nn.GRU(8, 8, batch_first=True)
        self.head = nn.Linear(8, 2)

    def forward(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(tokens), lengths, batch_first=True, enforce_sorted=False)
        return self.head(self.gru(packed)[1][-1])


def gru_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch["tokens"], batch["lengths"]), batch["label"])


@pytest.fixture(autouse=True)
def _fresh_accelerate_state() -> Any:
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_a_dataset_without_collate_names_the_missing_collate_argument() -> None:
    """It named the user's loss only: `KeyError: 'lengths' (at accelerate_gru.py:59 in loss_fn)`."""
    from autotune.integrations.accelerate import tune_accelerator

    model = GRU()
    with pytest.raises(KeyError) as caught:
        tune_accelerator(accelerate.Accelerator(cpu=True), model, torch.optim.SGD, Padded(), "max", loss=gru_loss,
                         memory="1MiB")  # fmt: skip
    notes = caught.value.__notes__
    assert notes[0].startswith("autotune: batch 4 failed with an error that is not out-of-memory: KeyError: 'lengths'")
    assert notes[1] == (
        "autotune: the batches were made by torch's default_collate, since no collate= was given with the Dataset, "
        "and they have no field 'lengths' (their fields: tokens, label): pass collate=, the collate_fn of the job's "
        "DataLoader (or pass the DataLoader)"
    )
    # The error is the user's, as raised in their loss: their frames, one of autotune's (the call).
    frames = traceback.extract_tb(caught.value.__traceback__)
    assert [f.name for f in frames] == ["test_a_dataset_without_collate_names_the_missing_collate_argument",
                                        "tune_accelerator", "gru_loss"]  # fmt: skip


def test_autotunes_own_error_keeps_no_frame_of_autotunes_internals() -> None:
    from autotune.errors import NothingFitsError
    from autotune.integrations.accelerate import tune_accelerator

    model = nn.Sequential(nn.Linear(16, 4096), nn.Linear(4096, 1))
    data = torch.utils.data.TensorDataset(torch.randn(8, 16), torch.randn(8, 1))
    with pytest.raises(NothingFitsError) as caught:
        tune_accelerator(accelerate.Accelerator(cpu=True), model, torch.optim.SGD, data, "max",
                         loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]), memory="64KiB")  # fmt: skip
    printed = traceback.format_exception(caught.value)
    assert [f.name for f in traceback.extract_tb(caught.value.__traceback__)] == [
        "test_autotunes_own_error_keeps_no_frame_of_autotunes_internals",
        "tune_accelerator",
    ]
    assert len("".join(printed).splitlines()) <= 6, "".join(printed)


def test_autotune_debug_keeps_every_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune.errors import NotAnOOMError
    from autotune.integrations.accelerate import tune_accelerator
    from autotune.settings import get_settings

    monkeypatch.setenv("AUTOTUNE_DEBUG", "1")
    get_settings.cache_clear()
    try:
        with pytest.raises(NotAnOOMError) as caught:
            tune_accelerator(accelerate.Accelerator(cpu=True), GRU(), torch.optim.SGD, Padded(), "max",
                             loss=gru_loss, memory="1MiB")  # fmt: skip
    finally:
        get_settings.cache_clear()
    assert isinstance(caught.value.__cause__, KeyError)
    assert "run" in [f.name for f in traceback.extract_tb(caught.value.__traceback__)]  # the trial's frame
