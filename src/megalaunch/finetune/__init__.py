"""Fine-tuning in one command (`megalaunch submit RECIPE --from-hf MODEL_DIR --data SFT_DIR`): at submit,
on the login node, read the model directory's config.json (plain JSON: no transformers or torch) into the
recipe's model shape, tokenizer and starting weights (`model_dir`), and tell prepared SFT data from chat
files that the chain's first stage tokenizes (`data_dir`); `layers` hands both to the recipe loader as
values under `--set`. May use conversion (the config.json mapping) and everything below it."""
