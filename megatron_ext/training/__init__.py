"""Training infrastructure: config loading, checkpointing, metrics logging.

Kept import-light on purpose: import the submodule you need
(``megatron_ext.training.arguments`` pulls in nothing heavier than PyYAML).
"""
