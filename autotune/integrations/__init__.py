"""autotune inside the training frameworks: each module probes a framework's own loop with the job's
objects and sets the framework's batch size and accumulation.

    autotune.integrations.transformers   tune_trainer(trainer, effective_batch)      (Hugging Face Trainer)
    autotune.integrations.lightning      AutotuneBatchSize(effective_batch) callback (PyTorch Lightning)
    autotune.integrations.accelerate     tune_accelerator(accelerator, ...)          (Accelerate)

Each module imports its framework; install the extra of the same name (`autotune[transformers]`...).
"""
