"""Predictions from a recipe and the hardware: the memory per GPU (`memory`), a checkpoint's bytes
(`checkpoint_size`), the GPUs' figures (`gpus`), the step time of a layout and the ranked layouts
(`plan`), and the fit of the speed model's constants to measured runs (`fit`).

May use: the rest of config, rundir."""
