"""The rows of the end-to-end benchmark (``tools/bench_e2e.py``, whose docstring describes them): their names
(``NAME[+OPTION...]``), sizes, configs and model builds."""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn.functional as F

VARIANTS = ("stock", "ours_base", "ours_full", "ours_base_16k", "ours_full_16k")
ROW_OPTIONS = ("eager", "torch-rounds", "no-attnres")  # ``+OPTION`` of an ours_full row: bench_e2e.py's docstring
GPU_SIZES = dict(
    model=dict(num_layers=8, hidden_size=2048, num_attention_heads=16, num_moe_experts=64,
               moe_router_topk=8, moe_ffn_hidden_size=1024),
    vocab=32768, seq=4096, long_seq=16384, micro_batch=2, long_micro_batch=1, attn_res_blocks=8,
    steps=10, warmup=3, matmul=8192)
SMOKE_SIZES = dict(
    model=dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_moe_experts=8,
               moe_router_topk=2, moe_ffn_hidden_size=32),
    vocab=256, seq=64, long_seq=128, micro_batch=2, long_micro_batch=1, attn_res_blocks=4,
    steps=2, warmup=1, matmul=256)
CAPACITY_FACTOR = 1.25
STOCK_AUX_LOSS = 1e-2


def split_variant(name: str) -> tuple[str, frozenset[str]]:
    """``base[+option...]`` -> (base row, its options)."""
    base, *options = name.split("+")
    return base, frozenset(options)


def variant_problem(name: str) -> str | None:
    """Why ``name`` is not a row this script knows (None when it is)."""
    base, options = split_variant(name)
    if base not in VARIANTS:
        return f"unknown row {base!r}; known: {', '.join(VARIANTS)}"
    unknown = sorted(options - set(ROW_OPTIONS))
    if unknown:
        return f"unknown option {'+' + unknown[0]!r}; known: {', '.join('+' + o for o in ROW_OPTIONS)}"
    if options and not base.startswith("ours_full"):
        return "+options apply to the ours_full rows (capacity routing, AttnRes) only"
    return None


def qb_rounds_impl(name: str) -> str | None:
    """``moe_qb_rounds_impl`` of a row: "torch" for ``+torch-rounds`` (the one-rank routing rounds as PyTorch ops
    instead of the Triton kernels), else None (HybridConfig's default)."""
    return "torch" if "torch-rounds" in split_variant(name)[1] else None


def variant_shape(name: str, sizes: dict) -> tuple[int, int]:
    """(sequence length, micro-batch) of a variant."""
    if split_variant(name)[0].endswith("_16k"):
        return sizes["long_seq"], sizes["long_micro_batch"]
    return sizes["seq"], sizes["micro_batch"]


def _dtype(cuda: bool) -> torch.dtype:
    return torch.bfloat16 if cuda else torch.float32  # bf16 weights as launch/train.py builds them


def ours_config(sizes: dict, seq: int, techniques: bool, cuda: bool, qb_device_rounds: int | None = None,
                qb_host_reads: bool | None = None, qb_cuda_graph: bool = False, attn_res: bool = True,
                qb_rounds_impl: str | None = None):
    """Our ``HybridConfig``: plain (full attention, top-k) or with KDA 3:1, qb_both and AttnRes (unless
    ``attn_res`` is False)."""
    from megatron_ext.config import HybridConfig

    model = sizes["model"]
    extra = dict(
        attention_pattern="KKKA", kda_head_dim=model["hidden_size"] // model["num_attention_heads"],
        moe_balancer="qb_both", moe_expert_capacity_factor=CAPACITY_FACTOR,
        attn_res=attn_res, attn_res_num_blocks=sizes["attn_res_blocks"],
    ) if techniques else dict(attention_pattern="A", moe_balancer="none")
    if techniques and qb_device_rounds is not None:
        extra["moe_qb_device_rounds"] = qb_device_rounds
    if techniques and qb_host_reads is not None:
        extra["moe_qb_host_reads"] = qb_host_reads
    if techniques and qb_cuda_graph:
        extra["moe_qb_cuda_graph"] = True
    if techniques and qb_rounds_impl is not None:
        extra["moe_qb_rounds_impl"] = qb_rounds_impl
    return HybridConfig(
        **model, num_query_groups=model["num_attention_heads"], vocab_size=sizes["vocab"],
        max_sequence_length=seq, expert_model_parallel_size=dist.get_world_size(),
        bf16=cuda, params_dtype=_dtype(cuda), pipeline_dtype=_dtype(cuda),
        use_cpu_initialization=not cuda, **extra)


def stock_config(sizes: dict, cuda: bool):
    """Megatron's ``TransformerConfig`` with the same dimensions; no Apex/TE fusions exist here."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    model = sizes["model"]
    return TransformerConfig(
        **model, num_query_groups=model["num_attention_heads"], normalization="RMSNorm",
        gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        hidden_dropout=0.0, attention_dropout=0.0,
        moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=STOCK_AUX_LOSS,
        moe_token_dispatcher_type="alltoall", moe_grouped_gemm=False,
        expert_model_parallel_size=dist.get_world_size(), expert_tensor_parallel_size=1,
        bf16=cuda, params_dtype=_dtype(cuda), pipeline_dtype=_dtype(cuda),
        use_cpu_initialization=not cuda, gradient_accumulation_fusion=False, masked_softmax_fusion=False,
        bias_activation_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        apply_rope_fusion=False)


def build_stock_chunks(config, sizes: dict, seq: int, attention: str) -> list:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    if attention == "sdpa":
        from megatron_ext.layers.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=sizes["vocab"],
                     max_sequence_length=seq, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    return [model.cuda(torch.cuda.current_device()) if torch.cuda.is_available() else model]


def routing_layout(name: str, args, cuda: bool) -> tuple[bool | None, bool]:
    """(moe_qb_host_reads, moe_qb_cuda_graph) of an ours_full row: see the module docstring."""
    if "eager" in split_variant(name)[1]:
        return None, False
    graphed = args.qb_cuda_graph == "on" or (args.qb_cuda_graph == "auto" and cuda and dist.get_world_size() == 1
                                              and args.qb_host_reads is not True)
    return (False if graphed else args.qb_host_reads), graphed


def variant_setup(name: str, args, cuda: bool):
    """(build_chunks, config, after_step, flops_config, seq, micro_batch) of one variant."""
    from megatron.core import parallel_state as ps

    from megatron_ext.moe.router import update_expert_biases
    from megatron_ext.parallel import build_model_chunks

    sizes = args.sizes
    seq, micro_batch = variant_shape(name, sizes)
    row_base, options = split_variant(name)
    base = ours_config(sizes, seq, techniques=False, cuda=cuda)
    if row_base == "stock":
        config = stock_config(sizes, cuda)
        return (lambda: build_stock_chunks(config, sizes, seq, args.stock_attention),
                config, None, base, seq, micro_batch)
    host_reads, graphed = routing_layout(name, args, cuda)
    config = ours_config(sizes, seq, techniques=row_base.startswith("ours_full"), cuda=cuda,
                         qb_device_rounds=args.qb_device_rounds, qb_host_reads=host_reads, qb_cuda_graph=graphed,
                         attn_res="no-attnres" not in options, qb_rounds_impl=qb_rounds_impl(name))
    bias_group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)

    def after_step(chunks):  # once per optimizer step, as launch/train.py does
        update_expert_biases(chunks, bias_group)

    return lambda: build_model_chunks(config), config, after_step, config, seq, micro_batch
