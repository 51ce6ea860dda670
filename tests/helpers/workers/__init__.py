"""Scripts the tests run under torchrun (each rank a fresh interpreter, as the host frameworks' launchers start
them): Hugging Face Trainer, Accelerate, TRL and DeepSpeed runs on tiny models. They import `helpers.workers...`
through PYTHONPATH, which helpers.plugin puts tests/ on for every process the tests start."""
