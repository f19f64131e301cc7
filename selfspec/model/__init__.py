"""The model: the adapter over a Hugging Face decoder, the one KV cache, loading and conversion, the lean step, quantization, CUDA graphs and threads."""
