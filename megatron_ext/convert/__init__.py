"""Checkpoint conversion between our Megatron dist checkpoints and Hugging Face's Kimi Linear format
(``tools/convert_checkpoint.py``; docs/convert.md)."""
