"""What one training step computes when it is not plain pre-training: user-defined flows (`flow`), the
worked preference-loss example (`preference_flow`), and chat data, one conversation per sequence
(`chat_dataset`, over the on-disk format of `chat_format`, which `megalaunch data sft` writes), and the built-in post-training flows (`dpo`, docs/post_training.md).

May use: runtime.rank, runtime.scoring."""
