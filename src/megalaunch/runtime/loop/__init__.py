"""Where megalaunch meets Megatron's training loop: the seams that plug the rooms into it
(`megatron_seams`), megalaunch's other changes to Megatron, start-up speed-ups and 0.19.2 fixes
(`megatron_patches`), the checkpoint writer's pinned staging (`save_staging`) and the threaded
checkpoint read (`parallel_load`), and Megatron's side of one step (`step`: the argument list, the
datasets, the forward step). Everything that touches Megatron's private names lives here.

May use: runtime.rank, runtime.stop, runtime.model, runtime.flows."""
