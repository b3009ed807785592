"""Chat data as a data stage (`megalaunch data sft`): rows read and checked (`rows`: conversations,
prompt/response pairs, preference pairs; a bad row is named by its number), rendered with the model's
own chat template with the assistant's spans marked (`render`), and written as a Megatron `.bin/.idx`
dataset with a loss mask and a completion marker (`build`; the format is runtime/flows/chat_format.py,
which the job reads). docs/finetuning.md.

May use: data (the `.bin/.idx` writer), runtime.flows.chat_format, errors."""
