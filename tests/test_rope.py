"""position_embedding_type: 'rope' (issue 32's full-attention reference): Megatron's rotary embedding on the
full-attention layers changes the output, the model trains and its weights load back; bad combinations fail."""

import pytest
import torch

from megatron_ext.config import ConfigError, HybridConfig


def _config(**overrides):
    kw = dict(num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, attention_pattern="A",
              vocab_size=64, make_vocab_size_divisible_by=64, max_sequence_length=64, use_cpu_initialization=True,
              fused_cross_entropy=False)
    kw.update(overrides)
    return HybridConfig(**kw)


def _model(config, seed=0):
    from megatron_ext.model import build_model

    torch.manual_seed(seed)
    return build_model(config)


def _batch(b=2, s=48, seed=1):
    tokens = torch.randint(0, 64, (b, s + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], torch.arange(s).expand(b, s), tokens[:, 1:]


def test_rope_changes_the_output_trains_and_loads(one_rank_megatron):
    tokens, pos, labels = _batch()
    nope, rope = _model(_config()), _model(_config(position_embedding_type="rope"))
    assert rope.rotary_pos_emb is not None and getattr(nope, "rotary_pos_emb", None) is None
    rope.load_state_dict(nope.state_dict())  # same weights: RoPE adds no parameters
    with torch.no_grad():
        l_nope, l_rope = (m(tokens, pos, None, labels=labels) for m in (nope, rope))
    assert not torch.allclose(l_nope, l_rope)
    # a causal model without positions cannot tell the first token's place; RoPE does not change position 0
    torch.testing.assert_close(l_nope[:, 0], l_rope[:, 0])
    opt = torch.optim.Adam(rope.parameters(), lr=3e-3)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = rope(tokens, pos, None, labels=labels).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3, losses
    again = _model(_config(position_embedding_type="rope"), seed=5)
    again.load_state_dict(rope.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(again(tokens, pos, None, labels=labels), rope(tokens, pos, None, labels=labels))


def test_rope_in_the_hybrid_model_leaves_kda_layers_alone(one_rank_megatron):
    tokens, pos, labels = _batch(s=40)
    model = _model(_config(attention_pattern="KA", position_embedding_type="rope", kda_head_dim=16))
    with torch.no_grad():
        assert torch.isfinite(model(tokens, pos, None, labels=labels)).all()


@pytest.mark.parametrize("overrides,match", [
    (dict(position_embedding_type="learned_absolute"), "position_embedding_type='learned_absolute'; allowed"),
    (dict(position_embedding_type="rope", attention_pattern="MA"), "MLA layers"),
    (dict(position_embedding_type="rope", rotary_base=1), "rotary_base"),
    (dict(position_embedding_type="rope", kv_channels=7), "even attention head dim"),
])
def test_unsupported_position_settings_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        _config(**overrides)


def test_resuming_with_other_positions_is_refused():
    from megatron_ext.training.checkpoint_compat import check_same_model, model_differences

    assert model_differences({"attention_pattern": "A"}, {"attention_pattern": "A",
                                                          "position_embedding_type": "rope"}) == []  # older saves
    with pytest.raises(ConfigError, match="position_embedding_type: 'none' in the checkpoint, 'rope' now"):
        check_same_model("ckpt", {"position_embedding_type": "none"}, {"position_embedding_type": "rope"})
