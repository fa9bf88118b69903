"""Qwen2-MoE and Qwen3-MoE: sparse blocks at the layers `mlp_only_layers` / `decoder_sparse_step`
leave sparse (a dense MLP of `intermediate_size` elsewhere), top-k renormalised only with
`norm_topk_prob`. Qwen2-MoE has qkv bias and a sigmoid-gated shared expert; Qwen3-MoE has Qwen3's
per-head q/k RMSNorm and no shared expert."""

from __future__ import annotations

from torch import nn

from runner_core.models.llama import LlamaDecoderLayer
from runner_core.models.moe import MoEForCausalLM


class Qwen2MoeForCausalLM(MoEForCausalLM):
    def make_layer(self, config, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(config, mlp=self.moe_block(config, layer_index))


class Qwen3MoeForCausalLM(MoEForCausalLM):
    def make_layer(self, config, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(config, qk_norm=True, mlp=self.moe_block(config, layer_index))
