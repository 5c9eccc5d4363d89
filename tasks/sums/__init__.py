"""`sums`: add two numbers and reply with the sum alone: the first run, a paired gain within minutes on a CPU."""
