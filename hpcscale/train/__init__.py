"""The reference GPT trainer: the built-in entry point that exercises every layer of hpcscale."""
