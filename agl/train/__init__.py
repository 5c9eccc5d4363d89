"""From spans to an update: samples, pure losses, fused log-probs, micro-batches, the GRPO and SFT
updates and trainers, exact resume, and activation checkpointing."""
