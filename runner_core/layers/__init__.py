"""Building blocks of the models, each tensor-parallel aware: linear, embedding, attention (with the
forward context), rotary, norm, activation, fused MoE experts (with their routing record), and the sampler."""
