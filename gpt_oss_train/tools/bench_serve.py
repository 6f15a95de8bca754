"""Load test: our server, `transformers serve` and decode's static batch on the same random
Hugging Face checkpoint and the same requests (localhost only, a fixed number of them).

    python -m gpt_oss_train.tools.bench_serve [--checkpoint=HF_DIR] [--concurrency=1,4,16,64] \
        [--requests=64] [--out=docs/load_test] [--skip_transformers]

Requests: text prompts of whole-word tokens (so every tokenizer gives the same ids) with
prompt and output lengths drawn from a seeded distribution; greedy, streamed. At each
concurrency N clients send requests back to back until `--requests` (at least N) are
done. Reported per system and concurrency: output tokens/s, requests/s, time to first
token and inter-token latency p50 / p99. Also: decode --mode=generate's code on all the
requests as one static batch (run twice in one process, the second timed), and the time
to first token of a 1,000-token prompt whose prefix our server has cached against one it
has not. Writes OUT.json, OUT.png (throughput and p99 latencies against concurrency) and
prints a Markdown table.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
from absl import app, flags

from gpt_oss_train import config as config_lib
from gpt_oss_train import errors
from gpt_oss_train.decode import requests
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.server.local import free_port, wait_ready
from gpt_oss_train.io import hf
from gpt_oss_train.io import tokenizer as tok_lib
from gpt_oss_train.tools import bench_serve_client as client

FLAGS = flags.FLAGS
flags.DEFINE_string("checkpoint", None, "HF folder (default: a random tiny one in a temp dir).")
flags.DEFINE_list("concurrency", ["1", "4", "16", "64"], "Concurrent clients per run.")
flags.DEFINE_integer("requests", 24, "Requests per concurrency (at least the concurrency).")
flags.DEFINE_integer("seed", 0, "Seed of the request lengths and prompts.")
flags.DEFINE_integer("max_slots", 16, "Our server's decode slots.")
flags.DEFINE_string("out", "docs/load_test", "Output prefix (.json, .png).")
flags.DEFINE_bool("skip_transformers", False, "Do not run `transformers serve`.")
flags.DEFINE_bool("transformers_cb", True, "Run `transformers serve --continuous-batching`.")
flags.DEFINE_enum("mode", "all", ["all", "static"], "static: the static-batch child process.")
flags.DEFINE_string("static_input", None, "static mode: requests JSON.")

PROMPT_LENGTHS = (32, 64, 128, 256, 512)
OUTPUT_LENGTHS = (16, 32, 64)
MAX_CONTEXT = 2048


def word_tokens(tokenizer) -> list[int]:
    """Ids of ' word' tokens (a space and 3-8 lowercase letters): text made of them
    tokenizes back to exactly them under any o200k tokenizer."""
    pattern = re.compile(rb"^ [a-z]{3,8}$")
    return [i for i in range(100000) if pattern.match(tok_lib.token_bytes(i))]


def make_requests(n: int, seed: int, tokenizer) -> list[dict]:
    rng = random.Random(seed)
    words = word_tokens(tokenizer)
    out = []
    for _ in range(n):
        ids = [rng.choice(words) for _ in range(rng.choice(PROMPT_LENGTHS))]
        out.append(
            {"prompt": tokenizer.decode(ids), "ids": ids, "max_tokens": rng.choice(OUTPUT_LENGTHS)}
        )
    return out


def random_checkpoint(folder: str) -> str:
    """A random gpt-oss of configs/cpu_tiny.py's shape with 4 layers, float32, HF format."""
    spec = importlib.util.spec_from_file_location("cpu_tiny", "configs/cpu_tiny.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    config = module.get_config()
    config.model.num_layers = 4
    model = loading.random_model(config)
    hf.save_hf(
        folder,
        config_lib.model_arch(config),
        jax.tree.map(np.asarray, model.params),
        dtype="float32",
    )
    return folder


def start(cmd: list[str], port: int, log_path: str, timeout_s: float = 900) -> subprocess.Popen:
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    wait_ready(f"http://127.0.0.1:{port}", timeout_s, proc)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def ours(ckpt: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "gpt_oss_train.serve",
        f"--checkpoint={ckpt}",
        f"--port={port}",
        "--dtype=float32",
        f"--max_slots={FLAGS.max_slots}",
        f"--max_context={MAX_CONTEXT}",
        "--max_queue=1024",
        "--served_model_name=model",
        "--grace_period_s=5",
    ]


def transformers_serve(ckpt: str, port: int) -> list[str]:
    exe = os.path.join(os.path.dirname(sys.executable), "transformers")  # the venv's CLI
    cmd = [
        exe,
        "serve",
        ckpt,
        "--device",
        "cpu",
        "--dtype",
        "float32",
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
    ]
    return cmd + (["--continuous-batching"] if FLAGS.transformers_cb else [])


def measure_server(name, cmd_fn, ckpt, reqs, levels, model, workdir) -> dict:
    port = free_port()
    proc = start(cmd_fn(ckpt, port), port, os.path.join(workdir, f"{name}.log"))
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        client.run_level(url, model, reqs[:2], 1)  # warm-up: compile, first load
        rows = {}
        for c in levels:
            n = max(FLAGS.requests, c)
            before = client.counters(url)
            rows[c] = client.run_level(url, model, (reqs * 4)[:n], c)
            after = client.counters(url)
            rows[c].update(client.step_profile(before, after, rows[c]["wall_s"]))
            print(f"{name} c={c}: {client.fmt(rows[c])}", flush=True)
        extra = client.prefix_cache_ttft(url, model, reqs) if name == "ours" else {}
    finally:
        stop(proc)
    return {"levels": rows, **extra}


def static_batch(ckpt: str, reqs: list[dict], workdir: str) -> dict:
    path = os.path.join(workdir, "static_requests.json")
    with open(path, "w") as f:
        json.dump(reqs, f)
    tool = [sys.executable, "-m", "gpt_oss_train.tools.bench_serve"]
    cmd = [*tool, "--mode=static", f"--checkpoint={ckpt}"]
    out = subprocess.run(cmd + [f"--static_input={path}"], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"static batch failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _static_child() -> dict:
    """decode --mode=generate's code path on every request in one batch, timed warm."""
    reqs = json.load(open(FLAGS.static_input))
    longest = max(r["max_tokens"] for r in reqs)
    lines = "".join(
        json.dumps({"tokens": r["ids"], "max_new_tokens": longest}) + "\n" for r in reqs
    )
    model = loading.load_model(FLAGS.checkpoint, dtype="float32")
    opts = loading.Options(batch_size=len(reqs), max_new_tokens=longest)
    requests.run_generate(model, lines.encode(), opts)  # compile
    start_t = time.perf_counter()
    records = requests.run_generate(model, lines.encode(), opts)
    wall = time.perf_counter() - start_t
    useful = sum(min(len(rec["tokens"]), r["max_tokens"]) for rec, r in zip(records, reqs))
    computed = sum(len(rec["tokens"]) for rec in records)
    return {
        "wall_s": wall,
        "useful_tok_s": useful / wall,
        "computed_tok_s": computed / wall,
        "rows": len(reqs),
        "max_new_tokens": longest,
    }


def main(argv):
    del argv
    if FLAGS.mode == "static":
        print(json.dumps(_static_child()))
        return 0
    levels = [int(c) for c in FLAGS.concurrency]
    workdir = tempfile.mkdtemp(prefix="load_test_")
    ckpt = FLAGS.checkpoint or random_checkpoint(os.path.join(workdir, "model"))
    reqs = make_requests(max(FLAGS.requests, max(levels)), FLAGS.seed, tok_lib.Tokenizer())
    results = {
        "checkpoint": ckpt,
        "requests": FLAGS.requests,
        "seed": FLAGS.seed,
        "max_slots": FLAGS.max_slots,
        "systems": {},
    }
    results["systems"]["ours"] = measure_server("ours", ours, ckpt, reqs, levels, "model", workdir)
    if not FLAGS.skip_transformers:
        name = "transformers serve" + (" --continuous-batching" if FLAGS.transformers_cb else "")
        results["systems"][name] = measure_server(
            "transformers", transformers_serve, ckpt, reqs, levels, ckpt, workdir
        )
    results["static"] = static_batch(ckpt, reqs[: max(levels)], workdir)
    print("static batch:", results["static"], flush=True)
    os.makedirs(os.path.dirname(FLAGS.out) or ".", exist_ok=True)
    with open(FLAGS.out + ".json", "w") as f:
        json.dump(results, f, indent=1)
    client.plot(results, levels, FLAGS.out + ".png")
    print(client.markdown(results, levels))
    return 0


if __name__ == "__main__":
    app.run(main, flags_parser=errors.parse_flags)
