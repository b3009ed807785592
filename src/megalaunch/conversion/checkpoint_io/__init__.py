"""Reading and writing the two checkpoint formats as streams, one tensor at a time: safetensors
(`safetensors_io`) and Megatron-core's torch_dist: its directories, tracker and completeness
(`mcore_layout`), dist_checkpointing in one process (`mcore_dist`: the process group, metadata, common
state, requested chunks), direct reads of the chunks into caller buffers (`mcore_direct`) and the
streaming save (`mcore_save`), under a byte budget for the data in flight (`scheduler`), with a
byte-counting progress bar (`progress`).

May use: conversion.errors, rundir."""
