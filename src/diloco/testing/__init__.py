"""What tests and benchmarks share that is not the product: the loopback Hugging Face Hub."""
