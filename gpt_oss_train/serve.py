"""Serve a GPT-OSS checkpoint behind OpenAI's API (chat, completions, streaming, Harmony
reasoning and tool calls):

    python -m gpt_oss_train.serve --checkpoint=DIR [--host=127.0.0.1 --port=8000
        --max_slots=8 --max_context=N --dtype=float32 --weights=mxfp4 --int8_kv_cache
        --served_model_name=NAME --api_key=KEY --adapter=NAME=DIR,NAME2=DIR2
        --max_request_bytes=16777216 --grace_period_s=30 --config.mesh.tensor=2 ...]

--checkpoint and --config are decode's (an Orbax checkpoint or a Hugging Face folder; the
runtime config sets mesh, dtype and kernels). The engine starts with --max_slots decode
slots of --max_context positions each and says what memory it holds. Without
--max_context a slot holds 4096 positions, or the model's max_position_embeddings if it
has fewer (the log says which); a --max_context above the model's positions is refused.

The port is bound, and listens, before the model loads: a port in use is one error line
(exit 2) at once, and nothing else can take the port meanwhile; a connection made while
the model loads waits until the server serves (/health answers 200 from then on). A
request body over --max_request_bytes gets 413 before it is read whole.

SIGTERM (or Ctrl-C) drains: the listener keeps accepting, /health answers 503 and every
new /v1 request gets 503 (OpenAI's error JSON, Retry-After), while the running requests go
on for up to --grace_period_s seconds. Those still running then are ended by the engine:
a stream gets a last chunk with finish_reason "abort" (vLLM's) and `data: [DONE]`, a
whole response a 503 saying the server is shutting down. Then the listener closes and the
process exits 0 (at once when no request is running). A second Ctrl-C stops waiting.

--api_key=KEY (or the environment variable GPT_OSS_TRAIN_API_KEY when the flag is not
given; the variable keeps the key out of `ps`): every /v1/* request must send
`Authorization: Bearer KEY`, else it gets 401 with OpenAI's error JSON (code
"invalid_api_key"); /health and /metrics stay open. The `openai` client sends its
`api_key` that way. Serving on an address other than loopback without a key logs a
warning: anyone who can reach the port can use the model.

--adapter is decode's: LoRA adapters beside the base, never merged. --adapter=DIR: every
request uses that adapter. --adapter=NAME=DIR,...: a request picks one by sending
"model": NAME (the served model name gives the base), and /v1/models lists them all.
"""

from __future__ import annotations

import contextlib
import errno
import ipaddress
import os
import signal
import socket
import time

from absl import app, flags, logging
from ml_collections import config_flags

from gpt_oss_train import errors, hosts
from gpt_oss_train.inference import adapters as adapters_lib
from gpt_oss_train.inference import loading
from gpt_oss_train.inference.loading import DecodeError

DEFAULT_MAX_CONTEXT = 4096  # positions per slot without --max_context, if the model has them
# A full 131072-position context is about 1 MiB as JSON token ids, under 1 MiB as typical
# text (6 MiB even if every character were \u-escaped): 16 MiB takes any request that fits
# the model, with room for a batch of prompts, and keeps one client from making the server
# buffer gigabytes.
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20
BACKLOG = 2048  # connections waiting to be accepted (uvicorn's default)
API_KEY_ENV = "GPT_OSS_TRAIN_API_KEY"
PEER_LOST_LINGER_S = 2.0  # /health says 503 this long before a lost peer ends process 0


def get_config():
    """The runtime config without --config (this file is --config's default)."""
    return loading.default_runtime_config()


def _define_flags():
    config_flags.DEFINE_config_file(
        "config", os.path.abspath(__file__), "Runtime config (mesh, dtype, kernels)."
    )
    flags.DEFINE_string(
        "checkpoint",
        None,
        "Orbax checkpoint / workdir, or a HF gpt-oss folder (with --adapter: default, the "
        "base the adapter was trained on).",
    )
    flags.DEFINE_list(
        "adapter",
        [],
        "LoRA adapters beside the base, unmerged: DIR (every request uses it) or "
        'NAME=DIR,NAME2=DIR2 (a request sends "model": NAME; the served name: the base). '
        "DIR: a PEFT adapter folder or a LoRA training workdir.",
    )
    flags.DEFINE_string("host", "127.0.0.1", "Address to listen on (0.0.0.0: every interface).")
    flags.DEFINE_integer("port", 8000, "Port to listen on.")
    flags.DEFINE_string("served_model_name", None, "Model name in the API (default: folder name).")
    flags.DEFINE_integer("max_slots", 8, "Requests decoded together (continuous batching).")
    flags.DEFINE_integer(
        "max_context",
        None,
        f"Most positions (prompt + output) per request (default: {DEFAULT_MAX_CONTEXT}, or the "
        "model's max_position_embeddings if fewer).",
    )
    flags.DEFINE_string(
        "api_key",
        None,
        "Key clients must send on /v1/* as 'Authorization: Bearer KEY' (default: "
        f"${API_KEY_ENV}; neither: no key). /health and /metrics stay open.",
    )
    flags.DEFINE_integer("prefill_chunk", 256, "Most prompt tokens per prefill step.")
    flags.DEFINE_integer("max_queue", 0, "Most requests waiting for a slot (0: the engine's).")
    flags.DEFINE_integer(
        "prefix_cache_tokens", -1, "Prompt tokens kept for reuse (-1: the engine's, 0: off)."
    )
    flags.DEFINE_enum("dtype", None, ["float32", "bfloat16"], "Compute dtype.")
    flags.DEFINE_bool("int8_weights", False, "int8 weight-only quantized matmuls.")
    loading.define_weights_flag()
    flags.DEFINE_bool("int8_kv_cache", False, "int8 KV cache.")
    flags.DEFINE_integer(
        "max_request_bytes",
        DEFAULT_MAX_REQUEST_BYTES,
        "Largest request body, in bytes; a larger one gets 413 before it is read whole. The "
        "default (16 MiB) is many times a full 131072-token context as JSON (about 1 MiB), "
        "and bounds the memory one request can make the server hold.",
    )
    flags.DEFINE_float(
        "grace_period_s",
        30.0,
        "On SIGTERM: how long running requests may go on (new ones get 503 meanwhile); "
        'those still running then end (a stream with finish_reason "abort", else 503).',
    )
    flags.DEFINE_bool("access_log", False, "Log every HTTP request.")


def _check_flags(f) -> None:
    if not 0 <= f.port < 65536:
        raise DecodeError(f"--port must be in [0, 65536), got {f.port}")
    for name in ("max_slots", "max_context", "prefill_chunk"):
        if f[name].value is not None and f[name].value < 1:
            raise DecodeError(f"--{name} must be >= 1, got {f[name].value}")
    if f.max_queue < 0 or f.grace_period_s < 0:
        raise DecodeError("--max_queue and --grace_period_s must be >= 0")
    if f.max_request_bytes < 1:
        raise DecodeError(f"--max_request_bytes must be >= 1, got {f.max_request_bytes}")


def listen(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port) and listening, made before the model loads: a port in
    use is one line (DecodeError, exit 2) at once rather than after minutes of loading, and
    uvicorn serves this very socket, so no other process can take the port in between."""
    name = host.strip("[]") or None  # "": every interface
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            name, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise DecodeError(f"--host={host}: cannot resolve it ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    try:
        # as uvicorn does: a restart need not wait for the last run's closed connections
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise DecodeError(
                f"--port={port}: address already in use (on {host or 'every interface'}); "
                "stop what listens there or give another --port"
            ) from None
        raise DecodeError(
            f"--host={host} --port={port}: cannot listen there ({e.strerror})"
        ) from None
    return sock


def choose_max_context(flag: int | None, model_positions: int) -> tuple[int, str]:
    """(positions per slot, why): --max_context if given (no more than the model has),
    else DEFAULT_MAX_CONTEXT or the model's max_position_embeddings, the fewer."""
    if flag is not None:
        if flag > model_positions:
            raise DecodeError(
                f"--max_context={flag} exceeds the model's max_position_embeddings="
                f"{model_positions}; give at most {model_positions} or leave it out"
            )
        return flag, "--max_context"
    if model_positions < DEFAULT_MAX_CONTEXT:
        return model_positions, "the model's max_position_embeddings; --max_context to change"
    return DEFAULT_MAX_CONTEXT, (
        f"the default; the model has {model_positions} positions, --max_context to use more"
    )


def choose_api_key(flag: str | None) -> str | None:
    """--api_key, else $GPT_OSS_TRAIN_API_KEY; "" (either) means no key."""
    key = os.environ.get(API_KEY_ENV) if flag is None else flag
    return key or None


def open_host_warning(host: str, key: str | None) -> str | None:
    """The warning to log when the server listens beyond this machine without a key."""
    if key or host == "localhost":
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:  # a host name, or "" (every interface): it may be reachable
        pass
    return (
        f"--host={host} is not a loopback address and no API key is set: anyone who can "
        f"reach this port can use the model; set --api_key or ${API_KEY_ENV}"
    )


def _engine(f, adapters, positions: int, link: hosts.Link):
    # lazy: start-up (the engine's modules, ~30 ms: not for --help or a bad flag)
    from gpt_oss_train.inference.engine import Engine

    kw = dict(
        link=link,
        adapters=adapters,
        config=f["config"].value,
        dtype=f.dtype,
        max_slots=f.max_slots,
        max_context=positions,
        prefill_chunk=f.prefill_chunk,
        int8_weights=f.int8_weights,
        weights=f.weights,
        int8_kv_cache=f.int8_kv_cache,
    )
    if f.max_queue:
        kw["max_queue"] = f.max_queue
    if f.prefix_cache_tokens >= 0:
        kw["prefix_cache_tokens"] = f.prefix_cache_tokens
    return Engine.from_checkpoint(f.checkpoint, **kw)


def serve(app_, sock: socket.socket, grace_s: float, access_log: bool = False) -> None:
    """Run the app on the listening socket `sock` until SIGTERM / SIGINT, then drain
    (inference/server/drain.py) for up to `grace_s` seconds with the listener still
    accepting; returns once every request has had its answer."""
    # lazy: start-up (fastapi and uvicorn, ~0.2 s; not for --help or a bad flag)
    import uvicorn

    from gpt_oss_train.inference.server.drain import FINISH_S

    drain, engine = app_.state.drain, app_.state.server.engine

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            drain.begin(grace_s)  # /health and new /v1 requests: 503 from now on
            super().handle_exit(sig, frame)

        async def main_loop(self):
            await super().main_loop()  # until SIGTERM / SIGINT
            # uvicorn would now close the listener, wait grace_s, and cancel the running
            # requests mid-response; instead they finish (or the engine ends them) first.
            await drain.finish(engine, forced=lambda: self.force_exit)

        @contextlib.contextmanager
        def capture_signals(self):
            # uvicorn re-raises a caught SIGTERM after its graceful shutdown, which ends
            # the process with status 143; here SIGTERM is the normal way to stop: exit 0.
            with super().capture_signals():
                yield
                self._captured_signals.clear()

    config = uvicorn.Config(
        app_,
        timeout_graceful_shutdown=FINISH_S,  # after the drain: answers already sent
        access_log=access_log,
        log_level="info",
        lifespan="off",
    )
    Server(config).run(sockets=[sock])


def _run(f, link: hosts.Link) -> int:
    """Process 0 binds the port, takes the requests and schedules the engine; every other
    process loads its shards of the same model and runs process 0's rounds with it."""
    _check_flags(f)
    key = choose_api_key(f.api_key)
    warning = open_host_warning(f.host, key)
    if warning:
        logging.warning("%s", warning)
    adapters = adapters_lib.parse_flag(f.adapter)
    if adapters and not f.checkpoint:
        f.checkpoint = adapters_lib.base_of(adapters)
    kind = loading.checkpoint_kind(f.checkpoint)
    arch = loading.read_architecture(f.checkpoint, kind)
    positions, why = choose_max_context(f.max_context, arch["max_position_embeddings"])
    logging.info("max_context %d (%s)", positions, why)
    name = f.served_model_name or os.path.basename(os.path.abspath(f.checkpoint))
    if name in [n for n, _ in adapters]:
        raise DecodeError(
            f"--adapter: {name!r} is also the served model's name (the base); rename the "
            "adapter or pass --served_model_name"
        )
    sock = link.agree(lambda: listen(f.host, f.port))  # before the model loads
    try:
        if not link.leader:
            return _follow(_engine(f, adapters, positions, link))
        return _load_and_serve(f, adapters, positions, arch["vocab_size"], name, key, sock, link)
    finally:
        if sock is not None:
            sock.close()


def _follow(eng) -> int:
    """A process other than 0: runs process 0's rounds until process 0 closes the link
    (it has drained and stopped). SIGTERM is process 0's to act on: the launcher sends it
    to every process, and this one goes on until process 0 has drained."""
    signal.signal(
        signal.SIGTERM,
        lambda *_: logging.info("SIGTERM: following process 0 until it has drained"),
    )
    eng.follow()
    logging.info("Server stopped (process 0 closed the link)")
    return 0


def _load_and_serve(f, adapters, positions, vocab: int, name: str, key, sock, link) -> int:
    # lazy: start-up (fastapi, ~0.3 s; not for --help or a bad flag)
    from gpt_oss_train.inference.server.app import create_app

    eng = _engine(f, adapters, positions, link)
    # While a peer is gone /health says 503, for the moment before this process exits.
    link.on_lost(lambda _: time.sleep(PEER_LOST_LINGER_S))
    eng.start()
    app_ = create_app(
        eng,
        tokenizer=loading.tokenizer(),
        model_name=name,
        max_context=positions,
        vocab_size=vocab,
        api_key=key,
        max_request_bytes=f.max_request_bytes,
    )
    served = ", ".join((name, *eng.adapters))
    host, port = sock.getsockname()[:2]
    host = f"[{host}]" if ":" in host else host
    logging.info("Serving %s at http://%s:%d/v1", served, host, port)
    if key:
        source = "--api_key" if f.api_key else f"${API_KEY_ENV}"
        logging.info("/v1/* requires the API key of %s", source)
    try:
        serve(app_, sock, f.grace_period_s, f.access_log)
    finally:
        eng.stop(0.0)
    logging.info("Server stopped")
    return 0


def main(argv):
    return hosts.command(lambda link: _run(flags.FLAGS, link), argv)


def run():
    """The `gpt-oss-serve` console script: `python -m gpt_oss_train.serve`."""
    _define_flags()
    app.run(main, flags_parser=errors.parse_flags)


if __name__ == "__main__":
    run()
