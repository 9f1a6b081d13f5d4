"""Quantized safetensors checkpoints (compressed-tensors, fp8, GPTQ, AWQ): `spec` reads the
config's `quantization_config`, `formats` reads each linear into a canonical weight,
`checkpoint` streams the de-quantized weights to the loader, `serve` swaps in the native
quantized linears (`--quantization auto`). GGUF files are `models/gguf_weights.py` and
`platforms/cpu_quant.py`."""
