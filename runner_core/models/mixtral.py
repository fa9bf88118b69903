"""Mixtral: the Llama/Mistral decoder with a sparse block of `num_local_experts` experts in every
layer (softmax -> top-`num_experts_per_tok` -> renormalise), on the runner's fused experts."""

from __future__ import annotations

from torch import nn

from runner_core.models.llama import LlamaDecoderLayer
from runner_core.models.moe import MoEForCausalLM


class MixtralForCausalLM(MoEForCausalLM):
    def make_layer(self, config, layer_index: int) -> nn.Module:
        return LlamaDecoderLayer(config, mlp=self.moe_block(config, layer_index))
