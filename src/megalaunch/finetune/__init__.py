"""Fine-tuning: chat data rendered with the model's own chat template and tokenized with a loss mask
over the assistant's tokens (`megalaunch data sft`), the dataset that trains on it inside Megatron's
loop, and user-defined training flows (docs/finetuning.md)."""
