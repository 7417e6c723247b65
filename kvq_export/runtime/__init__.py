"""Drive an export directory on ONNX Runtime: quantized cache kept between steps, prefill + decode."""
