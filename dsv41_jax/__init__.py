"""DeepSeek-V4.1 (Flash) inference in JAX/Flax NNX."""
