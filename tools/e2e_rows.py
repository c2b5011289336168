"""The rows of the end-to-end benchmark (``tools/bench_e2e.py``, whose docstring describes them): their names
(``NAME[+OPTION...]``), sizes, configs and model builds.

The ours rows' configs go through launch/train.py's own config loading (``load_config`` with its
``model_section``, then ``validate_layout``): a row is the config keys it sets (:func:`row_config_keys`, the
names a YAML file uses) and everything else is what training defaults to."""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F

VARIANTS = ("stock", "stock_sdpa", "ours_base", "ours_full", "ours_base_16k", "ours_full_16k")
# ``+OPTION`` of an ours row -> the config keys it sets on top of the row's (bench_e2e.py's docstring).
OPTION_KEYS = {
    "host-reads": {"moe_qb_host_reads": True, "moe_qb_cuda_graph": False},
    "torch-rounds": {"moe_qb_rounds_impl": "torch"},
    "no-attnres": {"attn_res": False},
    "qb-bias": {"moe_balancer": "qb_bias", "moe_expert_capacity_factor": None},
    "rounds-6": {"moe_qb_device_rounds": 6},
    "step-graph": {"cuda_graph_step": True},
}
# The rows each option applies to (by name prefix): the capacity-routing and AttnRes options need ours_full.
OPTION_ROWS = {"host-reads": "ours_full", "torch-rounds": "ours_full", "no-attnres": "ours_full",
               "qb-bias": "ours_full", "rounds-6": "ours_full", "step-graph": "ours"}
ROW_OPTIONS = tuple(OPTION_KEYS)
STOCK_ATTENTION = {"stock": "DotProductAttention", "stock_sdpa": "SDPA"}  # stock rows -> core attention
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


def variant_problem(name: str, cuda: bool = True) -> str | None:
    """Why ``name`` is not a row this script can run (None when it can), on CUDA or the CPU."""
    base, options = split_variant(name)
    if base not in VARIANTS:
        return f"unknown row {base!r}; known: {', '.join(VARIANTS)}"
    unknown = sorted(options - set(ROW_OPTIONS))
    if unknown:
        return f"unknown option {'+' + unknown[0]!r}; known: {', '.join('+' + o for o in ROW_OPTIONS)}"
    for option in sorted(options):
        if not base.startswith(OPTION_ROWS[option]):
            return f"+{option} applies to the {OPTION_ROWS[option]}* rows only"
    if "step-graph" in options and not cuda:
        return "+step-graph replays the step from a CUDA graph: it needs a CUDA GPU, not --smoke"
    return None


def variant_shape(name: str, sizes: dict) -> tuple[int, int]:
    """(sequence length, micro-batch) of a variant."""
    if split_variant(name)[0].endswith("_16k"):
        return sizes["long_seq"], sizes["long_micro_batch"]
    return sizes["seq"], sizes["micro_batch"]


def _dtype(cuda: bool) -> torch.dtype:
    return torch.bfloat16 if cuda else torch.float32  # bf16 weights as launch/train.py builds them


def row_config_keys(name: str, sizes: dict) -> dict:
    """The model keys an ours row sets (launch/train.py's YAML names); training's defaults do the rest.
    ``ours_base``: the dimensions only (full attention, plain top-k: HybridConfig's defaults); ``ours_full``: KDA
    3:1, qb_both with capacity factor 1.25, Block AttnRes; each ``+option`` adds its :data:`OPTION_KEYS`."""
    base, options = split_variant(name)
    model = sizes["model"]
    keys = {**model, "vocab_size": sizes["vocab"]}
    if base.startswith("ours_full"):
        keys.update(attention_pattern="KKKA", kda_head_dim=model["hidden_size"] // model["num_attention_heads"],
                    moe_balancer="qb_both", moe_expert_capacity_factor=CAPACITY_FACTOR,
                    attn_res=True, attn_res_num_blocks=sizes["attn_res_blocks"])
    for option in sorted(options):
        keys.update(OPTION_KEYS[option])
    return keys


def as_flags(keys: dict) -> list[str]:
    """Config keys as launch/train.py's command-line flags (``--moe-qb-host-reads=false``)."""
    def text(value) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return [f"--{key.replace('_', '-')}={text(value)}" for key, value in keys.items()]


def ours_config(name: str, sizes: dict, cuda: bool):
    """The ``HybridConfig`` launch/train.py builds for the row's keys, its shape (``seq_length``,
    ``micro_batch_size``), bf16 on the GPU and EP = world size."""
    from launch.train import model_section
    from megatron_ext.config import HybridConfig
    from megatron_ext.parallel import validate_layout
    from megatron_ext.training.arguments import TRAINING_SECTIONS, load_config

    seq, micro_batch = variant_shape(name, sizes)
    world = dist.get_world_size()
    shape = dict(seq_length=seq, micro_batch_size=micro_batch, bf16=cuda, expert_model_parallel_size=world)
    loaded = load_config([*TRAINING_SECTIONS, model_section()], as_flags({**shape, **row_config_keys(name, sizes)}),
                         world_size=world)
    config = loaded[HybridConfig]
    validate_layout(config, world)
    from megatron_ext.training.sections import TrainingConfig
    from megatron_ext.training.step_graph import check_step_graph

    check_step_graph(loaded[TrainingConfig].cuda_graph_step, config, world, cuda)
    return config


def has_capacity_routing(config) -> bool:
    """Whether the row's balancer drops or reroutes pairs (capacity routing: qb_capacity, qb_both)."""
    from megatron_ext.moe.balancers import CAPACITY_BALANCERS

    return getattr(config, "moe_balancer", None) in CAPACITY_BALANCERS


class CapacityCounters:
    """Dropped and rerouted (token, slot) pairs of the timed steps over every MoE layer and the global batch, read
    through training's ``collect_moe_metrics`` (keys ``moe/dropped``, ``moe/rerouted``). The routers' step sums
    accumulate until reset, so they are reset after the warm-up and read once after the timed steps: no host
    read or collective inside them (training instead reads or zeroes them every step)."""

    def __init__(self, bias_group):
        self.bias_group = bias_group

    def reset(self, chunks) -> None:
        from megatron_ext.moe.metrics import reset_moe_step_statistics

        reset_moe_step_statistics(chunks)

    def read(self, chunks) -> dict:
        from megatron.core import parallel_state as ps

        from megatron_ext.moe.metrics import collect_moe_metrics

        scalars = collect_moe_metrics(chunks, ps.get_expert_model_parallel_group(), dp_group=self.bias_group,
                                      pp_group=ps.get_pipeline_model_parallel_group()).scalars()
        return {"dropped": int(scalars["moe/dropped"]), "rerouted": int(scalars["moe/rerouted"])}


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
    """Megatron-Core's local-spec ``GPTModel``; ``attention`` (:data:`STOCK_ATTENTION`): its core attention."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=False,
                                    normalization="RMSNorm")
    if attention == "SDPA":
        from megatron_ext.layers.attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=sizes["vocab"],
                     max_sequence_length=seq, share_embeddings_and_output_weights=False,
                     position_embedding_type="rope")
    return [model.cuda(torch.cuda.current_device()) if torch.cuda.is_available() else model]


def capacity_layout(config, cuda: bool, ep_group) -> dict:
    """``qb_host_reads`` / ``qb_cuda_graph`` as the routers resolve the row's settings (None: per device) on its
    device and EP group (``CapacityRouting.place``)."""
    from megatron_ext.moe.quantile_capacity import CapacityRouting

    routing = CapacityRouting(config.moe_router_topk, config.moe_expert_capacity_factor, group=ep_group,
                              host_reads=config.moe_qb_host_reads, cuda_graph=config.moe_qb_cuda_graph,
                              rounds=config.moe_qb_rounds_impl, device="cuda" if cuda else "cpu")
    return {"qb_host_reads": routing.reads, "qb_cuda_graph": routing.graphs is not None}


class RowSetup(NamedTuple):
    build: Callable[[], list]  # the model chunks
    config: object  # HybridConfig (ours) or TransformerConfig (stock)
    after_step: Callable[[list], None] | None  # once per optimizer step (router biases)
    flops_config: object  # what megatron_ext/flops.py counts
    seq: int
    micro_batch: int
    counters: CapacityCounters | None  # capacity rows: dropped / rerouted pairs
    config_keys: dict | None  # ours rows: the keys set (launch/train.py's names); the rest is training's default
    step_graph: bool = False  # forward and backward replayed from a CUDA graph (cuda_graph_step)


def variant_setup(name: str, args, cuda: bool) -> RowSetup:
    """Everything one row needs to build and time its training step."""
    from megatron.core import parallel_state as ps

    from megatron_ext.moe.router import update_expert_biases
    from megatron_ext.parallel import build_model_chunks

    sizes = args.sizes
    seq, micro_batch = variant_shape(name, sizes)
    row_base = split_variant(name)[0]
    if row_base in STOCK_ATTENTION:
        config = stock_config(sizes, cuda)
        build = lambda: build_stock_chunks(config, sizes, seq, STOCK_ATTENTION[row_base])  # noqa: E731
        flops = ours_config("ours_base", sizes, cuda)  # same layers and shape as ours_base: the same formula
        return RowSetup(build, config, None, flops, seq, micro_batch, None, None)
    config = ours_config(name, sizes, cuda)
    bias_group = ps.get_tensor_and_data_parallel_group(with_context_parallel=True)

    def after_step(chunks):  # once per optimizer step, as launch/train.py does
        update_expert_biases(chunks, bias_group)

    counters = CapacityCounters(bias_group) if has_capacity_routing(config) else None
    keys = row_config_keys(name, sizes)
    # the row's cuda_graph_step key (training's default: off)
    return RowSetup(lambda: build_model_chunks(config), config, after_step, config, seq, micro_batch, counters,
                    keys, keys.get("cuda_graph_step", False))
