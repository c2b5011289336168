"""attn_res config keys: bad values raise ConfigError naming the key; derived settings."""

import pytest

from megatron_ext.attn_res import sublayers_per_block
from megatron_ext.config import USER_FIELDS, ConfigError
from tests.parallel.harness import tiny_config


@pytest.mark.parametrize(
    "overrides,key",
    [
        (dict(attn_res_num_blocks=3), "attn_res_num_blocks"),  # 8 sublayers
        (dict(attn_res_num_blocks=0), "attn_res_num_blocks"),
        (dict(attn_res_num_blocks=16), "attn_res_num_blocks"),
        (dict(attn_res_block_size=3), "attn_res_block_size"),
        (dict(attn_res_block_size=0), "attn_res_block_size"),
        (dict(attn_res_impl="cuda"), "attn_res_impl"),
        (dict(attn_res_inplace_source_grads="yes"), "attn_res_inplace_source_grads"),
        (dict(attn_res_fuse_norm=1), "attn_res_fuse_norm"),
        (dict(attn_res_pair_backward="on"), "attn_res_pair_backward"),
        (dict(attn_res="yes"), "attn_res"),
        (dict(recompute_granularity="selective"), "recompute_granularity"),
    ],
)
def test_bad_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}="):
        tiny_config({}, False, **{"attn_res": True, **overrides})


def test_block_size_and_pipeline_fields():
    assert sublayers_per_block(tiny_config({}, False, attn_res=True)) == 1  # N = 8 = 2L: Full
    assert sublayers_per_block(tiny_config({}, False, attn_res=True, attn_res_num_blocks=2)) == 4
    assert sublayers_per_block(tiny_config({}, False, attn_res=True, attn_res_block_size=2)) == 2
    pp = dict(pipeline_model_parallel_size=2)
    assert tiny_config(pp, False, attn_res=True).variable_seq_lengths is True
    assert tiny_config(pp, False).variable_seq_lengths is False
    # Off: the block-count default need not fit the model.
    tiny_config({}, False, num_layers=2, attn_res_num_blocks=3)
    fields = {"attn_res", "attn_res_num_blocks", "attn_res_block_size", "attn_res_impl", "attn_res_inplace_source_grads",
              "attn_res_fuse_norm", "attn_res_pair_backward"}
    assert fields <= set(USER_FIELDS)
