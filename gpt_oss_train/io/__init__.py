"""Files in and out: Hugging Face folders, MXFP4, safetensors, the tokenizer."""
