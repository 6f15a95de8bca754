"""Command-line tools, each run as `python -m gpt_oss_train.tools.<name> --help`.

aot_compile         compile the train step for a TPU topology on this machine: fits? how fast?
maxtext_compile     MaxText's train step for the same slice, read by the same step model
bench_attention     one attention layer's forward + backward time by back-end
bench_engine        the serving engine on random weights: batching, TTFT, prefix cache
bench_grpo_vs_trl   our GRPO against TRL's GRPOTrainer: same model, prompts and reward
bench_model         training steps or decoding on random weights (--compare_hf: transformers)
bench_model_hf      transformers' side of bench_model --compare_hf (run by it, not by hand)
bench_moe           the MoE's grouped matmul kernels, expert layer and decode paths vs a
                    dense matmul; the decode expert kernels by back-end (--mode)
bench_rounds        what a multi-host engine pays to send each serving round to its peers
bench_serve         our server vs `transformers serve` vs a static batch, same requests
bench_serve_client  bench_serve's client: concurrent streamed completions and their timings
convert_checkpoint  Hugging Face safetensors <-> Orbax checkpoints
export_lora         a LoRA adapter as a PEFT folder, or merged into its base as HF
gpu_suite           every GPU measurement in one budgeted run (--dry_run: tiny, on a CPU);
                    gpu_suite_steps and gpu_suite_report are its parts
pretokenize         tokenize a corpus once into ArrayRecord shards training reads

The ahead-of-time compile, the step model and their report are a library,
gpt_oss_train.aot; aot_compile and maxtext_compile are its commands.
"""
