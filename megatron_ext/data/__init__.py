"""Training data: tokenizers, the stdlib corpus, Megatron indexed datasets, resumable sampling.

Entry point: ``megatron_ext.data.build.build_data_iterators(data_cfg, ...)``.
"""
