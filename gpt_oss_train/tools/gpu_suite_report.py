"""The GPU suite's report (tools/gpu_suite.py): each step's figures, which implementation
`auto` should take on a GPU for each operation (decided from the kernels step alone), and
summary.md.

The rule (`propose_auto`): a GPU kernel becomes the proposed choice when, at every case
the XLA reference was measured at, it ran itself (did not decline the operands and leave
the reference in its place), without error and within TOLERANCE of the reference, and its
time summed over those cases is below the reference's. Of several such kernels the
fastest; with none, the reference. The registry's defaults change by hand, from a report.
"""

from __future__ import annotations

from gpt_oss_train.kernels import registry

# A GPU kernel is within tolerance when every output and gradient is within 4 bf16 ulps
# (2^-8 each) of the reference's largest magnitude: the GPU tests' bound.
TOLERANCE = 4 * 2**-8


def _verdict(mine: list[dict], ref: list[dict], tolerance: float) -> tuple[float | None, str]:
    """(the implementation's time over the reference's cases, or None where it cannot be
    the choice; why)."""
    if not ref or any("ms" not in r for r in ref):
        return None, "no reference time"
    by_case = {r["case"]: r for r in mine}
    for case in (r["case"] for r in ref):
        r = by_case.get(case)
        if r is None:
            return None, f"not measured at {case}"
        if "error" in r:
            return None, f"failed at {case}: {r['error']}"
        if r["runs"] != r["impl"]:
            return None, f"declined the operands at {case} ({r['runs']} ran)"
        if r["rel_err"] > tolerance:
            return None, f"error {r['rel_err']:.3g} > {tolerance:.3g} at {case}"
    ms, ref_ms = sum(by_case[r["case"]]["ms"] for r in ref), sum(r["ms"] for r in ref)
    worst = max(by_case[r["case"]]["rel_err"] for r in ref)
    if ms >= ref_ms:
        return None, f"slower: {ms:.3g} ms against {ref_ms:.3g}"
    return ms, f"{ref_ms / ms:.2f}x faster ({ms:.3g} ms against {ref_ms:.3g}), error {worst:.2g}"


def propose_auto(kernel_records: list[dict], tolerance: float = TOLERANCE) -> dict[str, dict]:
    """{op: {choice, today, why}} from the kernels step's records: the implementation
    `auto` should take on a GPU. A GPU kernel wins when at every case the reference was
    measured at it ran itself (did not decline the operands), without error and within
    `tolerance`, and its time summed over those cases is below the reference's; of
    several winners the fastest; with none, the reference stays."""
    by_op: dict[str, dict[str, list[dict]]] = {}
    for r in kernel_records:
        by_op.setdefault(r["op"], {}).setdefault(r["impl"], []).append(r)
    proposals = {}
    for op, impls in by_op.items():
        ref = impls.get(registry.REFERENCE, [])
        kernels = [n for n in impls if registry.OPS[op].impl(n).platforms == {"gpu"}]
        verdicts = {n: _verdict(impls[n], ref, tolerance) for n in kernels}
        winners = sorted((ms, n) for n, (ms, _) in verdicts.items() if ms is not None)
        proposals[op] = dict(
            choice=winners[0][1] if winners else registry.REFERENCE,
            today=registry.OPS[op].default("gpu"),
            why="; ".join(f"{n}: {why}" for n, (_, why) in verdicts.items()) or "no GPU kernel",
        )
    return proposals


# ----------------------------------------------------------------------------- figures
#
# Each step's figures, from the records its tool printed: {name: number}, names as the
# summary shows them. run_step keeps the finite, positive ones (what was measured).


def kernels_figures(records):
    out = {}
    for r in records:
        if "ms" in r:
            key = f"{r['op']}_{r['impl']}_ms"
            out[key] = out.get(key, 0.0) + r["ms"]
    return out


def attention_figures(records):
    window = lambda r: f"w{r['window'] or 'full'}"
    figs = {f"{r['impl']}_{window(r)}_ms": r.get("ms") for r in records}
    return figs | {f"{r['impl']}_{window(r)}_tflops": r.get("model_tflops") for r in records}


def decode_experts_figures(records):
    return {f"{r['impl']}_b{r['batch']}_us": r["us_per_layer"] for r in records}


def train_figures(records):
    (r,) = records
    return dict(
        tokens_per_sec=r["tokens_per_sec"],
        step_ms=r["step_time_seconds"] * 1e3,
        tflops_per_device=r["per_device_tflops_per_sec"],
        mfu=r["mfu"],
        peak_memory_gb=r["peak_memory_gb"],
    )


def decode_figures(records):
    figs = {"weight_gb": records[0]["weight_gb"]}
    figs |= {f"b{r['batch']}_decode_tok_s": r["decode_tok_s"] for r in records}
    return figs | {f"b{r['batch']}_ttft_ms": r["ttft_ms"] for r in records}


def engine_figures(records):
    runs = {r["run"]: r for r in records}
    t = runs.get("throughput", {})
    return dict(
        start_s=runs.get("start", {}).get("compile_and_warm_s"),
        tok_s=t.get("engine_tok_s"),
        ttft_p50_ms=t.get("ttft_p50_ms"),
        itl_p50_ms=t.get("itl_p50_ms"),
    )


# ----------------------------------------------------------------------------- summary.md


def _cell(v) -> str:
    """A table cell: 3 significant digits; an error message kept on the row."""
    return f"{v:.3g}" if isinstance(v, float) else " ".join(str(v).replace("|", "/").split())


def summary(env: dict, results: list[dict]) -> str:
    device = (env.get("devices") or ["?"])[0]
    head = f"# GPU suite: {device}" + (" (dry run, tiny shapes)" if env.get("dry_run") else "")
    versions = env.get("packages", {})
    lines = [head, "", f"{env.get('date')}, commit {env.get('commit')}, jax {versions.get('jax')}"]
    lines += [f"nvidia-smi: {env.get('nvidia_smi')}", ""]
    lines += ["| step | status | seconds | figures |", "|---|---|---|---|"]
    for r in results:
        figs = ", ".join(f"{k}={_cell(v)}" for k, v in r["figures"].items())
        lines.append(f"| {r['step']} | {r['status']} | {r.get('seconds', '-')} | {figs} |")
    kernels = next((r["records"] for r in results if r["step"] == "kernels"), [])
    if kernels:
        lines += ["", "## Kernels against the XLA reference", ""]
        lines += ["| op | case | implementation | ran | ms | error |", "|---|---|---|---|---|---|"]
        for r in kernels:
            cells = [r["op"], r["case"], r["impl"], r.get("runs", "-"), r.get("ms", "-")]
            cells.append(r.get("rel_err", r.get("error", "-")))
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        lines += ["", f"## Proposed `auto` on a GPU (error at most {TOLERANCE:.3g})", ""]
        lines += ["| op | proposed | today | why |", "|---|---|---|---|"]
        for op, p in propose_auto(kernels).items():
            lines.append(f"| {op} | {p['choice']} | {p['today']} | {_cell(p['why'])} |")
    return "\n".join(lines) + "\n"
