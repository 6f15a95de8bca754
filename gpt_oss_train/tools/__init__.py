"""Command-line tools, each run as `python -m gpt_oss_train.tools.<name> --help`.

aot_compile         compile the train step for a TPU topology on this machine: fits? how fast?
bench_attention     one attention layer's forward + backward time by back-end
bench_engine        the serving engine on random weights: batching, TTFT, prefix cache
bench_moe_decode    one MoE layer's experts at decode batch sizes, by back-end
benchmark           training steps or decoding on random weights (--compare_hf: transformers)
benchmark_hf        transformers' side of benchmark --compare_hf (run by benchmark, not by hand)
convert_checkpoint  Hugging Face safetensors <-> Orbax checkpoints
export_lora         a LoRA adapter as a PEFT folder, or merged into its base as HF
load_client         load_test's client: concurrent streamed completions and their timings
load_test           our server vs `transformers serve` vs a static batch, same requests
moe_benchmark       the MoE's grouped matmul kernels and expert layer vs a dense matmul
pretokenize         tokenize a corpus once into ArrayRecord shards training reads

aot_compile's step model (libraries, not commands): step_model reads the optimized HLO
through hlo_text (instructions, shapes, replica groups) and hlo_costs (loops, FLOPs,
bytes, collectives).
"""
