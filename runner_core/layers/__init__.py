"""Building blocks of the models, each tensor-parallel aware (linear, embedding, attention, rotary, norm, activation, sampler)."""
