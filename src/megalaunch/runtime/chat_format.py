"""The on-disk format of chat data, shared by its writer (`megalaunch data sft`, finetune/build.py),
preflight and its reader in the job (runtime/chat_dataset.py): a Megatron `.bin/.idx` token dataset,
one conversation per document, and beside it `<prefix>.mask`, one byte per token (1: an assistant's
token, trained on; 0: context)."""

MASK_SUFFIX = ".mask"
