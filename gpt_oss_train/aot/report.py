"""The AOT check's results as text, for a person deciding whether to book a pod: the
target and compiler, the memory per chip XLA will allocate, the step model's account
(FLOPs, HBM bytes, collectives, custom calls, the step time they imply) and the verdict.
Apart from the compile (check.py) so that a result stays a plain dict a script reads as
JSON, and this text is one reading of it; the same reading serves our train step, the
engine's programs, a GRPO step's two phases, and MaxText's step (maxtext.py)."""

from __future__ import annotations

import json
import re
import sys
import textwrap

GiB = 2**30


def text(r: dict) -> str:
    """The report of what check.run returned, for any program."""
    if "learner" in r:
        engine = [engine_program(r["decode"]), engine_program(r["prefill"])]
        parts = [train_step(r["learner"]), *engine]
        hbm = r["learner"]["hbm_bytes"]
        return "\n\n".join(parts + ["\n".join(_grpo_lines(r, hbm))])
    return engine_program(r) if "program" in r else train_step(r)


def train_step(r: dict) -> str:
    """train.py's step (or a GRPO run's learner): setup, memory, step model, verdict."""
    lines = _setup_lines(r) + _compiled_lines(r)
    if r.get("step_model"):
        lines += _step_lines(r)
    elif r.get("step_model_error"):
        lines.append(f"step model  could not read the program: {r['step_model_error']}")
    if r.get("top_arguments"):
        lines.append("largest arguments per device (state, frozen base):")
        lines += ["  " + row for row in r["top_arguments"]]
    lines += _buffer_lines(r) + [_verdict_line(r)]
    return "\n".join(lines)


def engine_program(r: dict) -> str:
    """An engine program's report: as the train step's, with its own setup lines."""
    lines = _engine_setup_lines(r) + _compiled_lines(r)
    if r.get("step_model"):
        lines += _step_lines(r) + _decode_line(r)
    elif r.get("step_model_error"):
        lines.append(f"step model  could not read the program: {r['step_model_error']}")
    lines += _buffer_lines(r) + [_verdict_line(r)]
    return "\n".join(lines)


def maxtext(r: dict) -> str:
    """MaxText's step (maxtext.account's result), read as ours are."""
    lines = [
        f"target      {r['devices']} x {r['device_kind']} ({r['topology']}), mesh {r['mesh']}",
        f"compiler    libtpu {r['libtpu_version']}",
        f"program     MaxText's train step, {r['tokens_per_step']} tokens/step",
    ] + _compiled_lines(r)
    if r.get("step_model"):
        lines += _step_lines(r)
    lines.append(_verdict_line(r))
    return "\n".join(lines)


def emit(r: dict, report_text: str, json_flag: str) -> None:
    """The report, then the result as one JSON line (and to the --json file). --json=-:
    stdout is only that JSON object, for scripts; the report goes to stderr."""
    print(report_text, file=sys.stderr if json_flag == "-" else sys.stdout)
    print(json.dumps(r, default=str), flush=True)
    if json_flag and json_flag != "-":
        with open(json_flag, "w") as out:
            json.dump(r, out, indent=2, default=str)


# ----------------------------------------------------------------------------- the lines


def _setup_lines(r: dict) -> list[str]:
    """The target, compiler, model, timings and state sizes: known even when XLA failed."""
    lines = [
        f"target      {r['devices']} x {r['device_kind']} ({r['topology']}"
        + (f" x {r['num_slices']} slices" if r["num_slices"] > 1 else "")
        + f"), mesh {r['mesh']}",
        f"compiler    libtpu {r['libtpu_version']}"
        + (f", LIBTPU_INIT_ARGS={r['libtpu_init_args']}" if r["libtpu_init_args"] else ""),
        f"model       {r['params_total'] / 1e9:.2f}B params ({r['params_active'] / 1e9:.2f}B "
        f"active), {r['tokens_per_step']} tokens/step",
        f"time        lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s",
        f"state       params + optimizer state {r['state_bytes_per_device'] / GiB:.2f} GiB per "
        f"device ({r['state_bytes_even_split'] / GiB:.2f} GiB if split evenly over "
        f"{' x '.join(r['state_split_axes']) or 'nothing'})",
    ]
    if r.get("frozen_format"):
        lines.append(
            f"frozen base {r['frozen_bytes_per_device'] / GiB:.2f} GiB per device "
            f"({r['frozen_format']}; an argument of the step, not donated); "
            f"{r['params_trainable'] / 1e6:.1f}M adapter params train"
        )
    excess = r["state_bytes_per_device"] - r["state_bytes_even_split"]
    if excess > 0.5 * r["state_bytes_even_split"] and excess > 2**26:
        lines.append(
            "            (some weights are replicated over one of those axes: see "
            "logical_axis_rules, and sharding.fit_spec for dims an axis does not divide)"
        )
    return lines


def _compiled_lines(r: dict) -> list[str]:
    """XLA's error, or the compiled step's memory per device and its flops."""
    if r["error"]:
        return [f"XLA         {r['error']}"]
    g = lambda b: f"{b / GiB:8.2f} GiB"
    hbm = r["hbm_bytes"]
    lines = [
        "memory per device:",
        f"  arguments {g(r['arguments_bytes'])}   "
        + (
            "weights, KV cache, inputs"
            if "program" in r
            else "params, optimizer state, batch"
            + (", frozen base" if r.get("frozen_format") else "")
        ),
        f"  outputs   {g(r['outputs_bytes'])}   of which {r['aliased_bytes'] / GiB:.2f} GiB "
        "reuse the donated arguments",
        f"  temps     {g(r['temp_bytes'])}   activations, "
        + (
            "decoded or gathered weights, copies"
            if "program" in r
            else "gradients, gathered weights"
        ),
        f"  code      {g(r['code_bytes'])}",
        f"  peak      {g(r['peak_bytes'])}   XLA's peak of the buffers live at once",
        f"  total     {g(r['total_bytes'])}   arguments + outputs - reused + temps + code"
        + (f" = {100 * r['total_bytes'] / hbm:.0f}% of {hbm / GiB:g} GiB" if hbm else ""),
    ]
    model, flops = r["model_flops_per_device"], r["compiled_flops_per_device"]
    lines.append(
        f"flops/step  per device: model estimate {model:.3e}"
        + (f", XLA cost analysis {flops:.3e} ({flops / model:.2f}x)" if flops else "")
    )
    trips = r["loop_trips"]
    loops = [f"1 of {n} {what}" for what, n in trips.items() if n > 1]
    if flops and loops:
        lines.append(
            f"            (XLA counts loop bodies once: {', '.join(loops).replace('_', ' ')})"
        )
    return lines


def _size(b: float) -> str:
    """Bytes in the largest binary unit that keeps a whole number in front."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def _step_lines(r: dict) -> list[str]:
    """The step model's account of the compiled HLO, per device and step (loop bodies
    times their trip counts), beside the model's FLOPs."""
    m = r["step_model"]
    costed = m["custom_call_flops"]
    loops = ", ".join(f"{lp['trip_count'] or '?'} trips ({lp['source']})" for lp in m["loops"])
    lines = [
        "step model  per device and step, from the optimized HLO, loops x their trip counts:",
        f"  flops     HLO {m['flops']:.3e} = {m['flops'] / r['model_flops_per_device']:.2f}x "
        "the model estimate" + (f" ({costed:.3e} of it in costed custom calls)" if costed else ""),
        f"  HBM       {_size(m['hbm_bytes'])} read + written (estimate)",
    ]
    if m.get("host_bytes"):
        lines.append(f"  host      {_size(m['host_bytes'])} to and from host memory (offloaded)")
    return (
        lines
        + [f"  loops     {loops or 'none'}"]
        + _collective_lines(m)
        + _custom_call_lines(m)
        + _traffic_lines(m)
        + _estimate_lines(r["estimate"])
        + [f"  note      {n}" for n in m["notes"]]
    )


def _collective_lines(m: dict) -> list[str]:
    """Collectives summed by kind and by the mesh axes they span, per step."""
    lines = []
    for title, key in (("kind", "collectives_by_kind"), ("mesh axes", "collectives_by_axes")):
        lines.append(
            f"  collectives by {title} (runs; result bytes; bytes each chip sends, ring model):"
        )
        lines += [
            f"    {name:22s} {row['runs']:6.0f}  {_size(row['result_bytes']):>11}  "
            f"{_size(row['link_bytes']):>11}"
            for name, row in m[key].items()
        ] or ["    none"]
    return lines


def _custom_call_lines(m: dict) -> list[str]:
    """Custom calls (Pallas kernels) by name: XLA counts no FLOPs for them."""
    if not m["custom_calls"]:
        return []
    return ["  custom calls (runs; operand bytes; result bytes; FLOPs):"] + [
        f"    {name[:40]:40s} {row['runs']:6.0f}  {_size(row['operand_bytes']):>11}  "
        f"{_size(row['result_bytes']):>11}  "
        + (f"{row['flops']:.3e}" if row["flops"] is not None else "not costed")
        for name, row in m["custom_calls"].items()
    ]


def _traffic_lines(m: dict) -> list[str]:
    """The instructions that move the most HBM bytes in a step, with the JAX operation
    each came from: where the HBM term of the estimate goes."""
    rows = m.get("traffic") or []
    if not rows:
        return []
    lines = ["  HBM traffic, largest instructions (bytes a step; runs; opcode; shape; source):"]
    for t in rows:
        shape = re.sub(r"\{[^{}]*\}", "", t["shape"])[:44]  # without layouts
        source = t["source"].split("/")[-3:] if t["source"] else ["?"]
        lines.append(
            f"    {_size(t['bytes']):>11} {t['runs']:5.0f}  {t['opcode'][:14]:14s} "
            f"{shape:44s} {'/'.join(source)[-60:]}"
        )
    return lines


def _estimate_lines(e: dict) -> list[str]:
    """The step time the account implies on this chip, and the assumption behind it."""
    ms = lambda x: "?" if x is None else f"{1e3 * x:.2f}"
    if "compute_s" not in e:
        return [f"  estimate  {n}" for n in e["notes"]]
    lines = [
        f"  estimate  step {ms(e['step_s'])} ms = max(compute {ms(e['compute_s'])}, "
        f"HBM {ms(e['hbm_s'])}) + ICI {ms(e['ici_s'])} + DCN {ms(e['dcn_s'])} ms"
    ]
    if e["step_s"]:
        lines.append(
            f"            {e['tokens_per_s_per_chip']:.0f} tokens/s per chip, MFU "
            f"{100 * e['mfu']:.1f}% (model FLOPs / step time / peak)"
        )
    if e.get("step_lower_s") is not None:
        lines.append(
            f"  bounds    step {ms(e['step_lower_s'])} ms if every part overlapped, "
            f"{ms(e['step_upper_s'])} ms if none did"
            + (" and every MoE round ran" if e.get("every_round_s") else "")
            + (f" (host transfers {ms(e['host_s'])} ms)" if e.get("host_s") else "")
        )
    wrapped = textwrap.wrap(f"({e['assumption']})", 80)
    lines += ["            " + line for line in wrapped]
    return lines + [f"  note      {n}" for n in e["notes"]]


def _verdict_line(r: dict) -> str:
    """Whether the step fits in the chip's HBM, or why that is unknown."""
    if r["fits"] is None:
        return "verdict     unknown HBM size for this chip: pass --hbm_gib"
    if r["fits"]:
        return (
            f"verdict     fits ({r['total_bytes'] / GiB:.2f} GiB <= {r['hbm_bytes'] / GiB:g} GiB)"
        )
    if not r["error"]:
        return (
            f"verdict     does not fit ({r['total_bytes'] / GiB:.2f} GiB > "
            f"{r['hbm_bytes'] / GiB:g} GiB)"
        )
    if "HbmOom" in r["error"] or "memory on HBM" in r["error"]:
        return f"verdict     does not fit ({_needed(r['error'])})"
    if "VmemOom" in r["error"]:
        # One kernel's on-chip scratch, not HBM: the step may fit once that kernel compiles,
        # e.g. with LIBTPU_INIT_ARGS=--xla_tpu_scoped_vmem_limit_kib=<more than its need>.
        return (
            "verdict     does not compile: one kernel needs more scoped VMEM than the "
            "limit (see XLA's message); HBM use is unknown until it compiles"
        )
    return "verdict     does not compile: XLA ran out of memory (see its message)"


def _buffer_lines(r: dict) -> list[str]:
    """The rows of XLA's memory-usage report kept in the result (--top_buffers)."""
    if not r.get("top_buffers"):
        return []
    return [
        "largest HBM buffers (XLA memory-usage report; each row is one buffer and",
        "the values that take turns in it):",
    ] + ["  " + row for row in r["top_buffers"]]


def _needed(error: str) -> str:
    """'17.09 GiB > 15.75 GiB usable' from XLA's out-of-memory message (its wording
    differs between libtpu releases), or the message itself."""
    for pattern in (
        r"\(([\d.]+)G\) exceeds available HBM \(([\d.]+)G\)",
        r"Used ([\d.]+)G of ([\d.]+)G hbm",
    ):
        m = re.search(pattern, error)
        if m:
            return f"{m.group(1)} GiB > {m.group(2)} GiB usable"
    return error


def _engine_setup_lines(r: dict) -> list[str]:
    """An engine program's target, compiler, program, model, timings and sizes."""
    s = r["shape"]
    what = (
        f"decode step of {s['slots']} rows at position {s['context'] - 1}"
        if r["program"] == "decode"
        else f"prefill chunk of {s['chunk']} tokens ending at position {s['context'] - 1}"
    )
    return [
        f"target      {r['devices']} x {r['device_kind']} ({r['topology']}), mesh {r['mesh']}",
        f"compiler    libtpu {r['libtpu_version']}"
        + (f", LIBTPU_INIT_ARGS={r['libtpu_init_args']}" if r["libtpu_init_args"] else ""),
        f"program     the engine's {what}",
        f"model       {r['params_total'] / 1e9:.2f}B params ({r['params_active'] / 1e9:.2f}B "
        f"active), weights {r['weights']}",
        f"time        lower {r['lower_s']:.1f} s, compile {r['compile_s']:.1f} s",
        f"weights     {r['weights_bytes_per_device'] / GiB:.2f} GiB per device; KV cache "
        f"{r['kv_cache_bytes_per_device'] / GiB:.2f} GiB ({s['slots']} slots x "
        f"{s['context']} positions" + (", int8" if s["int8_kv_cache"] else "") + ")",
    ]


def _decode_line(r: dict) -> list[str]:
    """The decode step's tokens/s for the slice, as the step model estimates it."""
    e = r.get("estimate") or {}
    if r["program"] != "decode" or not e.get("step_s"):
        return []
    rows = r["shape"]["slots"]
    return [
        f"decode      {rows / e['step_s']:.0f} tokens/s for the slice at {rows} rows "
        f"({1e3 * e['step_s']:.2f} ms a step; each row {1 / e['step_s']:.0f} tokens/s)"
    ]


def _grpo_lines(r: dict, hbm: int | None) -> list[str]:
    """A GRPO step's two phases, its estimated time, and their verdict."""
    p, est = r["phases"], r["rollout_estimate"]
    lines = ["GRPO step:"]
    if not p:
        return lines + ["  a program did not compile: no phase figures"]
    g = lambda b: f"{b / GiB:.2f} GiB"
    lines += [
        f"  learning  {g(p['learning'])} = the learner step's total + the engine's KV cache "
        f"({g(p['kv_cache'])}, kept between rollouts)",
        f"  rollout   {g(p['rollout'])} = the larger engine program's total + the optimizer "
        f"state and any reference copy ({g(p['beside_engine'])})",
    ]
    if est:
        lines.append(
            f"  estimate  rollout {est['rollout_s']:.1f} s (prefill {est['prefill_s']:.1f} s, "
            f"one slot a call; decode {est['decode_s']:.1f} s at the longest context)"
            + (
                f" + learner {est['learner_s']:.2f} s = {est['grpo_step_s']:.1f} s a step"
                if "learner_s" in est
                else ""
            )
        )
    if hbm:
        peak = max(p["learning"], p["rollout"])
        word = "fits" if peak <= hbm else "does not fit"
        lines.append(f"verdict     {word} ({g(peak)} at the larger phase, of {hbm / GiB:g} GiB)")
    return lines
