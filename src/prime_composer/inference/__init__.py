"""OpenAI-compatible inference serving: the embedded ``hf`` backend (transformers, CPU or GPU,
continuous batching with a KV cache) and weight updates from the trainer's broadcasts."""
