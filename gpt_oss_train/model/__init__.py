"""The network: transformer, attention and MoE back-ends, embedding, quantization."""
