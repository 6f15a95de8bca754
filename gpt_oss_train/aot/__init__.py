"""Ahead-of-time compiles for a TPU slice from a machine with no TPU: whether a program
fits in the chips' memory and how fast it would run, known before a pod is booked. The
commands over it are tools/aot_compile.py and tools/maxtext_compile.py.

check          compile a program (train step, engine decode / prefill, GRPO) and the verdict
tpu            compile-only TPU devices from libtpu, and the compiler each result records
train_step     train.py's step from the one state builder, and the state's own figures
serving        the serving engine's decode step and prefill chunk
grpo           a GRPO step: the learner and the rollout engine, both phases' memory
compiled_step  what a compiled program says: XLA's memory, cost analysis, the step model
step_model     a step-time account of optimized HLO: FLOPs, HBM bytes, collectives
hlo_costs      what each HLO instruction costs: loops, FLOPs, bytes, collectives
hlo_text       optimized HLO text parsed: computations, shapes, replica groups
maxtext        MaxText's train step compiled and read through the same step model
report         the results as text, and the JSON beside it
"""
