"""The policy: where its weights come from, the 4-bit base + LoRA, and the engine that samples from it
(dense merged sampler weights, a slot KV cache, a lean decode step, continuous batching)."""
