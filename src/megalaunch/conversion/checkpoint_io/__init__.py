"""Reading and writing the two checkpoint formats as streams, one tensor at a time: safetensors
(`safetensors_io`), Megatron-core's torch_dist through dist_checkpointing (`mcore_io` reads and lays out
directories, `mcore_save` writes), under a byte budget for the data in flight (`scheduler`), with a
byte-counting progress bar (`progress`).

May use: conversion.errors, rundir."""
