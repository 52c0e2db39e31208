"""The Hugging Face Trainer, tuned by autotune: a tiny GPT-2 from its config on synthetic token
sequences of unequal lengths. Without a GPU the probe runs on the CPU budget device
(AUTOTUNE_CPU_MEMORY bytes). The autotune lines are the ones docs/frameworks.md shows."""

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from autotune.integrations.transformers import tune_trainer


def collate(examples: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
    """Pad to the longest sequence; padding is masked out of the loss."""
    longest = max(len(e["input_ids"]) for e in examples)
    ids = torch.zeros(len(examples), longest, dtype=torch.long)
    labels = torch.full_like(ids, -100)
    for row, example in enumerate(examples):
        ids[row, : len(example["input_ids"])] = torch.tensor(example["input_ids"])
        labels[row, : len(example["input_ids"])] = ids[row, : len(example["input_ids"])]
    return {"input_ids": ids, "labels": labels, "attention_mask": (labels != -100).long()}


torch.manual_seed(0)
lengths = torch.randint(8, 48, (256,)).tolist()
dataset = [{"input_ids": torch.randint(0, 128, (n,)).tolist()} for n in lengths]
model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=64))
args = TrainingArguments(
    output_dir=tempfile.mkdtemp(), max_steps=3, report_to="none", save_strategy="no", logging_strategy="no",
    per_device_train_batch_size=8, gradient_accumulation_steps=8, use_cpu=not torch.cuda.is_available(),
)  # fmt: skip
trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate)

tune_trainer(trainer)  # keeps the effective batch 8 x 8 = 64: sets the batch size and accumulation that fit
trainer.train()

print(trainer.autotune_result.plan.micro_batches, trainer.state.global_step)
